"""Box uncertainty and class-balanced selection (issue 50 item 4): pure functions over Box lists, checked on cases
worked by hand, and the views' geometry checked on real pixels (a drawn rectangle found again after the view)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from pipeline.boxes.box import Box
from pipeline.boxes.selection import class_balanced
from pipeline.boxes.uncertainty import (
    BOX_UNCERTAINTIES,
    VIEWS,
    BoxEvidence,
    View,
    box_disagreement,
    get_box_uncertainty,
)
from pipeline.errors import SelectionError

CAT, DOG = Box("cat", 10, 10, 100, 100), Box("dog", 300, 50, 40, 80)


@pytest.mark.parametrize("name", sorted(BOX_UNCERTAINTIES))
def test_each_part_refuses_evidence_it_lacks_with_what_produces_it(name: str) -> None:
    part = get_box_uncertainty(name)
    with pytest.raises(SelectionError, match=part.requires[:20].replace("(", r"\(")):
        part.score(BoxEvidence(boxes=[CAT]))


def test_consistency_by_hand() -> None:
    part = get_box_uncertainty("augment_consistency")
    steady = part.score(BoxEvidence([CAT, DOG], views=[[CAT, DOG], [DOG, CAT]]))
    assert steady.image == 0.0 and steady.boxes == (0.0, 0.0)
    moved = Box("cat", 20, 10, 100, 100)  # IoU 90·100 / 110·100
    got = part.score(BoxEvidence([CAT], views=[[moved]]))
    assert got.image == pytest.approx(1 - 9 / 11) and got.boxes == pytest.approx((1 - 9 / 11,))
    flipped_class = part.score(BoxEvidence([CAT, DOG], views=[[CAT, Box("cat", 300, 50, 40, 80)]]))
    assert flipped_class.image == pytest.approx(0.5) and flipped_class.boxes == (0.0, 1.0)
    vanished = part.score(BoxEvidence([CAT, DOG], views=[[CAT]]))
    assert vanished.image == pytest.approx(0.5) and vanished.boxes == (0.0, 1.0)
    appeared = part.score(BoxEvidence([CAT], views=[[CAT, DOG]]))  # a box only the view has weighs the same
    assert appeared.image == pytest.approx(0.5) and appeared.boxes == (0.0,)
    assert part.score(BoxEvidence([], views=[[]])).image == 0.0  # nothing, seen steadily


def test_sample_agreement_averages_every_pair() -> None:
    part = get_box_uncertainty("sample_agreement")
    assert part.score(BoxEvidence([CAT], samples=[[CAT], [CAT]])).image == 0.0
    # pairs: (answer, s1) agree 1, (answer, s2) 0, (s1, s2) 0 → mean agreement 1/3
    got = part.score(BoxEvidence([CAT], samples=[[CAT], []]))
    assert got.image == pytest.approx(2 / 3) and got.boxes == (0.5,)


def test_token_entropy_baseline() -> None:
    part = get_box_uncertainty("token_entropy")
    assert part.score(BoxEvidence([CAT], token_entropies=[0.2, 0.4, float("nan")])).image == pytest.approx(0.3)
    with pytest.raises(SelectionError, match="not log-probabilities"):
        part.score(BoxEvidence([CAT], token_entropies=[-0.5]))


def test_box_disagreement_without_others_is_full() -> None:
    assert box_disagreement([CAT, DOG], []) == (1.0, 1.0)


@pytest.mark.parametrize("view", [*VIEWS, View("both", flip=True, scale=1.5)], ids=lambda v: v.name)
@pytest.mark.parametrize("size", [(640, 360), (301, 517)])
def test_view_maps_a_drawn_box_back(view: View, size: tuple[int, int]) -> None:
    """Draw a rectangle, take the view, find the rectangle in the view's pixels, map it back: within 2 px."""
    w, h = size
    truth = Box("x", 0.6 * w, 0.2 * h, 0.25 * w, 0.5 * h)
    a = np.zeros((h, w), dtype=np.uint8)
    a[round(truth.y): round(truth.y2), round(truth.x): round(truth.x2)] = 255
    seen = np.asarray(view.apply(Image.fromarray(a))) > 127
    ys, xs = np.nonzero(seen)
    found = Box.from_corners("x", xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)
    back = view.to_original([found], w, h)[0]
    assert np.allclose([back.x, back.y, back.x2, back.y2], [truth.x, truth.y, truth.x2, truth.y2], atol=2.0)


def test_class_balanced_reaches_the_rare_class() -> None:
    scores = {"a": 0.9, "b": 0.8, "c": 0.7, "d": 0.2, "e": 0.1}
    predicted = {"a": [Box("cat", 0, 0, 5, 5)], "b": [Box("cat", 0, 0, 5, 5)], "c": [Box("cat", 0, 0, 5, 5)],
                 "d": [Box("dog", 0, 0, 5, 5)], "e": []}
    # dog has fewest (0 vs 0: the class list's order picks cat first), then dog, then cat again
    assert class_balanced(scores, predicted, 3, labels=["cat", "dog"]) == ["a", "d", "b"]
    # with cats labeled already, the dog goes first
    assert class_balanced(scores, predicted, 2, labels=["cat", "dog"], labeled_counts={"cat": 5}) == ["d", "a"]
    # past the predicted classes, the uncertainty alone
    assert class_balanced(scores, predicted, 5, labels=["cat", "dog"])[-1] == "e"
    with pytest.raises(SelectionError, match="lower select.batch_size to 5"):
        class_balanced(scores, predicted, 6, labels=["cat", "dog"])


def test_class_balanced_matches_a_naive_reference() -> None:
    """The queue walk against the rule stated plainly (recount everything at each pick) on a random pool."""
    rng = np.random.default_rng(0)
    labels = ["a", "b", "c", "d"]
    scores = {f"i{n}": float(rng.random()) for n in range(60)}
    predicted = {i: [Box(str(rng.choice(labels, p=[0.7, 0.2, 0.08, 0.02])), 0, 0, 1, 1)
                     for _ in range(int(rng.integers(0, 3)))] for i in scores}

    def naive(k: int) -> list[str]:
        picks: list[str] = []
        while len(picks) < k:
            rest = sorted((i for i in scores if i not in picks), key=lambda i: (-scores[i], i))
            counts = {lb: sum(b.label == lb for p in picks for b in predicted[p]) for lb in labels}
            open_ = [lb for lb in labels if any(b.label == lb for i in rest for b in predicted[i])]
            if open_:
                t = min(open_, key=lambda lb: (counts[lb], labels.index(lb)))
                picks.append(next(i for i in rest if any(b.label == t for b in predicted[i])))
            else:
                picks.append(rest[0])
        return picks

    assert class_balanced(scores, predicted, 60, labels=labels) == naive(60)
