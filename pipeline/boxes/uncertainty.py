"""How unsure a model is of an image's boxes: pure functions over `Box` lists, higher = more worth labeling.

A VLM writes boxes as text, so it has no regression head and no per-box class probabilities; the digits' token
probabilities say little about where a box is. What does: whether the boxes hold still when the input moves.

====================== =================== ========================================================================
part                   reads (BoxEvidence) score
====================== =================== ========================================================================
augment_consistency    boxes + views       1 − mean over views of agreement(answer, view's answer mapped back):
                                           matched-box IoU with the class disagreement folded in (CALD, arXiv
                                           2103.10374; localization stability, Kao et al., arXiv 1801.05124)
sample_agreement       boxes + samples     1 − mean pairwise agreement among the answer and its sampled answers
                                           (Hungarian-matched IoU × same class)
token_entropy          token_entropies     mean per-token entropy of the answer: the baseline, the number the
                                           one-answer `token_entropy` heuristic gives
====================== =================== ========================================================================

From boxes to an image score (the rule every part above states the same way): two answers agree by
`pipeline.boxes.matching.agreement`, Σ over Hungarian-matched pairs of IoU × [same class] divided by the larger
answer's box count. A box either answer has and the other lacks counts as full disagreement, so a box that comes
and goes under a flip weighs as much as one that moves; two empty answers agree fully (an image where the model
sees nothing, steadily, scores 0). Each part also gives one uncertainty per answer box (`BoxScore.boxes`: 1 − that
box's mean IoU × [same class] with its match, 1 when unmatched), which class-balanced selection and the Label
Studio export read.

`BOX_UNCERTAINTIES` maps a name to its part; a part says which evidence it reads (`input`) and what produces it
(`requires`), and refuses evidence without it with that sentence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import TYPE_CHECKING, ClassVar

from pipeline.boxes.box import Box
from pipeline.boxes.matching import agreement, match_boxes
from pipeline.errors import SelectionError

if TYPE_CHECKING:
    from PIL.Image import Image


@dataclass(frozen=True)
class BoxEvidence:
    """What the model said about one image: its answer's boxes (original pixels), the boxes it answered on augmented
    views mapped back to original pixels (`View.to_original`), sampled answers' boxes, and the answer's per-token
    entropies (nats)."""

    boxes: Sequence[Box]
    views: Sequence[Sequence[Box]] = ()
    samples: Sequence[Sequence[Box]] = ()
    token_entropies: Sequence[float] = ()


@dataclass(frozen=True)
class BoxScore:
    """`image`: the image's uncertainty (higher = label it sooner). `boxes`: one uncertainty in [0, 1] per answer
    box, in the answer's order; empty for a part that has none per box."""

    image: float
    boxes: tuple[float, ...] = ()


def box_disagreement(boxes: Sequence[Box], others: Sequence[Sequence[Box]]) -> tuple[float, ...]:
    """Per box of `boxes`: 1 − its mean over `others` of IoU × [same class] with its Hungarian match (0 when
    unmatched)."""
    if not others:
        return tuple(1.0 for _ in boxes)
    kept = [0.0] * len(boxes)
    for other in others:
        for p in match_boxes(boxes, other):
            kept[p.i] += p.iou * (boxes[p.i].label == other[p.j].label)
    return tuple(round(1.0 - k / len(others), 9) for k in kept)


class BoxUncertainty:
    """One way to score an image's boxes. `input`: the BoxEvidence field it reads; `requires`: what produces it."""

    name: ClassVar[str] = ""
    input: ClassVar[str] = ""
    requires: ClassVar[str] = ""

    def score(self, evidence: BoxEvidence) -> BoxScore:
        raise NotImplementedError

    def _need(self, values: Sequence[object], at_least: int = 1) -> None:
        if len(values) < at_least:
            raise SelectionError(f"{self.name}: needs at least {at_least} {self.input}, got {len(values)}; "
                                 f"{self.requires}")


class AugmentConsistency(BoxUncertainty):
    name = "augment_consistency"
    input = "views"
    requires = "answer each image's flipped or rescaled views too (pipeline.boxes.uncertainty.VIEWS) and map their " \
               "boxes back with View.to_original"

    def score(self, evidence: BoxEvidence) -> BoxScore:
        self._need(evidence.views)
        agree = sum(agreement(evidence.boxes, v) for v in evidence.views) / len(evidence.views)
        return BoxScore(1.0 - agree, box_disagreement(evidence.boxes, evidence.views))


class SampleAgreement(BoxUncertainty):
    name = "sample_agreement"
    input = "samples"
    requires = "sample answers at a temperature above 0 (at least 1 beside the answer)"

    def score(self, evidence: BoxEvidence) -> BoxScore:
        self._need(evidence.samples)
        answers = [evidence.boxes, *evidence.samples]
        pairs = list(combinations(answers, 2))
        agree = sum(agreement(a, b) for a, b in pairs) / len(pairs)
        return BoxScore(1.0 - agree, box_disagreement(evidence.boxes, evidence.samples))


class TokenEntropy(BoxUncertainty):
    name = "token_entropy"
    input = "token_entropies"
    requires = "the answer's per-token entropies (what the one-answer token_entropy heuristic reads)"

    def score(self, evidence: BoxEvidence) -> BoxScore:
        self._need(evidence.token_entropies)
        values = [float(v) for v in evidence.token_entropies if not math.isnan(v)]
        if not values or min(values) < -1e-6:
            raise SelectionError(f"{self.name}: entropies must be >= 0 and not all NaN, got "
                                 f"{list(evidence.token_entropies)[:5]}…; pass entropies, not log-probabilities")
        return BoxScore(sum(values) / len(values))


BOX_UNCERTAINTIES: dict[str, type[BoxUncertainty]] = {
    c.name: c for c in (AugmentConsistency, SampleAgreement, TokenEntropy)
}


def get_box_uncertainty(name: str) -> BoxUncertainty:
    if name not in BOX_UNCERTAINTIES:
        raise SelectionError(f"unknown box uncertainty {name!r}; choose one of {', '.join(BOX_UNCERTAINTIES)}")
    return BOX_UNCERTAINTIES[name]()


# ------------------------------------------------------------------------------------------------ views
@dataclass(frozen=True)
class View:
    """An augmented view of an image whose boxes map back exactly: a horizontal flip, or a rescale by `scale`
    (the model's preparation resizes again, so a rescale changes what detail the model sees, not the frame)."""

    name: str
    flip: bool = False
    scale: float = 1.0

    def size(self, width: int, height: int) -> tuple[int, int]:
        return max(1, round(width * self.scale)), max(1, round(height * self.scale))

    def apply(self, image: Image) -> Image:
        """The view of a PIL image."""
        from PIL import Image as PILImage

        out = image.transpose(PILImage.Transpose.FLIP_LEFT_RIGHT) if self.flip else image
        if self.scale != 1.0:
            out = out.resize(self.size(image.width, image.height), PILImage.Resampling.BICUBIC)
        return out

    def to_original(self, boxes: Sequence[Box], width: int, height: int) -> list[Box]:
        """Boxes the model answered on this view (in the view's pixels) → the original image's pixels, whose size is
        width × height."""
        vw, vh = self.size(width, height)
        sx, sy = width / vw, height / vh
        out = []
        for b in boxes:
            x = vw - b.x2 if self.flip else b.x
            out.append(Box(b.label, x * sx, b.y * sy, b.w * sx, b.h * sy, b.score))
        return out


VIEWS = (View("hflip", flip=True), View("scale_0.75", scale=0.75))
