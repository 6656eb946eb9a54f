"""What a model got wrong on one test image's boxes, kind by kind, for the round report's error gallery (a box
answer is never equal to its label as text, so "the answer differs" says nothing).

The labeled and predicted boxes are paired one to one by Hungarian matching on IoU, classes ignored
(pipeline/boxes/matching.py), pairs under `overlap_iou` dropped; the thresholds are the box label check's
(`BoxCheckThresholds`: match_iou 0.5, COCO's; overlap_iou 0.1):

============ ========================================================================================
kind         when
============ ========================================================================================
missed       a labeled box no predicted box overlaps (IoU < overlap_iou): an object the model did not find
wrong_class  a predicted box on a labeled one (IoU ≥ match_iou) with another class
misplaced    a predicted box near a labeled one (overlap_iou ≤ IoU < match_iou), whatever its class
extra        a predicted box that overlaps no labeled box: something the model saw that is not there
============ ========================================================================================

A pair at IoU ≥ match_iou with the right class is a hit, no error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.boxes.box import Box
from pipeline.boxes.labelcheck import BoxCheckThresholds
from pipeline.boxes.matching import match_boxes

KINDS = ("missed", "wrong_class", "misplaced", "extra")


@dataclass(frozen=True)
class BoxMistakes:
    """One image's model errors: the labeled boxes missed, (labeled, predicted) pairs with the wrong class or
    misplaced, and the extra predicted boxes; `hits` the pairs right in place and class."""

    missed: tuple[Box, ...] = ()
    wrong_class: tuple[tuple[Box, Box], ...] = ()
    misplaced: tuple[tuple[Box, Box], ...] = ()
    extra: tuple[Box, ...] = ()
    hits: int = 0

    @property
    def count(self) -> int:
        return len(self.missed) + len(self.wrong_class) + len(self.misplaced) + len(self.extra)

    def counts(self) -> dict[str, int]:
        return {k: len(getattr(self, k)) for k in KINDS}

    def sentence(self) -> str:
        """'2 missed (disc, square) · 1 wrong class (square → disc) · 1 misplaced (triangle, IoU 0.31)', or
        'no box error'."""
        parts = []
        if self.missed:
            parts.append(f"{len(self.missed)} missed ({', '.join(b.label for b in self.missed)})")
        if self.wrong_class:
            parts.append(f"{len(self.wrong_class)} wrong class ("
                         + ", ".join(f"{a.label} → {b.label}" for a, b in self.wrong_class) + ")")
        if self.misplaced:
            from pipeline.boxes.matching import iou

            parts.append(f"{len(self.misplaced)} misplaced ("
                         + ", ".join(f"{a.label}, IoU {iou(a, b):.2f}" for a, b in self.misplaced) + ")")
        if self.extra:
            parts.append(f"{len(self.extra)} extra ({', '.join(b.label for b in self.extra)})")
        return " · ".join(parts) or "no box error"


def box_mistakes(labeled: Sequence[Box], predicted: Sequence[Box],
                 thresholds: BoxCheckThresholds = BoxCheckThresholds()) -> BoxMistakes:
    """One image's errors (module docstring), labeled and predicted boxes both in the image's pixels."""
    pairs = match_boxes(labeled, predicted, min_iou=thresholds.overlap_iou)
    paired_l, paired_p = {p.i for p in pairs}, {p.j for p in pairs}
    wrong, misplaced, hits = [], [], 0
    for p in pairs:
        a, b = labeled[p.i], predicted[p.j]
        if p.iou < thresholds.match_iou:
            misplaced.append((a, b))
        elif a.label != b.label:
            wrong.append((a, b))
        else:
            hits += 1
    return BoxMistakes(missed=tuple(b for i, b in enumerate(labeled) if i not in paired_l),
                       wrong_class=tuple(wrong), misplaced=tuple(misplaced),
                       extra=tuple(b for j, b in enumerate(predicted) if j not in paired_p), hits=hits)
