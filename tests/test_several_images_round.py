"""Issue 51's first "done when", run as a user runs it: a TRL-format JSONL of two-image samples (before / after
pairs of scikit-image pictures, not the digits) goes through `tamis init` → round 0 (every exported task shows both
pictures) → labels back (the exported annotate.csv filled in and dropped into the inbox) → round 1 (trained on both
pictures, evaluated on the test split) → `tamis export-data` in all four formats, each loaded back."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.test_init import TAMIS

CHANGES = ("flipped", "darker", "same")  # what happened from the first picture to the second


def pairs(root: Path, pool: int, test: int) -> Path:
    """`pool` unlabeled and `test` labeled (split: test) before / after pairs, as TRL records."""
    from skimage import data

    pics = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket(), data.immunohistochemistry()]
    (root / "images").mkdir(parents=True)
    rows = []
    for i in range(pool + test):
        base = np.roll(np.asarray(Image.fromarray(pics[i % len(pics)]).resize((48, 40))), 3 * i, axis=1)
        change = CHANGES[i % 3]
        after = base[:, ::-1] if change == "flipped" else base // 3 if change == "darker" else base.copy()
        names = [f"images/before{i:03d}.png", f"images/after{i:03d}.png"]
        Image.fromarray(base).save(root / names[0])
        Image.fromarray(np.ascontiguousarray(after)).save(root / names[1])
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                             {"type": "text", "text": "What changed from the first picture?"}]}]
        if i >= pool:
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": change}]})
        rows.append({"messages": msgs, "images": names, **({"split": "test"} if i >= pool else {})})
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "pairs.jsonl"


def tamis(project: Path, *args: str) -> subprocess.CompletedProcess:
    res = subprocess.run([str(TAMIS), *args], cwd=project, env={**os.environ, "COLUMNS": "2000"},
                         capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, f"tamis {' '.join(args)}:\n{res.stdout}\n{res.stderr}"
    return res


def check_round0_export(export: Path) -> list[dict]:
    """Every task and row of round 0's export shows both pictures, under their own names and original names."""
    tasks = json.loads((export / "label_studio_tasks.json").read_text())
    assert tasks
    for t in tasks:
        d = t["data"]
        assert d["original_image"].startswith("before") and d["original_image_2"].startswith("after")
        assert d["original_image"][6:] == d["original_image_2"][5:]
        for key in ("image", "image_2"):
            assert (export / "images" / Path(d[key]).name).is_file()
    view = ET.fromstring((export / "label_config.xml").read_text())
    assert [i.get("value") for i in view.iter("Image")] == ["$image", "$image_2"]
    assert sorted(c.get("value") for c in view.iter("Choice")) == sorted(CHANGES)
    with (export / "annotate.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(tasks) and list(rows[0])[-1] == "label"
    assert all(r["original_image_2"] == f"after{r['original_image'][6:]}" for r in rows)
    return rows


def check_predict_and_export_model(project: Path, tmp_path: Path) -> None:
    """`tamis predict` answers new pairs (a TRL file as the project's) on both pictures; `tamis export-model`
    writes the adapter and its card, and the export's standalone predict.py, which asks about one image at a time,
    refuses with the reason and the fix instead of answering."""
    new = pairs(tmp_path / "new", pool=3, test=0)
    tamis(project, "predict", str(new), "--out", str(tmp_path / "pred.csv"))
    rows = [json.loads(x) for x in (tmp_path / "pred.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r.get("error") is None and isinstance(r.get("answer"), str) for r in rows), rows
    assert [[Path(f).name for f in r["files"]] for r in rows] == [[f"before{i:03d}.png", f"after{i:03d}.png"]
                                                                for i in range(3)]
    out = tmp_path / "exported"
    tamis(project, "export-model", "--out", str(out))
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "README.md").is_file()
    assert json.loads((out / "predict_config.json").read_text())["images_per_sample"] == 2
    res = subprocess.run([sys.executable, str(out / "predict.py"), str(tmp_path / "new" / "images")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 2 and "samples of 2 images" in res.stderr and "tamis predict" in res.stderr, res


@pytest.mark.slow
def test_two_image_trl_samples_go_from_init_through_two_rounds_to_export_data_in_four_formats(tmp_path,
                                                                                             tiny_models):
    source = pairs(tmp_path / "data", pool=24, test=9)
    project = tmp_path / "project"
    project.mkdir()
    init = tamis(project, "init", str(source), "--model", str(tiny_models["idefics3"]))
    assert "24 with several images" in init.stdout or "33 with several images" in init.stdout, init.stdout
    tamis(project, "round")
    artifacts = project / "artifacts"
    rows = check_round0_export(artifacts / "rounds" / "000" / "export")
    # The report's contact sheet: each sample's two pictures side by side in its cell (gather.Images.png).
    assert Image.open(artifacts / "rounds" / "000" / "batch.png").width > 0

    for r in rows:  # labels back: the user fills the label column and drops the file into the inbox
        r["label"] = CHANGES[int(r["original_image"][6:9]) % 3]
    (artifacts / "inbox").mkdir(exist_ok=True)
    with (artifacts / "inbox" / "labels-round-000.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    tamis(project, "round")
    state = json.loads((artifacts / "rounds" / "001" / "round.json").read_text())
    assert state["labeled"] == len(rows) and "accuracy" in state["metrics"], state

    check_predict_and_export_model(project, tmp_path)

    from datasets import load_dataset, load_from_disk

    for fmt, file in (("trl", "train.jsonl"), ("llamafactory", "train.json"), ("swift", "train.jsonl"),
                      ("hf", "dataset")):
        out = tmp_path / f"out-{fmt}"
        tamis(project, "export-data", "--format", fmt, "--out", str(out))
        ds = load_from_disk(str(out / file))["train"] if fmt == "hf" else load_dataset(
            "json", data_files=str(out / file))["train"]
        assert len(ds) == len(rows)
        files = [r["files"] if fmt == "hf" else r["images"] for r in ds]
        assert all(len(f) == 2 and Path(f[0]).name.startswith("before") and Path(f[1]).name.startswith("after")
                   and all((out / p).is_file() for p in f) for f in files), files
