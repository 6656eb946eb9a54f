"""Box label checks (issue 50 item 7) on cases worked by hand, and the generated scenes they are benchmarked on."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.box_label_check import run_check
from pipeline.boxes.box import Box
from pipeline.boxes.labelcheck import BoxCheckThresholds, check_boxes, check_image, image_scores
from pipeline.boxes.readers import read_coco
from pipeline.boxes.scenes import CANVASES, SHAPES, make_scenes, render, write_scenes
from pipeline.boxes.writers import write_coco
from pipeline.errors import DataError

CAT = Box("cat", 100, 100, 100, 100)
DOG = Box("dog", 400, 100, 80, 120)


def test_agreeing_labels_raise_nothing() -> None:
    pred = [Box("cat", 104, 98, 100, 100, 0.9), Box("dog", 400, 102, 80, 120, 0.8)]
    assert check_image("a.jpg", [CAT, DOG], pred) == []


def test_missing_box() -> None:
    got = check_image("a.jpg", [CAT], [Box("cat", 102, 100, 100, 100, 0.9), Box("dog", 400, 100, 80, 120, 0.8)])
    assert [(i.kind, i.label_index, i.suggestion.label, i.score) for i in got] == [("missing", None, "dog", 0.8)]
    assert "no labeled box covers" in got[0].reason and "a.jpg" in got[0].reason
    # an unsure prediction reports nothing
    assert check_image("a.jpg", [CAT], [Box("cat", 102, 100, 100, 100, 0.9), Box("dog", 400, 100, 80, 120, 0.3)]) == []


def test_swapped_class() -> None:
    got = check_image("a.jpg", [CAT, DOG], [Box("dog", 100, 100, 100, 100, 0.9), Box("dog", 400, 100, 80, 120)])
    assert [(i.kind, i.label_index, i.suggestion.label) for i in got] == [("swapped", 0, "dog")]
    assert got[0].score == pytest.approx(0.9)
    # a same-class prediction on the box too: not a swap (the model is torn, the label may be right)
    both = [Box("dog", 100, 100, 100, 100, 0.9), Box("cat", 101, 100, 100, 100, 0.6), Box("dog", 400, 100, 80, 120)]
    assert check_image("a.jpg", [CAT, DOG], both) == []


def test_badly_placed_box() -> None:
    """The label is shifted by 60 px of 100: IoU 40·100 / 160·100 = 0.25 with the model's box."""
    got = check_image("a.jpg", [Box("cat", 160, 100, 100, 100)], [Box("cat", 100, 100, 100, 100, 0.8)])
    assert [(i.kind, i.label_index) for i in got] == [("badly_placed", 0)]
    assert got[0].score == pytest.approx(0.8 * 0.75)
    assert "IoU 0.25" in got[0].reason


def test_ranking_and_image_scores() -> None:
    labels = {"a.jpg": [CAT], "b.jpg": [CAT], "c.jpg": [CAT]}
    pred = {"a.jpg": [Box("dog", 100, 100, 100, 100, 0.6)], "b.jpg": [Box("dog", 100, 100, 100, 100, 0.95)]}
    issues = check_boxes(labels, pred)
    assert [i.image for i in issues] == ["b.jpg", "a.jpg"]  # c.jpg: no prediction, no evidence
    assert image_scores(issues) == {"a.jpg": 0.6, "b.jpg": 0.95}


def test_thresholds_are_checked() -> None:
    with pytest.raises(DataError, match="overlap_iou < match_iou"):
        BoxCheckThresholds(match_iou=0.3, overlap_iou=0.4)


def test_scenes_are_seeded_mixed_and_drawn_where_their_boxes_say(tmp_path) -> None:
    scenes = make_scenes(24, seed=5)
    assert scenes == make_scenes(24, seed=5)
    assert len({(s.width, s.height) for s in scenes}) >= 4 and {(s.width, s.height) for s in scenes} <= set(CANVASES)
    assert {b.label for s in scenes for b in s.boxes} == set(SHAPES)
    s = next(s for s in scenes if s.boxes)
    a = np.asarray(render(s)).astype(int)
    background = np.median(a.reshape(-1, 3), axis=0)
    far = (np.abs(a - background).max(axis=2) > 80)
    inside = np.zeros_like(far)
    for b in s.boxes:
        inside[int(b.y): int(b.y2), int(b.x): int(b.x2)] = True
        assert far[int(b.y): int(b.y2), int(b.x): int(b.x2)].mean() > 0.3  # the shape fills its box
    assert far[~inside].mean() < 0.001  # and nothing is drawn outside the boxes
    boxes = write_scenes(tmp_path / "images", scenes[:3])
    write_coco(tmp_path / "coco.json", boxes)
    back = read_coco(tmp_path / "coco.json", images_dir=tmp_path / "images")
    assert back.images == boxes.images and not back.quarantine


def test_benchmark_recall_and_false_alarms_quick() -> None:
    """The benchmark's own loop on a few scenes: with a good detector the check finds most injected errors and
    raises few false alarms (the committed JSON has the full run)."""
    got = run_check(scenes=60, seed=0, rate=0.1, detector="good")
    assert min(got["recall"].values()) >= 0.5
    assert got["false_alarm_rate"] <= 0.1
