"""Boxes out to annotators and back (issue 50 items 1 and 5): the batch folder (Label Studio RectangleLabels tasks
with scored predictions, COCO, YOLO, under the original file names), a corrected prediction coming back as the
label, labels returning as a COCO file that names the original files, the ledger's box label, and consensus across
annotators by IoU. Images are generated scenes (pipeline/boxes/scenes.py), not the digits."""

from __future__ import annotations

import json
import random
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest

from pipeline.annotation.consensus import CONSENSUS, Vote
from pipeline.annotation.ledger import Ledger, make_entry
from pipeline.boxes.answer import box_label, is_box_label, parse_box_label
from pipeline.boxes.batch import (
    COCO_FILE,
    LABEL_CONFIG_FILE,
    TASKS_FILE,
    YOLO_DIR,
    BatchImage,
    export_box_batch,
    labels_by_sample,
    read_names,
)
from pipeline.boxes.box import Box
from pipeline.boxes.consensus import box_consensus
from pipeline.boxes.labelstudio import box_label_config, label_from_annotation
from pipeline.boxes.readers import BoxSet, read_coco, read_label_studio, read_yolo
from pipeline.boxes.scenes import SHAPES, make_scenes, write_scenes
from pipeline.boxes.writers import write_coco
from pipeline.errors import DataError


def _near(a: list[Box], b: list[Box], tol: float = 0.01) -> bool:
    key = lambda x: (x.label, round(x.x), round(x.y))  # noqa: E731
    return len(a) == len(b) and all(
        p.label == q.label and all(abs(u - v) <= tol for u, v in zip((p.x, p.y, p.w, p.h), (q.x, q.y, q.w, q.h), strict=True))
        for p, q in zip(sorted(a, key=key), sorted(b, key=key), strict=True))


@pytest.fixture()
def batch(tmp_path):
    """Six scenes on disk; the model's boxes are the truth jittered a little, scored; two samples share a name."""
    scenes = make_scenes(6, seed=2)
    truth = write_scenes(tmp_path / "pool", scenes)
    rng = random.Random(0)
    images = []
    for k, s in enumerate(scenes):
        pred = tuple(Box(b.label, b.x + rng.uniform(-3, 3), b.y, b.w, b.h, round(rng.uniform(0.4, 1), 3))
                     for b in s.boxes)
        name = "dup.png" if k in (1, 2) else f"photos/{s.name}"
        images.append(BatchImage(f"s{k}", name, tmp_path / "pool" / s.name, s.width, s.height, pred,
                                 confidence=0.5 if k == 0 else None, question="Box every shape."))
    return tmp_path, images, truth


def test_export_writes_every_format_under_the_original_names(batch) -> None:
    tmp, images, _ = batch
    out = tmp / "batch"
    export_box_batch(out, images, SHAPES, model_version="round-3")
    names = read_names(out)
    assert set(names.values()) == {im.sample_id for im in images}
    assert "photos/scene_0000.png" in names and "dup__s1.png" in names and "dup__s2.png" in names
    by_name = {n: im for n, sid in names.items() for im in images if im.sample_id == sid}
    # Label Studio: RectangleLabels over the classes, no rotation; predictions read back as the model's boxes
    view = ET.fromstring((out / LABEL_CONFIG_FILE).read_text())
    rect = view.find("RectangleLabels")
    assert rect is not None and rect.get("canRotate") == "false"
    assert [lab.get("value") for lab in rect] == list(SHAPES)
    tasks = json.loads((out / TASKS_FILE).read_text())
    assert tasks[0]["predictions"][0]["score"] == 0.5  # the given task score
    assert tasks[1]["predictions"][0]["score"] == min(b.score for b in images[1].predicted)  # else the least sure
    assert all(t["predictions"][0]["model_version"] == "round-3" for t in tasks if t["predictions"])
    assert all("score" in r for t in tasks for p in t["predictions"] for r in p["result"])
    back = read_label_studio(out / TASKS_FILE, kind="predictions", image_key="original_image")
    by_base = {n.rsplit("/", 1)[-1]: im for n, im in by_name.items()}  # a task's image reference keeps its file name
    assert set(back.images) == set(by_base)
    for name, boxes in back.images.items():
        assert _near(boxes, list(by_base[name].predicted), tol=1e-6)
    # COCO and YOLO, under the same names
    coco = read_coco(out / COCO_FILE, images_dir=out / "images")
    assert not coco.quarantine and set(coco.images) == set(names)
    assert all(_near(coco.images[n], list(by_name[n].predicted), tol=1e-6) for n in names)
    yolo = read_yolo(out / YOLO_DIR)
    assert set(yolo.images) == set(names)
    assert all(b.score is None for bs in yolo.images.values() for b in bs)
    assert all(_near(yolo.images[n], [replace(b, score=None) for b in by_name[n].predicted], tol=0.01)
               for n in names)


def test_a_corrected_prediction_comes_back_as_the_label(batch) -> None:
    """The annotator moves one predicted box and deletes another, as Label Studio writes it: the label is what they
    left, in the image's pixels, without the model's scores."""
    tmp, images, _ = batch
    export_box_batch(tmp / "batch", images, SHAPES)
    task = next(t for t in json.loads((tmp / "batch" / TASKS_FILE).read_text())
                if len(t["predictions"][0]["result"]) >= 2)
    im = next(i for i in images if i.sample_id == task["data"]["sample_id"])
    result = [dict(r, value=dict(r["value"])) for r in task["predictions"][0]["result"]]
    result[0]["value"]["x"] += 10.0  # moved right by 10 % of the width
    del result[1]
    got = parse_box_label(label_from_annotation({"result": result}, SHAPES))
    kept = [im.predicted[0]] + list(im.predicted[2:])
    want = [replace(kept[0], x=kept[0].x + 0.1 * im.width, score=None)] + [replace(b, score=None) for b in kept[1:]]
    assert _near(got, want, tol=0.06)  # the label text rounds to 0.1 px
    assert label_from_annotation({"result": []}, SHAPES) == "[]"  # nothing there: a label, not a gap
    rotated = [dict(result[0], value=dict(result[0]["value"], rotation=30))]
    with pytest.raises(DataError, match="rotated box"):
        label_from_annotation({"result": rotated}, SHAPES)
    with pytest.raises(DataError, match="not in the class list"):
        label_from_annotation({"result": result}, ["disc"])


def test_labels_return_as_coco_by_original_name_into_the_ledger(batch) -> None:
    tmp, images, truth = batch
    export_box_batch(tmp / "batch", images, SHAPES)
    names = read_names(tmp / "batch")
    sid_to_scene = {im.sample_id: im.path.name for im in images}
    returned = BoxSet(images={n: truth.images[sid_to_scene[sid]] for n, sid in names.items()},
                      sizes={n: truth.sizes[sid_to_scene[sid]] for n, sid in names.items()}, labels=SHAPES)
    returned.images["stranger.png"], returned.sizes["stranger.png"] = [], (10, 10)
    write_coco(tmp / "labels.json", returned)
    labels, problems = labels_by_sample(read_coco(tmp / "labels.json"), names, SHAPES)
    assert problems == ["stranger.png: not an image of this batch (names.json has 6 names)"]
    assert {sid: parse_box_label(t) for sid, t in labels.items()} == {
        sid: sorted(truth.images[sid_to_scene[sid]], key=lambda b: (b.y, b.x)) for sid in names.values()}
    ledger = Ledger(tmp / "labels.jsonl")
    ledger.append(make_entry(sid, text, annotator="ann", round_index=1, source_file="labels.json",
                             source_digest="d") for sid, text in labels.items())
    assert ledger.labels() == labels


def test_box_label_text_is_canonical() -> None:
    a = [Box("cat", 10.04, 20, 30, 40, score=0.9), Box("dog", 0, 5, 1, 1)]
    text = box_label(a)
    assert text == '[{"box":[0.0,5.0,1.0,1.0],"label":"dog"},{"box":[10.0,20.0,30.0,40.0],"label":"cat"}]'
    assert box_label(list(reversed(a))) == text  # order and scores do not change the text
    assert parse_box_label(text) == [Box("dog", 0, 5, 1, 1), Box("cat", 10, 20, 30, 40)]
    assert is_box_label("[]") and not is_box_label("cat") and not is_box_label('[{"box": [1, 2, 0, 4], "label": "x"}]')
    with pytest.raises(DataError, match="box 0 must be"):
        parse_box_label('[{"box": [1, 2], "label": "x"}]')


def test_labeling_config_refuses_an_empty_class_list() -> None:
    with pytest.raises(DataError, match="data.answers"):
        box_label_config([])


CAT, DOG = Box("cat", 10, 10, 100, 100), Box("dog", 300, 50, 40, 80)


def test_box_consensus_by_hand() -> None:
    same = box_consensus({"a": [CAT, DOG], "b": [DOG, CAT]})
    assert same.boxes == (CAT, DOG) and same.confidence == 1.0 and same.outcome == "agreed"
    # three annotators: the dog drawn by one only is dropped; the cat's corners are the medians
    d = box_consensus({"a": [CAT], "b": [replace(CAT, x=14)], "c": [replace(CAT, x=12), DOG]})
    assert d.boxes == (replace(CAT, x=12),) and d.outcome == "majority"
    assert d.agreement["c"] == pytest.approx(0.5)  # the extra dog is half of c's boxes
    # a class vote that ties makes the image undecided
    assert box_consensus({"a": [CAT], "b": [replace(CAT, label="dog")]}).boxes is None
    # two annotators: a box both drew is kept; a box one drew is not
    assert box_consensus({"a": [CAT, DOG], "b": [CAT]}).boxes == (CAT,)


def test_box_iou_consensus_part_decides_ledger_votes() -> None:
    part = CONSENSUS["box_iou"]()
    votes = {"s1": [Vote("s1", "ann1", box_label([CAT])), Vote("s1", "ann2", box_label([replace(CAT, x=12)])),
                    Vote("s1", "ann3", box_label([replace(CAT, x=11), DOG]))],
             "s2": [Vote("s2", "ann1", "[]")]}
    got = part.decide(votes)
    assert parse_box_label(got["s1"].label) == [replace(CAT, x=11)]
    assert got["s2"].label == "[]" and got["s2"].outcome == "agreed"
    quality = part.annotators(votes, got)
    assert quality["ann3"].agreement == pytest.approx(0.5, abs=0.01)
    assert quality["ann1"].agreement > 0.95 and quality["ann1"].shared == 1
