"""A box project as a user runs it (issue 50's first "done when"): `tamis init` on a flat folder of generated scenes
plus a COCO test file, round 0 exports the batch (Label Studio RectangleLabels + COCO + YOLO), the labels come back
as a COCO JSON naming the original files, round 1 trains on the family codec's text and evaluates (map50, map in
metrics.jsonl), and round 1's Label Studio tasks carry scored box predictions. The tiny model learns little: the
test checks the loop's files and metric names, not accuracy.

The fast tests beside it check the parts a round calls on their own: init's detection, the COCO source and the
COCO / Label Studio label files into the ledger."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.boxes.answer import box_label, parse_box_label
from pipeline.boxes.readers import BoxSet
from pipeline.boxes.scenes import SHAPES, make_scene, make_scenes, scene_labels, write_scenes
from pipeline.boxes.writers import write_coco

TAMIS = Path(sys.executable).parent / "tamis"
POOL = make_scenes(24, seed=1)


def _data(root: Path) -> tuple[Path, Path]:
    """A flat folder of 24 scenes (the pool) and a COCO test file of 6 other scenes, in a folder of its own."""
    write_scenes(root / "pool", POOL)
    test = [make_scene(f"test_{i:03d}.png", 10_000 + i) for i in range(6)]
    boxes = write_scenes(root / "test", test)
    boxes.labels = SHAPES  # the categories in the shapes' order (write_scenes lists them as they first appear)
    write_coco(root / "test" / "test.json", boxes)
    return root / "pool", root / "test" / "test.json"


def _label_batch(artifacts: Path, round_index: int) -> int:
    """What an annotator hands back: a COCO JSON of the exported images' boxes under their original file names
    (names.json lists them), dropped into the inbox."""
    names = json.loads((artifacts / "rounds" / f"{round_index:03d}" / "export" / "names.json").read_text())
    labels = scene_labels(POOL, names)
    (artifacts / "inbox").mkdir(exist_ok=True)
    write_coco(artifacts / "inbox" / f"labels-{round_index:03d}.json", labels)
    return len(names)


def _run(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "2000"}
    return subprocess.run([str(TAMIS), *args], cwd=project, env=env, capture_output=True, text=True, timeout=1800)


@pytest.mark.slow
def test_cli_a_box_project_runs_from_init_to_round_1_without_hand_edits(tmp_path, tiny_models):
    pool, test = _data(tmp_path / "data")
    project = tmp_path / "project"
    project.mkdir()
    init = _run(project, "init", str(pool), "--test", str(test), "--model", str(tiny_models["idefics3"]))
    assert init.returncode == 0, init.stdout + init.stderr
    assert "a box project" in init.stdout and "COCO file of 6 images" in init.stdout
    art = project / "artifacts"

    r0 = _run(project, "round")
    assert r0.returncode == 0, r0.stdout + r0.stderr
    export = art / "rounds" / "000" / "export"
    assert "<RectangleLabels" in (export / "label_config.xml").read_text()
    coco = json.loads((export / "predictions_coco.json").read_text())
    tasks = json.loads((export / "label_studio_tasks.json").read_text())
    assert [c["name"] for c in coco["categories"]] == list(SHAPES) and len(tasks) == len(coco["images"]) > 0
    assert all(t["predictions"] == [] for t in tasks)  # no model yet: nothing to predict with
    assert _label_batch(art, 0) == len(tasks)

    r1 = _run(project, "round")
    assert r1.returncode == 0, r1.stdout + r1.stderr
    state = json.loads((art / "rounds" / "001" / "round.json").read_text())
    assert state["labeled"] == len(tasks) and {"map50", "map"} <= set(state["metrics"])
    logged = [json.loads(line) for line in (art / "metrics.jsonl").read_text().splitlines()]
    assert {r["metric"] for r in logged if r.get("round") == 1} >= {"map50", "map"}
    # The ledger holds box labels: the COCO file's boxes, by the original file names.
    ledger = [e for e in map(json.loads, (art / "labels.jsonl").read_text().splitlines()) if "label" in e]
    assert len(ledger) == len(tasks) and all(parse_box_label(e["label"]) for e in ledger)
    tasks1 = json.loads((art / "rounds" / "001" / "export" / "label_studio_tasks.json").read_text())
    predicted = [p for t in tasks1 for p in t["predictions"]]
    assert predicted, "round 1's tasks carry no box predictions"
    for p in predicted:
        assert p["model_version"].startswith("adapter-") and 0 <= p["score"] <= 1
        assert all(r["type"] == "rectanglelabels" and r["value"]["rectanglelabels"][0] in SHAPES
                   and 0 <= r["score"] <= 1 and r["original_width"] > 0 for r in p["result"])
    # The round report draws a box project's boxes: its sources name the family's codec; its pictures exist.
    sources = json.loads((art / "rounds" / "001" / "report_sources.json").read_text())
    assert sources["box_codec"] == "json_1000" and (art / "rounds" / "001" / "report.html").is_file()
    report = (art / "rounds" / "001" / "report.html").read_text()
    assert "Test images with the most box errors" in report and "AP@0.5" in report  # by boxes, not by text
    export = art / "rounds" / "001" / "export"
    assert {p.name for p in (export / "yolo" / "images").iterdir()} == {p.name for p in (export / "images").iterdir()}
    # The per-class AP of round 1's evaluation, in `tamis status --per-class` and the exported model's card.
    status = _run(project, "status", "--per-class")
    assert status.returncode == 0 and "per-class AP (round 1)" in status.stdout, status.stdout + status.stderr
    card = _run(project, "export-model", "--out", str(tmp_path / "exported"))
    assert card.returncode == 0, card.stdout + card.stderr
    readme = (tmp_path / "exported" / "README.md").read_text()
    assert "map50 = " in readme and "| class | AP@0.5 | 95% CI | AP@[.5:.95] | 95% CI | labeled boxes |" in readme
    # `tamis predict` with round 1's adapter: boxes in each new image's own pixels (mixed aspect ratios).
    new = [make_scene(f"new_{i}.png", 900 + i, canvases=[c]) for i, c in enumerate([(480, 240), (200, 400)])]
    write_scenes(tmp_path / "new", new)
    pred = _run(project, "predict", str(tmp_path / "new"), "--out", str(tmp_path / "boxes.csv"))
    assert pred.returncode == 0, pred.stdout + pred.stderr
    sizes = {s.name: (s.width, s.height) for s in new}
    lines = [json.loads(x) for x in (tmp_path / "boxes.jsonl").read_text().splitlines()]
    assert sorted(x["file"] for x in lines) == sorted(sizes)
    for x in lines:
        w, h = sizes[x["file"]]
        assert all(0 <= b["box"][0] and 0 <= b["box"][1] and b["box"][0] + b["box"][2] <= w + 0.1
                   and b["box"][1] + b["box"][3] <= h + 0.1 for b in x["boxes"])


def test_init_detects_a_box_project(tmp_path, tiny_models):
    from pipeline.config import load_config
    from pipeline.model.hardware import Hardware
    from pipeline.project_init import init_project

    pool, test = _data(tmp_path / "data")
    out = tmp_path / "project" / "tamis.yaml"
    hw = Hardware("cpu", [], 2, 8 << 30, 6 << 30)
    res = init_project(pool, test=test, model=str(tiny_models["idefics3"]), out=out, hw=hw)
    cfg = load_config(out)
    assert cfg.data.task == "boxes" and cfg.data.answers == list(SHAPES) and res.answers == list(SHAPES)
    assert [s.kind for s in cfg.data.sources] == ["folder", "coco"] and cfg.labelcheck.method == "heldout"
    assert cfg.select.strategy == "token_entropy" and "disc" in cfg.data.question
    assert any("COCO JSON that names the original files" in s for s in res.next_steps)


def test_a_coco_source_reads_box_labels(tmp_path):
    from pipeline.config import DataConfig, SourceConfig
    from pipeline.data.readers import READERS, RawRow, Rejected

    _, test = _data(tmp_path)
    source = SourceConfig(kind="coco", path=test, default_split="test")
    rows = list(READERS["coco"]().rows(source, DataConfig(task="boxes", answers=list(SHAPES), sources=[source])))
    assert len(rows) == 6 and all(isinstance(r, RawRow) and r.split == "test" for r in rows)
    assert {Path(r.image_path).name for r in rows} == {f"test_{i:03d}.png" for i in range(6)}
    first = sorted(rows, key=lambda r: r.image_path)[0]
    assert first.answer == box_label(make_scene("test_000.png", 10_000).boxes)
    # A box that lies outside its image sets the image aside, whole.
    data = json.loads(test.read_text())
    data["annotations"][0]["bbox"] = [5000, 5000, 10, 10]
    test.write_text(json.dumps(data))
    rows = list(READERS["coco"]().rows(source, DataConfig(task="boxes", answers=list(SHAPES), sources=[source])))
    assert sum(isinstance(r, Rejected) for r in rows) == 1 and len(rows) == 6


def test_box_label_files_come_into_the_ledger_by_original_file_name(tmp_path):
    from pipeline.annotation.label_files import LabelKeys, read_label_file

    scenes = POOL[:3]
    write_scenes(tmp_path / "pool", scenes)
    coco = tmp_path / "labels.json"
    boxes = BoxSet(labels=SHAPES, images={s.name: list(s.boxes) for s in scenes},
                   sizes={s.name: (s.width, s.height) for s in scenes})
    write_coco(coco, boxes)
    keys = LabelKeys(box_labels=SHAPES)
    lf = read_label_file(coco, keys)
    assert lf.format == "coco" and len(lf.rows) == 3
    by_image = {r.image: r.label for r in lf.rows}
    assert by_image == {s.name: box_label(s.boxes) for s in scenes}
    # A class outside the project's list is a problem of that row, named.
    lf = read_label_file(coco, LabelKeys(box_labels=("disc",)))
    assert any(r.problem and "not in the class list ['disc']" in r.problem for r in lf.rows)
    # Label Studio RectangleLabels (a corrected prediction) read into the same box label.
    s = scenes[0]
    result = [{"type": "rectanglelabels", "from_name": "answer", "to_name": "image", "original_width": s.width,
               "original_height": s.height, "value": {"x": b.x / s.width * 100, "y": b.y / s.height * 100,
                                                      "width": b.w / s.width * 100, "height": b.h / s.height * 100,
                                                      "rotation": 0, "rectanglelabels": [b.label]}}
              for b in s.boxes]
    ls = tmp_path / "ls.json"
    ls.write_text(json.dumps([{"id": 1, "data": {"image": f"/data/local-files/?d=x/{s.name}"},
                               "annotations": [{"id": 7, "result": result}]}]))
    (row,) = read_label_file(ls, keys).rows
    assert row.problem is None and parse_box_label(row.label) == parse_box_label(box_label(s.boxes))
