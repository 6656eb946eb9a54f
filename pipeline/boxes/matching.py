"""IoU between boxes and the one-to-one matching every box comparison here stands on (evaluation's helpers,
uncertainty's agreement, the label check, consensus across annotators).

A matching is Hungarian (scipy.optimize.linear_sum_assignment) on IoU: the pairs that together overlap most, each
box used once, pairs under `min_iou` dropped. Greedy matching (COCO's, by score) is evaluation's rule and lives in
the library that computes mAP; agreement between two answers has no scores to order by, so it takes the best whole
assignment instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.boxes.box import Box


def iou_matrix(a: Sequence[Box], b: Sequence[Box]) -> np.ndarray:
    """[len(a), len(b)] intersection over union of every pair (labels ignored); 0 where a box has no area."""
    if not a or not b:
        return np.zeros((len(a), len(b)))
    p = np.array([[x.x, x.y, x.x2, x.y2] for x in a], dtype=float)[:, None, :]
    q = np.array([[x.x, x.y, x.x2, x.y2] for x in b], dtype=float)[None, :, :]
    iw = np.clip(np.minimum(p[..., 2], q[..., 2]) - np.maximum(p[..., 0], q[..., 0]), 0, None)
    ih = np.clip(np.minimum(p[..., 3], q[..., 3]) - np.maximum(p[..., 1], q[..., 1]), 0, None)
    inter = iw * ih
    area_p = (p[..., 2] - p[..., 0]) * (p[..., 3] - p[..., 1])
    area_q = (q[..., 2] - q[..., 0]) * (q[..., 3] - q[..., 1])
    union = area_p + area_q - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def iou(a: Box, b: Box) -> float:
    return float(iou_matrix([a], [b])[0, 0])


@dataclass(frozen=True)
class Pair:
    """Box `i` of the first list matched to box `j` of the second, overlapping by `iou`."""

    i: int
    j: int
    iou: float


def match_boxes(a: Sequence[Box], b: Sequence[Box], *, min_iou: float = 1e-9,
                same_label: bool = False) -> list[Pair]:
    """The one-to-one matching of `a` to `b` with the largest total IoU (Hungarian), pairs under `min_iou` left
    out. With `same_label`, boxes of different labels never pair."""
    from scipy.optimize import linear_sum_assignment

    m = iou_matrix(a, b)
    if same_label and m.size:
        m = m * np.array([[x.label == y.label for y in b] for x in a])
    if not m.size:
        return []
    rows, cols = linear_sum_assignment(m, maximize=True)
    return [Pair(int(i), int(j), float(m[i, j])) for i, j in zip(rows, cols, strict=True) if m[i, j] >= min_iou]


def agreement(a: Sequence[Box], b: Sequence[Box]) -> float:
    """How much two answers agree, in [0, 1]: Σ over matched pairs of IoU × [same label], divided by the larger
    list's length, so an unmatched box on either side counts as full disagreement. Two empty answers agree (1.0).

    The pairs are matched on IoU alone (not per label), so a box drawn in the right place with the wrong class
    counts against agreement instead of leaving both boxes unmatched twice."""
    if not a and not b:
        return 1.0
    pairs = match_boxes(a, b)
    return sum(p.iou for p in pairs if a[p.i].label == b[p.j].label) / max(len(a), len(b))
