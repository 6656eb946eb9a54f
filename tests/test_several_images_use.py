"""Samples of several images in the label check, `tamis predict` and the export's predict.py (issue 51 item 2): each
stage reads every picture of a sample, or refuses with the reason and the fix. The whole path, as a user runs it,
is in tests/test_several_images_round.py (predict and export-model after round 1)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import datasets
from PIL import Image

from pipeline.config import parse_config
from pipeline.labelcheck.stage import check_columns
from pipeline.predict import read_new_images
from pipeline.schema import Question
from pipeline.scoring import row_inputs
from pipeline.serving.predict_config import SCRIPT


def _png(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 12), colour).save(buf, "PNG")
    return buf.getvalue()


def test_the_label_check_reads_every_picture_of_a_sample_as_training_did():
    labeled = datasets.Dataset.from_list([
        {"sample_id": f"s{i}", "prepared": _png((200, 10 * i, 10)), "more_prepared": [_png((10, 10, 200))],
         "context": [{"role": "system", "text": "Answer briefly."}], "question": "Which is warmer?",
         "answer": "left", "image_path": f"/data/a{i}.png"} for i in range(3)])
    rows = list(labeled.select_columns(check_columns(labeled.column_names)))
    images, questions = row_inputs(rows)
    assert all(isinstance(ims, list) and len(ims) == 2 for ims in images)
    assert all(isinstance(q, Question) and q.images == 2 and q.context == (("system", "Answer briefly."),)
               for q in questions)
    one = datasets.Dataset.from_list([{"sample_id": "s", "prepared": _png((1, 2, 3)), "question": "q", "answer": "a"}])
    assert check_columns(one.column_names) == ["sample_id", "prepared", "question", "answer"]  # one image: as before


def test_predict_reads_a_file_in_the_projects_conversation_format_one_sample_of_several_images_per_record(tmp_path):
    (tmp_path / "pics").mkdir()
    for name, colour in (("a", (200, 20, 20)), ("b", (20, 20, 200)), ("c", (20, 200, 20))):
        Image.new("RGB", (40, 30), colour).save(tmp_path / "pics" / f"{name}.png")
    record = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                        {"type": "text", "text": "Which is warmer?"}]}]}
    (tmp_path / "new.jsonl").write_text(json.dumps({**record, "images": ["pics/a.png", "pics/b.png"]}) + "\n"
                                        + json.dumps({**record, "images": ["pics/c.png", "pics/a.png"]}) + "\n")
    cfg = parse_config({"data": {"sources": [{"kind": "trl", "path": "train.jsonl"}]}, "preprocess": {"size": 32}},
                       root=tmp_path)
    got = list(read_new_images(tmp_path / "new.jsonl", data=cfg.data, preprocess=cfg.preprocess, model=cfg.model))
    assert [(g.file, g.more_files, g.error) for g in got] == [("pics/a.png", ["pics/b.png"], None),
                                                            ("pics/c.png", ["pics/a.png"], None)]
    images, questions = row_inputs([g.scored_row() for g in got])
    assert [len(ims) for ims in images] == [2, 2] and all(q.images == 2 for q in questions)
    assert Image.open(io.BytesIO(got[0].more_prepared[0])).getpixel((16, 16))[2] > 150  # the second picture, blue


def test_the_exports_predict_py_refuses_a_model_of_several_images_with_the_reason_and_the_fix(tmp_path):
    (tmp_path / "predict.py").write_text(SCRIPT.read_text())
    (tmp_path / "predict_config.json").write_text(json.dumps({"format": 1, "images_per_sample": 2}))
    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")
    res = subprocess.run([sys.executable, str(tmp_path / "predict.py"), str(tmp_path / "x.png")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res
    assert "samples of 2 images" in res.stderr and "tamis predict -c CONFIG samples.jsonl" in res.stderr
