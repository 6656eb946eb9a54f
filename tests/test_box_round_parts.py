"""What a box project's round uses of pipeline/boxes beyond training and evaluation: box_iou consensus when several
annotators label the same image (at import and as annotate.consensus), and the config's defaults and refusals for
it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.boxes.answer import parse_box_label
from pipeline.boxes.box import Box
from pipeline.boxes.scenes import SHAPES


def _region(b: Box, w: int, h: int) -> dict:
    return {"type": "rectanglelabels", "from_name": "answer", "to_name": "image", "original_width": w,
            "original_height": h, "value": {"x": b.x / w * 100, "y": b.y / h * 100, "width": b.w / w * 100,
                                            "height": b.h / h * 100, "rotation": 0, "rectanglelabels": [b.label]}}


def _two_annotators(path: Path, sid: str, boxes_a: list[Box], boxes_b: list[Box], w: int = 400, h: int = 300) -> Path:
    """A Label Studio JSON export: one task, annotated by two people who drew the same objects a few pixels apart."""
    anns = [{"id": 10 + i, "completed_by": {"email": who}, "result": [_region(b, w, h) for b in boxes]}
            for i, (who, boxes) in enumerate([("ann@x.org", boxes_a), ("bob@x.org", boxes_b)])]
    path.write_text(json.dumps([{"id": 1, "data": {"image": "/data/x.png", "sample_id": sid}, "annotations": anns}]))
    return path


def test_two_annotators_boxes_a_few_pixels_apart_agree_by_iou_at_import(tmp_path):
    from pipeline.annotation.label_files import LabelKeys
    from pipeline.annotation.labels import import_labels
    from pipeline.annotation.ledger import Ledger

    a = [Box("disc", 40, 50, 100, 80), Box("square", 200, 100, 60, 60)]
    b = [Box("disc", 43, 48, 98, 83), Box("square", 202, 101, 59, 58)]
    ledger = Ledger(tmp_path / "labels.jsonl")
    rep = import_labels(_two_annotators(tmp_path / "ls.json", "s1", a, b), known_ids={"s1"}, answers=None,
                        ledger=ledger, round_index=1, rejections_dir=tmp_path / "rej",
                        keys=LabelKeys(box_labels=SHAPES))
    # As text the two labels differ (a tie, rejected); as boxes they agree: one label, each box the median.
    assert not rep.rejected, rep.rejected
    (entry,) = rep.accepted
    got = parse_box_label(entry["label"])
    assert [g.label for g in got] == ["disc", "square"]
    assert got[0].x == pytest.approx(41.5, abs=0.01) and got[0].h == pytest.approx(81.5, abs=0.01)
    assert entry["annotator"] == "ann@x.org,bob@x.org" and len(entry["votes"]) == 2
    # A class dispute between the two is a tie: no label, sent to a third annotator.
    c = [Box("triangle", 40, 50, 100, 80), Box("square", 200, 100, 60, 60)]
    rep = import_labels(_two_annotators(tmp_path / "ls2.json", "s2", a, c), known_ids={"s2"}, answers=None,
                        ledger=ledger, round_index=1, rejections_dir=tmp_path / "rej",
                        keys=LabelKeys(box_labels=SHAPES))
    assert not rep.accepted and len(rep.rejected) == 2 and "tie" in rep.rejected[0].reason


def _config(tmp_path: Path, **annotate) -> dict:
    return {"paths": {"artifacts": str(tmp_path / "art")},
            "data": {"sources": [{"kind": "folder", "path": str(tmp_path)}], "task": "boxes", "answers": list(SHAPES)},
            "model": {"name_or_path": "x", "family": "idefics3"}, **({"annotate": annotate} if annotate else {})}


def test_a_box_project_uses_box_iou_consensus_and_refuses_text_consensus(tmp_path):
    from pipeline.config import ProjectConfig

    box = ProjectConfig.model_validate(_config(tmp_path))
    assert box.annotate.consensus == "box_iou" and box.select.diversity == "class_balanced"
    with pytest.raises(ValueError, match="annotate.consensus: 'dawid_skene' compares annotators' labels as whole"):
        ProjectConfig.model_validate(_config(tmp_path, consensus="dawid_skene"))
    one_answer = _config(tmp_path, consensus="box_iou")
    one_answer["data"].pop("task")
    with pytest.raises(ValueError, match="annotate.consensus: 'box_iou' matches boxes"):
        ProjectConfig.model_validate(one_answer)
    one_answer = _config(tmp_path)
    one_answer["data"].pop("task")
    one_answer["select"] = {"diversity": "class_balanced"}
    with pytest.raises(ValueError, match="select.diversity: 'class_balanced' balances a batch over the classes of"):
        ProjectConfig.model_validate(one_answer)


# --------------------------------------------------------------------------------------------- YOLO folders
def _yolo_folder(root: Path, scenes, *, unlabeled: int = 0) -> Path:
    """A YOLO folder of `scenes` (write_yolo), the label files of the last `unlabeled` removed (not labeled yet)."""
    from pipeline.boxes.readers import BoxSet
    from pipeline.boxes.scenes import write_scenes
    from pipeline.boxes.writers import write_yolo

    src = write_scenes(root.parent / f"{root.name}-src", scenes)
    write_yolo(root, BoxSet(labels=SHAPES, images=src.images, sizes=src.sizes), root.parent / f"{root.name}-src")
    for s in scenes[len(scenes) - unlabeled:]:
        (root / "labels" / Path(s.name).with_suffix(".txt")).unlink()
    return root


def test_a_yolo_folder_is_a_source_of_box_labels(tmp_path):
    from pipeline.boxes.answer import box_label
    from pipeline.boxes.scenes import make_scenes
    from pipeline.config import DataConfig, SourceConfig
    from pipeline.data.readers import READERS, RawRow, Rejected

    scenes = make_scenes(5, seed=3)
    root = _yolo_folder(tmp_path / "yolo", scenes, unlabeled=2)
    source = SourceConfig(kind="yolo", path=root)
    data = DataConfig(task="boxes", answers=list(SHAPES), sources=[source])
    rows = sorted(READERS["yolo"]().rows(source, data), key=lambda r: r.image_path)
    assert len(rows) == 5 and all(isinstance(r, RawRow) for r in rows)
    by_name = {Path(r.image_path).name: r for r in rows}
    for s in scenes[:3]:  # labeled: the boxes within YOLO's six decimals of the scene's
        got, want = parse_box_label(by_name[s.name].answer), parse_box_label(box_label(s.boxes))  # canonical order
        assert [b.label for b in got] == [b.label for b in want] and by_name[s.name].split == "train"
        assert all(abs(g.x - b.x) < 0.01 * s.width and abs(g.w - b.w) < 0.01 * s.width
                   for g, b in zip(got, want, strict=True))
    assert all(by_name[s.name].answer is None for s in scenes[3:])  # no label file: the pool
    # As a test set every image is labeled (a missing label file is YOLO's background image: no boxes).
    test = SourceConfig(kind="yolo", path=root, default_split="test")
    rows = list(READERS["yolo"]().rows(test, data))
    assert {r.answer for r in rows if Path(r.image_path).name in {s.name for s in scenes[3:]}} == {box_label([])}
    # A box outside its image rejects that image, whole, naming the line.
    label = root / "labels" / Path(scenes[0].name).with_suffix(".txt")
    label.write_text(label.read_text() + "0 3.5 0.5 0.2 0.2\n")
    rows = list(READERS["yolo"]().rows(source, data))
    (bad,) = [r for r in rows if isinstance(r, Rejected)]
    assert scenes[0].name in bad.source and len(rows) == 5


def test_tamis_init_detects_yolo_folders(tmp_path, tiny_models):
    import os
    import subprocess
    import sys

    from pipeline.boxes.scenes import make_scenes
    from pipeline.config import load_config

    pool = _yolo_folder(tmp_path / "pool", make_scenes(6, seed=4), unlabeled=4)
    test = _yolo_folder(tmp_path / "test", make_scenes(4, seed=5))
    project = tmp_path / "project"
    project.mkdir()
    res = subprocess.run([str(Path(sys.executable).parent / "tamis"), "init", str(pool), "--test", str(test),
                          "--model", str(tiny_models["idefics3"])], cwd=project, capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "2000"}, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "YOLO folder of 6 images, 2 labeled" in res.stdout and "4 without a label file" in res.stdout
    assert "test set: YOLO folder of 4 images" in res.stdout and "the YOLO folder's classes" in res.stdout
    cfg = load_config(project / "tamis.yaml")
    assert cfg.data.task == "boxes" and cfg.data.answers == list(SHAPES)
    assert [(s.kind, s.default_split) for s in cfg.data.sources] == [("yolo", None), ("yolo", "test")]


# ------------------------------------------------------------------------------------ class-balanced selection
def test_a_box_rounds_selection_balances_the_batch_over_predicted_classes():
    """The most uncertain answers hold discs (or nothing): top_k takes them; class_balanced (a box project's default)
    takes the most uncertain disc image, then the most uncertain square and triangle images."""
    import numpy as np

    from pipeline.config import SelectConfig
    from pipeline.scoring import ScoreResult
    from pipeline.selection import box_class_counts, select_round

    def answer(*labels: str) -> str:
        return json.dumps([{"bbox_2d": [10 + 50 * i, 10, 40 + 50 * i, 40], "label": lab} for i, lab in enumerate(labels)])

    texts = [answer("disc"), answer("disc", "disc"), answer("disc"), answer("square"), answer("triangle", "disc"),
             answer("square", "square"), "no boxes at all"]
    entropy = np.array([0.9, 0.8, 0.7, 0.5, 0.4, 0.3, 0.95])[:, None]  # one token each: its entropy is the score
    ids = [f"s{i}" for i in range(len(texts))]
    scores = ScoreResult(ids, np.eye(len(ids), 4, dtype=np.float32), token_logprobs=-entropy, token_entropy=entropy,
                         answers=texts)
    assert box_class_counts(texts, SHAPES).tolist() == [[1, 0, 0], [2, 0, 0], [1, 0, 0], [0, 1, 0], [1, 0, 1],
                                                        [0, 2, 0], [0, 0, 0]]  # SHAPES: disc, square, triangle

    def pick(diversity: str) -> list[str]:
        cfg = SelectConfig(strategy="token_entropy", diversity=diversity, batch_size=3)
        sel = select_round(cfg, candidate_ids=ids, scores=scores, space=None, labeled=set(), exclude=set(),
                           answers=None, history=[], cold_start=False, seed=0, box_labels=SHAPES)
        return [r["sample_id"] for r in sel.rows]

    assert pick("top_k") == ["s6", "s0", "s1"]
    # each pick to the class with the fewest boxes so far (ties: the class list's order); s6 predicts no box, so it
    # waits until no class has an image left
    assert pick("class_balanced") == ["s0", "s3", "s4"]


# ---------------------------------------------------------------------------------------------- label check
def test_the_box_label_check_finds_the_images_with_wrong_boxes():
    from pipeline.boxes.answer import box_label
    from pipeline.boxes.scenes import make_scenes
    from pipeline.labelcheck.boxes import detect_box_label_issues

    scenes = [s for s in make_scenes(12, seed=8) if len(s.boxes) >= 2][:8]
    truth = {s.name: list(s.boxes) for s in scenes}
    labels = dict(truth)
    a, b = scenes[0].name, scenes[1].name
    first = truth[a][0]
    other = next(c for c in SHAPES if c != first.label)
    labels[a] = [Box(other, first.x, first.y, first.w, first.h), *truth[a][1:]]  # a swapped class
    labels[b] = truth[b][1:]  # a box nobody drew
    predicted = {n: [Box(x.label, x.x, x.y, x.w, x.h, 0.9) for x in bs] for n, bs in truth.items()}
    ids = [s.name for s in scenes]
    det, cols, reasons = detect_box_label_issues(labels, predicted, texts={n: "model" for n in ids},
                                                 given={n: box_label(labels[n]) for n in ids}, sample_ids=ids,
                                                 min_oos_accuracy=0.5)
    assert det.abstained is None and {i.sample_id for i in det.issues} == {a, b}
    assert any("the model sees a" in r and "no labeled box covers" in r for r in reasons[b])
    assert any(f"is labeled {other!r}" in r for r in reasons[a])
    assert all(0 < i.confidence <= 1 for i in det.issues) and cols.shape == (len(ids), 2)
    # A model that finds nothing cannot judge: the check abstains and says why, with the numbers.
    det, _, _ = detect_box_label_issues(labels, {n: [] for n in ids}, texts={}, given={n: "" for n in ids},
                                        sample_ids=ids, min_oos_accuracy=0.5)
    assert not det.issues and "mean box agreement with the labels" in det.abstained


def test_the_round_label_check_of_a_box_project_carries_its_class_list(tmp_path):
    from pipeline.config import ProjectConfig
    from pipeline.labelcheck import CheckSpec, plan_label_check
    from pipeline.labelcheck.stage import check_spec
    from pipeline.round_state import RoundState

    cfg = ProjectConfig.model_validate(_config(tmp_path))
    assert cfg.labelcheck.method == "heldout"
    spec = CheckSpec.of(model=cfg.model, train=cfg.train, select=cfg.select, labelcheck=cfg.labelcheck,
                        answers=cfg.data.scored_answers, seed=0, box_labels=cfg.data.box_labels)
    (tmp_path / "art").mkdir()
    # heldout needs the previous round's adapter and the IDs it trained on
    import datasets

    prev = tmp_path / "art" / "rounds" / "001" / "labeled" / "dataset"
    datasets.Dataset.from_dict({"sample_id": ["s1"]}).save_to_disk(str(prev))
    params = plan_label_check(spec, artifacts=tmp_path / "art", labeled={"dataset": "x", "digest": "d"},
                              previous=RoundState(round=1, adapter={"adapter_dir": "a", "adapter_digest": "b"}),
                              round_dir=tmp_path / "art" / "rounds" / "002")
    assert params.data == {"answers": None, "box_labels": list(SHAPES)}
    assert check_spec(params).box_labels == SHAPES and check_spec(params).answers is None
    kfold = _config(tmp_path)
    kfold["labelcheck"] = {"method": "kfold"}
    with pytest.raises(ValueError, match="labelcheck.method: 'kfold' trains fold adapters on the labels as they are"):
        ProjectConfig.model_validate(kfold)


def test_a_box_projects_relabel_queue_goes_out_as_a_box_batch_with_the_current_boxes(tmp_path):
    import io

    import datasets

    from pipeline.boxes.answer import box_label
    from pipeline.boxes.readers import read_label_studio
    from pipeline.boxes.scenes import make_scenes, render
    from pipeline.config import AnnotateConfig
    from pipeline.labelcheck.boxes import export_box_relabel
    from pipeline.labelcheck.detection import Issue

    scenes = make_scenes(3, seed=9)
    rows = []
    for i, s in enumerate(scenes):
        buf = io.BytesIO()
        render(s).save(buf, format="PNG")
        rows.append({"sample_id": f"s{i}", "question": "Find every shape.", "image": buf.getvalue(),
                     "image_path": f"/data/{s.name}", "width": s.width, "height": s.height, "prep_box": [0, 0, 32, 32],
                     "prep_width": 32, "prep_height": 32})
    ds = datasets.Dataset.from_list(rows)
    issue = Issue(0, "s1", box_label(scenes[1].boxes), "[]", 0.2, 1.0, 0.9, 0.5, 0.9)
    m = export_box_relabel([issue], ds, tmp_path / "relabel", annotate=AnnotateConfig(), box_labels=SHAPES,
                           artifacts=tmp_path, round_index=2)
    assert m is not None and m.info["count"] == 1
    tasks = json.loads((tmp_path / "relabel" / "label_studio_tasks.json").read_text())
    assert [t["data"]["sample_id"] for t in tasks] == ["s1"] and tasks[0]["predictions"][0]["model_version"] == "labelcheck"
    # the annotator starts from the boxes the image is labeled with now
    back = read_label_studio(tmp_path / "relabel" / "label_studio_tasks.json", kind="predictions")
    (got,) = back.images.values()
    assert box_label(got) == box_label(scenes[1].boxes)
    assert (tmp_path / "relabel" / "images" / scenes[1].name).is_file()
    assert export_box_relabel([], ds, tmp_path / "none", annotate=AnnotateConfig(), box_labels=SHAPES,
                              artifacts=tmp_path, round_index=2) is None
