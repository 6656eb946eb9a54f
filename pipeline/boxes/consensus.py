"""Several annotators' boxes for one image → one set of boxes, matched by IoU.

The rule: boxes are grouped across annotators by Hungarian matching on IoU (≥ `match_iou`, classes ignored so that
a disagreement about the class lands in one group), each annotator's boxes matched to the groups made so far. A
group that a majority of the annotators drew (more than half; with two, both) becomes a box: the median of its
members' corners, its class the members' majority class. A group whose class vote ties makes the whole image
undecided (`boxes` None), as a tie in a one-answer majority vote does: it goes to another annotator.

The confidence of the decision is the annotators' mean pairwise agreement (pipeline.boxes.matching.agreement:
IoU × same class over Hungarian-matched pairs, unmatched boxes counting as disagreement), in [0, 1]; each
annotator's own agreement with the decision is there too, for annotator quality.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations

from pipeline.boxes.box import Box
from pipeline.boxes.matching import agreement, match_boxes


@dataclass(frozen=True)
class BoxDecision:
    """`boxes`: the consensus (None: undecided, a class tie). `confidence`: mean pairwise agreement among the
    annotators. `agreement`: each annotator's agreement with the consensus (empty when undecided). `outcome`:
    "agreed" (one annotator, or all identical), "majority", "tie"."""

    boxes: tuple[Box, ...] | None
    confidence: float
    agreement: dict[str, float]
    outcome: str


def _groups(answers: Mapping[str, Sequence[Box]], match_iou: float) -> list[list[Box]]:
    groups: list[list[Box]] = []
    for boxes in answers.values():
        heads = [_merged(g) for g in groups]
        taken = {p.j: p.i for p in match_boxes(heads, boxes, min_iou=match_iou)}
        for j, b in enumerate(boxes):
            if j in taken:
                groups[taken[j]].append(b)
            else:
                groups.append([b])
    return groups


def _merged(group: Sequence[Box], label: str | None = None) -> Box:
    """The median corners of a group's boxes."""
    x1 = statistics.median(b.x for b in group)
    y1 = statistics.median(b.y for b in group)
    x2 = statistics.median(b.x2 for b in group)
    y2 = statistics.median(b.y2 for b in group)
    return Box.from_corners(label or group[0].label, x1, y1, x2, y2)


def box_consensus(answers: Mapping[str, Sequence[Box]], *, match_iou: float = 0.5) -> BoxDecision:
    """The consensus of `answers` (annotator → that annotator's boxes for one image)."""
    names = list(answers)
    pairs = list(combinations(names, 2))
    confidence = (sum(agreement(answers[a], answers[b]) for a, b in pairs) / len(pairs)) if pairs else 1.0
    need = len(names) // 2 + 1
    kept: list[Box] = []
    for group in _groups(answers, match_iou):
        if len(group) < need:
            continue
        ranked = Counter(b.label for b in group).most_common()
        if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
            return BoxDecision(None, confidence, {}, "tie")
        kept.append(_merged(group, ranked[0][0]))
    outcome = "agreed" if confidence == 1.0 else "majority"
    return BoxDecision(tuple(kept), confidence, {n: agreement(answers[n], kept) for n in names}, outcome)
