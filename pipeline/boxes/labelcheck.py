"""Likely errors in box labels, found by comparing each image's labeled boxes with the model's predicted boxes —
the idea of cleanlab's object_detection module (overlooked, swapped, badly located), restated for VLM answers,
whose boxes carry at most one score and no per-class probabilities.

For each labeled box: its best IoU with a predicted box of the same class (`same`), and with a confident predicted
box of another class (`other`).

============== ======================================================== =============================================
issue          when                                                     score (how sure; rank by it)
============== ======================================================== =============================================
missing        a confident prediction overlaps no labeled box            the prediction's score
               (best IoU < `overlap_iou`): an object nobody boxed
swapped        `other` ≥ `match_iou` and `same` < `match_iou`: the box   the prediction's score × its IoU
               is right, the class is not
badly_placed   `overlap_iou` ≤ `same` < `match_iou` (not swapped): the   the prediction's score × (1 − IoU)
               model puts the same class nearby, not there
============== ======================================================== =============================================

A prediction without a score counts as 1.0; "confident" is score ≥ `min_score`. The predictions should be
out-of-sample (a model that trained on these labels repeats their mistakes), as for one-answer label checks.
An image's score is its most sure issue's (`image_scores`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.boxes.box import Box
from pipeline.boxes.matching import iou_matrix
from pipeline.errors import DataError

ISSUE_KINDS = ("missing", "swapped", "badly_placed")


@dataclass(frozen=True)
class BoxCheckThresholds:
    """`match_iou`: a predicted box this close is the same object (COCO's 0.5). `overlap_iou`: below it, two boxes
    are different objects. `min_score`: predictions under it neither report missing boxes nor swapped classes."""

    match_iou: float = 0.5
    overlap_iou: float = 0.1
    min_score: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.overlap_iou < self.match_iou <= 1 or not 0 <= self.min_score <= 1:
            raise DataError(f"box label check: need 0 < overlap_iou < match_iou ≤ 1 and 0 ≤ min_score ≤ 1, got "
                            f"{self}; the defaults are overlap_iou 0.1, match_iou 0.5, min_score 0.5")


@dataclass(frozen=True)
class BoxIssue:
    """One likely error: `kind` (ISSUE_KINDS), the image, the labeled box concerned (`label_index` into the image's
    labeled boxes; None for a missing box), the predicted box that suggests the fix, a score, and the sentence a
    person reads."""

    image: str
    kind: str
    label_index: int | None
    suggestion: Box
    score: float
    reason: str


def _conf(b: Box) -> float:
    return 1.0 if b.score is None else float(b.score)


def _labeled_issues(image: str, labels: Sequence[Box], predicted: Sequence[Box], ious: np.ndarray,
                    t: BoxCheckThresholds) -> list[BoxIssue]:
    out = []
    for i, lab in enumerate(labels):
        same = [(float(ious[i, j]), j) for j, p in enumerate(predicted) if p.label == lab.label]
        other = [(float(ious[i, j]), j) for j, p in enumerate(predicted)
                 if p.label != lab.label and _conf(p) >= t.min_score]
        best_same, js = max(same, default=(0.0, -1))
        best_other, jo = max(other, default=(0.0, -1))
        if best_other >= t.match_iou and best_same < t.match_iou:
            p = predicted[jo]
            out.append(BoxIssue(image, "swapped", i, p, round(_conf(p) * best_other, 6),
                                f"{image}: box {i} is labeled {lab.label!r}; the model sees a {p.label!r} there "
                                f"(IoU {best_other:.2f}, score {_conf(p):.2f})"))
        elif t.overlap_iou <= best_same < t.match_iou:
            p = predicted[js]
            out.append(BoxIssue(image, "badly_placed", i, p, round(_conf(p) * (1 - best_same), 6),
                                f"{image}: box {i} ({lab.label!r}) overlaps the model's {p.label!r} by IoU "
                                f"{best_same:.2f} only; redraw it ({p.x:.0f}, {p.y:.0f}, {p.w:.0f} × {p.h:.0f} px?)"))
    return out


def check_image(image: str, labels: Sequence[Box], predicted: Sequence[Box],
                thresholds: BoxCheckThresholds = BoxCheckThresholds()) -> list[BoxIssue]:
    """The likely errors in one image's labeled boxes, given the model's predicted boxes for it (original pixels)."""
    t = thresholds
    ious = iou_matrix(labels, predicted)
    out = _labeled_issues(image, labels, predicted, ious, t)
    for j, p in enumerate(predicted):
        best = float(ious[:, j].max()) if labels else 0.0
        if _conf(p) >= t.min_score and best < t.overlap_iou:
            out.append(BoxIssue(image, "missing", None, p, round(_conf(p), 6),
                                f"{image}: the model sees a {p.label!r} at ({p.x:.0f}, {p.y:.0f}, {p.w:.0f} × "
                                f"{p.h:.0f} px, score {_conf(p):.2f}) that no labeled box covers"))
    return out


def check_boxes(labels: Mapping[str, Sequence[Box]], predicted: Mapping[str, Sequence[Box]],
                thresholds: BoxCheckThresholds = BoxCheckThresholds()) -> list[BoxIssue]:
    """Every labeled image's likely errors (an image the model gave no answer for is skipped: no evidence), most
    sure first."""
    issues = [i for image, boxes in labels.items() if image in predicted
              for i in check_image(image, boxes, predicted[image], thresholds)]
    return sorted(issues, key=lambda i: (-i.score, i.image, i.kind))


def image_scores(issues: Sequence[BoxIssue]) -> dict[str, float]:
    """Image → its most sure issue's score: the order to send images back for review."""
    out: dict[str, float] = {}
    for i in issues:
        out[i.image] = max(out.get(i.image, 0.0), i.score)
    return out
