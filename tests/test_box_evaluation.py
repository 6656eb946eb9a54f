"""Box evaluation (issue 50 item 6): mAP@0.5 / mAP@[.5:.95] / per-class AP by faster-coco-eval, checked on cases
whose answer is known by hand, and the IoU matching the other box modules share."""

from __future__ import annotations

import pytest

from pipeline.boxes.box import Box
from pipeline.boxes.evaluation import box_map
from pipeline.boxes.matching import agreement, iou, match_boxes
from pipeline.errors import DataError

LABELS = ["cat", "dog"]


def test_iou_by_hand() -> None:
    a = Box("cat", 0, 0, 100, 100)
    assert iou(a, a) == 1.0
    assert iou(a, Box("cat", 10, 0, 100, 100)) == pytest.approx(9000 / 11000)  # 90×100 over 110×100
    assert iou(a, Box("cat", 200, 200, 10, 10)) == 0.0
    assert iou(a, Box("cat", 50, 50, 100, 100)) == pytest.approx(2500 / 17500)


def test_hungarian_beats_greedy() -> None:
    """Greedy (best pair first) would give b[0] to a[0] (IoU .82) and leave a[1] with nothing; the assignment that
    overlaps most in total pairs a[0]–b[1] and a[1]–b[0]."""
    a = [Box("x", 0, 0, 100, 100), Box("x", 30, 0, 100, 100)]
    b = [Box("x", 15, 0, 100, 100), Box("x", -40, 0, 100, 100)]
    pairs = {(p.i, p.j) for p in match_boxes(a, b)}
    assert pairs == {(0, 1), (1, 0)}


def test_agreement_counts_unmatched_and_wrong_class() -> None:
    a = [Box("cat", 0, 0, 10, 10), Box("dog", 50, 50, 10, 10)]
    assert agreement(a, a) == 1.0
    assert agreement([], []) == 1.0
    assert agreement(a, a[:1]) == 0.5  # the dog is unmatched: full disagreement on one of two boxes
    assert agreement(a, [a[0], Box("cat", 50, 50, 10, 10)]) == 0.5  # right place, wrong class


def test_perfect_prediction_is_one() -> None:
    truth = {"a.jpg": [Box("cat", 10, 10, 50, 40), Box("dog", 100, 80, 30, 60)], "b.png": [Box("dog", 0, 0, 20, 20)]}
    got = box_map(truth, truth, LABELS, resamples=20)
    assert got["map50"] == 1.0 and got["map"] == 1.0
    assert got["map50_ci95"] == [1.0, 1.0]
    assert [(c["label"], c["ap50"], c["ap"], c["support"]) for c in got["per_class"]] == [("cat", 1.0, 1.0, 1),
                                                                                          ("dog", 1.0, 1.0, 2)]


def test_shifted_box_ap_at_iou_thresholds() -> None:
    """A box shifted by 10 % of its width overlaps by IoU 0.818: a hit at thresholds .50–.80 (7 of 10), a miss at
    .85–.95, so AP@0.5 = 1 and AP@[.5:.95] = 0.7."""
    truth = {"a.jpg": [Box("cat", 0, 0, 100, 100)]}
    got = box_map(truth, {"a.jpg": [Box("cat", 10, 0, 100, 100, score=0.9)]}, LABELS, resamples=0)
    assert got["map50"] == 1.0
    assert got["map"] == pytest.approx(0.7)
    assert got["per_class"][1]["ap"] is None  # no labeled dog: no AP, not in the mean
    assert got["map50_ci95"] is None  # no resamples, no interval


def test_wrong_class_and_ranking() -> None:
    """Two labeled cats; the prediction ranks a false positive first: precision 0/1 then 1/2, 2/3 → the 101-point
    interpolated AP is (51 points at 2/3 + 50 points at 2/3)/101 = 2/3. A dog predicted on a cat counts for nothing."""
    truth = {"a.jpg": [Box("cat", 0, 0, 50, 50)], "b.jpg": [Box("cat", 0, 0, 50, 50)]}
    pred = {"a.jpg": [Box("cat", 0, 0, 50, 50, 0.8), Box("cat", 200, 200, 50, 50, 0.9)],
            "b.jpg": [Box("cat", 0, 0, 50, 50, 0.7)]}
    assert box_map(truth, pred, LABELS, resamples=0)["map50"] == pytest.approx(2 / 3, abs=1e-6)
    swapped = {"a.jpg": [Box("dog", 0, 0, 50, 50, 0.8)], "b.jpg": [Box("cat", 0, 0, 50, 50, 0.7)]}
    got = box_map(truth, swapped, LABELS, resamples=0)
    assert got["map50"] == pytest.approx(0.5, abs=0.01)  # recall stops at 1/2 with precision 1


def test_bootstrap_interval_brackets_the_point_and_is_seeded() -> None:
    truth = {f"{i}.jpg": [Box("cat", 0, 0, 50, 50)] for i in range(12)}
    pred = {f"{i}.jpg": [Box("cat", (i % 3) * 12.0, 0, 50, 50, 1 - i / 20)] for i in range(12)}
    a = box_map(truth, pred, LABELS, resamples=50, seed=3)
    assert a == box_map(truth, pred, LABELS, resamples=50, seed=3)
    low, high = a["map_ci95"]
    assert low <= a["map"] <= high and low < high
    assert a["bootstrap"] == {"resamples": 50, "seed": 3}


def test_unknown_classes() -> None:
    truth = {"a.jpg": [Box("cat", 0, 0, 50, 50)]}
    got = box_map(truth, {"a.jpg": [Box("cow", 0, 0, 50, 50)]}, LABELS, resamples=0)
    assert got["unknown_predictions"] == 1 and got["map50"] == 0.0
    with pytest.raises(DataError, match="outside the class list"):
        box_map({"a.jpg": [Box("cow", 0, 0, 5, 5)]}, {}, LABELS)
    with pytest.raises(DataError, match="none of the 1 test images"):
        box_map({"a.jpg": []}, {}, LABELS)


def _naive_ap(truth, pred, label: str, t: float) -> float | None:
    """COCO's AP for one class at one IoU threshold, restated plainly: greedy matching by score within each image
    (a detection takes the unmatched labeled box it overlaps most, if ≥ t), cumulative precision and recall over
    all detections by score, precision made non-increasing, read at 101 recall points."""
    import numpy as np

    npos = sum(b.label == label for bs in truth.values() for b in bs)
    if not npos:
        return None
    hits = []
    for name, bs in truth.items():
        gts = [b for b in bs if b.label == label]
        used: set[int] = set()
        for d in sorted((b for b in pred.get(name, ()) if b.label == label), key=lambda b: -b.score):
            best, m = min(t, 1 - 1e-10), -1
            for g, gt in enumerate(gts):
                if g not in used and iou(d, gt) >= best:
                    best, m = iou(d, gt), g
            if m >= 0:
                used.add(m)
            hits.append((d.score, m >= 0))
    hits.sort(key=lambda h: -h[0])
    tp = np.cumsum([h for _, h in hits])
    fp = np.cumsum([not h for _, h in hits])
    recall, precision = tp / npos, tp / np.maximum(tp + fp, 1e-12)
    precision = np.maximum.accumulate(precision[::-1])[::-1] if len(precision) else precision
    points = [precision[np.searchsorted(recall, r, side="left")] if len(recall) and r <= recall[-1] else 0.0
              for r in np.linspace(0, 1, 101)]
    return float(np.mean(points))


def test_map_matches_cocos_rule_restated_plainly() -> None:
    """The library's figures against the rule written out (catches a wrong area range, maxDets or class mapping in
    how tamis calls it) on random images with misses, jitter, swapped classes and false positives."""
    import random

    rng = random.Random(7)
    labels = ["a", "b", "c"]
    truth, pred = {}, {}
    for i in range(40):
        boxes = [Box(rng.choice(labels), rng.uniform(0, 400), rng.uniform(0, 300), rng.uniform(20, 120),
                     rng.uniform(20, 120)) for _ in range(rng.randint(0, 4))]
        truth[f"{i}.jpg"] = boxes
        found = []
        for b in boxes:
            if rng.random() < 0.85:
                label = b.label if rng.random() < 0.9 else rng.choice(labels)
                found.append(Box(label, b.x + rng.gauss(0, 8), b.y + rng.gauss(0, 8), b.w * rng.uniform(0.8, 1.2),
                                 b.h * rng.uniform(0.8, 1.2), rng.random()))
        found += [Box(rng.choice(labels), rng.uniform(0, 400), rng.uniform(0, 300), 50, 50, rng.random())
                  for _ in range(rng.randint(0, 2))]
        pred[f"{i}.jpg"] = found
    got = box_map(truth, pred, labels, resamples=0)
    thresholds = [0.5 + 0.05 * k for k in range(10)]
    for c in got["per_class"]:
        assert c["ap50"] == pytest.approx(_naive_ap(truth, pred, c["label"], 0.5), abs=1e-6)
        assert c["ap"] == pytest.approx(sum(_naive_ap(truth, pred, c["label"], t) for t in thresholds) / 10,
                                        abs=1e-6)
    assert got["map50"] == pytest.approx(sum(c["ap50"] for c in got["per_class"]) / 3, abs=1e-6)
