"""`tamis init` (pipeline.project_init): what it detects at a path, what it refuses and why, the config it writes,
and, as a user runs it, `tamis init` then `tamis round` on a flat folder of photos with a labeled test CSV."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from skimage import data

from pipeline.config import load_config
from pipeline.errors import ConfigError, DataError, ModelError
from pipeline.model.hardware import Hardware
from pipeline.project_init import init_project
from pipeline.project_init.detect import detect_source, detect_test

TAMIS = Path(sys.executable).parent / "tamis"
PHOTOS = {"astronaut": data.astronaut, "coffee": data.coffee, "chelsea": data.chelsea, "rocket": data.rocket}
CPU = Hardware("cpu", [], 2, 8 << 30, 6 << 30)


def _crop(img: np.ndarray, rng: np.random.Generator, size: tuple[int, int]) -> Image.Image:
    h, w = img.shape[:2]
    y, x = rng.integers(0, h // 3), rng.integers(0, w // 3)
    return Image.fromarray(img[y:y + h // 2, x:x + w // 2]).resize(size)


def photo_project(root: Path, per_class: int = 6, test_per_class: int = 2, size=(120, 90)) -> tuple[Path, Path]:
    """A flat folder of photo crops named by what they show (JPEG) and a test folder with labels.csv (file,category)."""
    rng = np.random.default_rng(0)
    pool, test = root / "photos", root / "test"
    pool.mkdir(parents=True)
    test.mkdir()
    rows = [["file", "category"]]
    for name, load in PHOTOS.items():
        img = load()
        for i in range(per_class):
            _crop(img, rng, size).save(pool / f"{name} shot {i:02d}.jpg")
        for i in range(test_per_class):
            _crop(img, rng, size).save(test / f"t_{name}{i}.png")
            rows.append([f"t_{name}{i}.png", name])
    with (test / "labels.csv").open("w", newline="") as f:
        csv.writer(f).writerows(rows)
    return pool, test / "labels.csv"


def test_detects_each_kind_of_source(tmp_path):
    pool, labels = photo_project(tmp_path)
    flat = detect_source(pool)
    assert flat.source == {"kind": "folder", "path": str(pool)} and flat.images == 24 and flat.labeled == 0
    assert flat.answers == [] and set(flat.sizes) == {(120, 90)} and "flat folder of 24 images" in flat.what

    classes = tmp_path / "classes"
    for name in ("mug", "teapot"):
        (classes / name).mkdir(parents=True)
        for i in range(3):
            Image.open(next(pool.glob("coffee*"))).save(classes / name / f"{name}{i}.png")
    labeled = detect_source(classes)
    assert labeled.labeled == 6 and labeled.answers == ["mug", "teapot"] and "2 class sub-folders" in labeled.what

    test = detect_test(labels, pool)
    assert test.source == {"kind": "csv", "path": str(labels), "image_column": "file", "answer_column": "category",
                           "default_split": "test"}
    assert test.answers == sorted(PHOTOS) and test.labeled == 8

    manifest = tmp_path / "photos.jsonl"
    manifest.write_text("".join(json.dumps({"path": f"photos/{p.name}", "label": p.name.split()[0] if i % 2 else ""})
                                + "\n" for i, p in enumerate(sorted(pool.iterdir()))))
    found = detect_source(manifest)
    assert found.source == {"kind": "jsonl", "path": str(manifest), "image_column": "path", "answer_column": "label"}
    assert found.images == 24 and found.labeled == 12

    studio = tmp_path / "export.json"
    studio.write_text(json.dumps([{"data": {"img": "/data/local-files/?d=a.png"}, "annotations": []},
                                  {"data": {"img": "/data/b.jpg"},
                                   "annotations": [{"result": [{"value": {"choices": ["mug"]}}]}]}]))
    ls = detect_source(studio)
    assert ls.source == {"kind": "label_studio", "path": str(studio), "data_image_key": "img"} and ls.labeled == 1


def test_bad_inputs_name_the_file_and_the_fix(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: no images found .*point tamis init at the folder"):
        detect_source(tmp_path / "empty")
    bad = tmp_path / "bad.csv"
    bad.write_bytes(b"file,category\n\xff\xfe.png,x\n")
    with pytest.raises(DataError, match=r"bad.csv: not UTF-8 text .*re-save it as UTF-8"):
        detect_source(bad)
    pool, labels = photo_project(tmp_path / "p")
    elsewhere = tmp_path / "labels.csv"
    elsewhere.write_text(labels.read_text())  # names images that are not beside it
    with pytest.raises(DataError, match=r"labels.csv: none of its columns \(file, category\) names an image file "
                                        r"found relative to .*column 'file', e.g. 't_astronaut0.png', is not there"):
        detect_test(elsewhere, pool)
    no_answers = labels.parent / "no_answers.csv"
    no_answers.write_text("file,split,note\n" + "".join(f"{p.name},test,x\n" for p in labels.parent.glob("*.png")))
    with pytest.raises(DataError, match="no answer column found among file, split, note; name it answer"):
        detect_test(no_answers, pool)
    with pytest.raises(DataError, match="test set lies inside the pool folder"):
        detect_test(labels, labels.parent.parent)
    with pytest.raises(DataError, match="test file not found"):
        detect_test(tmp_path / "missing.csv", pool)


def test_init_writes_a_config_load_config_accepts_and_never_overwrites(tmp_path, tiny_models):
    pool, labels = photo_project(tmp_path)
    out = tmp_path / "proj" / "tamis.yaml"
    res = init_project(pool, test=labels, model=str(tiny_models["idefics3"]), out=out, hw=CPU)
    cfg = load_config(out)
    assert cfg.data.answers == sorted(PHOTOS) and [s.kind for s in cfg.data.sources] == ["folder", "csv"]
    assert cfg.data.sources[1].answer_column == "category" and cfg.data.sources[1].default_split == "test"
    assert cfg.artifacts == tmp_path / "proj" / "artifacts"
    # The tiny stand-in's own size and the demo's tiny-model settings; the pool's size sets the batch.
    assert cfg.preprocess.size == 32 and cfg.model.lora_r == 64 and cfg.train.init == "warm"
    assert cfg.select.embeddings.source == "pool" and cfg.select.candidates.method == "auto"
    assert cfg.select.batch_size == 2 and "# the tiny stand-in was built for 32 px" in res.text
    # A 20-image pool cannot spare a stop set: the default stop stays off and the file says why.
    assert cfg.rounds.stop_set == 0 and "cannot spare a stop set" in res.text
    assert cfg.rounds.stop_when_converged is not None
    # The label-efficiency winner, with no switch point to set: Uncertainty Herding over margin.
    assert (cfg.select.cold_start, cfg.select.strategy, cfg.select.diversity) == (
        "maxherding", "margin", "uncertainty_herding") and cfg.select.schedule.coverage == "none"
    assert any("tamis round -c" in s for s in res.next_steps)
    before = out.read_text()
    with pytest.raises(ConfigError, match="already exists; tamis init never overwrites a config: pass --force"):
        init_project(pool, test=labels, model=str(tiny_models["idefics3"]), out=out, hw=CPU)
    assert out.read_text() == before
    init_project(pool, test=None, model=str(tiny_models["idefics3"]), out=out, hw=CPU, force=True)
    opened = load_config(out)
    assert opened.data.answers is None  # no test answers, no class folders: open answers
    # ... scored by semantic entropy over 4 sampled answers, still under Uncertainty Herding
    assert (opened.select.strategy, opened.select.diversity, opened.select.mc_dropout_passes) == (
        "semantic_entropy", "uncertainty_herding", 4)


def test_a_hub_model_gets_a_size_from_the_images(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    pool, labels = photo_project(tmp_path, size=(200, 150))
    res = init_project(pool, test=labels, model="HuggingFaceTB/SmolVLM-256M-Instruct", out=tmp_path / "t.yaml",
                       hw=CPU)
    cfg = load_config(tmp_path / "t.yaml")
    # The photos are 200 px: 224, not 512 (upscaling small photos only blurs them).
    assert cfg.preprocess.size == 224 and "median longest side" in res.settings.size.why
    assert cfg.model.name_or_path == "HuggingFaceTB/SmolVLM-256M-Instruct"
    assert cfg.select.embeddings.source == "vision_tower" and "not reachable from here yet" in res.model_note
    assert any("13-60 s a step on a CPU" in n for n in res.settings.notes)


@pytest.mark.slow
def test_cli_init_then_round_exports_the_first_batch_by_original_file_name(tmp_path, tiny_models):
    """A new user's first hour: `tamis init` on a flat folder of photos with a labeled test CSV and a tiny local
    model, then `tamis round`, unedited; the export names each image by its original file name."""
    pool, labels = photo_project(tmp_path / "data")
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    init = subprocess.run([str(TAMIS), "init", str(pool), "--test", str(labels), "--model",
                           str(tiny_models["idefics3"])], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert init.returncode == 0, init.stdout + init.stderr
    assert "wrote tamis.yaml" in init.stdout and "next steps:" in init.stdout
    rnd = subprocess.run([str(TAMIS), "round", "-c", "tamis.yaml"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=1200)
    assert rnd.returncode == 0, rnd.stdout + rnd.stderr
    export = tmp_path / "artifacts" / "rounds" / "000" / "export"
    with (export / "annotate.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    originals = {p.name for p in pool.iterdir()}
    assert len(rows) == 2 and {r["original_image"] for r in rows} <= originals
    tasks = json.loads((export / "label_studio_tasks.json").read_text())
    assert {t["data"]["original_image"] for t in tasks} == {r["original_image"] for r in rows}
    assert str(export) in " ".join(rnd.stdout.split())  # the CLI says where the batch is
    assert yaml.safe_load((tmp_path / "tamis.yaml").read_text())["select"]["candidates"] == "auto"


def test_init_sizes_the_stop_set_to_the_pool():
    from pipeline.project_init.settings import stop_set_size

    assert stop_set_size(150).value == 0
    assert stop_set_size(3_000).value == 300 and "a tenth of the 3,000-image pool" in stop_set_size(3_000).why
    assert stop_set_size(1_000_000).value == 500


# --- the second hour (issue 47): manifests whose test rows come last, open answers, models, small classes ---

def _run_init(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    # COLUMNS: rich wraps piped output at 200 columns; a wide one keeps each message on one line for the asserts.
    return subprocess.run([str(TAMIS), "init", *args], cwd=cwd, env={**(env or os.environ), "COLUMNS": "2000"},
                          capture_output=True, text=True, timeout=600)


def shapes(root: Path, n: int, size: int = 48) -> list[Path]:
    """n generated PNGs, not digits: a coloured disc, square or bar (by i % 3) on dark noise."""
    from PIL import ImageDraw

    rng = np.random.default_rng(1)
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        im = Image.fromarray(rng.integers(0, 60, (size, size, 3), dtype=np.uint8))
        colour = tuple(int(c) for c in rng.integers(120, 256, 3))
        lo, hi = size // 5, size - size // 5
        box = (lo, lo, hi, hi) if i % 3 < 2 else (size // 2 - 4, lo, size // 2 + 4, hi)
        (ImageDraw.Draw(im).ellipse if i % 3 == 0 else ImageDraw.Draw(im).rectangle)(box, fill=colour)
        out.append(root / f"img{i:03d}.png")
        im.save(out[-1])
    return out


def test_cli_init_finds_the_answers_of_test_rows_after_100k_pool_rows(tmp_path, tiny_models):
    """A JSONL manifest of 100,000 pool rows (no answer key) then 500 test rows with `answer` and `split: test`:
    init reads the columns of every row, writes the 10-class closed set, and no longer asks for a test set. Reading
    and checking the 100,500-row manifest (detect_source) took 1.7 s on a shared 2-core machine at load 8.6, the whole
    `tamis init` ~25 s there (imports, the tiny model's facts); no timing assert."""
    files = shapes(tmp_path / "data" / "images", 40)
    classes = [f"shape {c}" for c in "abcdefghij"]
    with (tmp_path / "data" / "manifest.jsonl").open("w") as f:
        for i in range(100_000):
            f.write(json.dumps({"image": f"images/{files[i % 40].name}"}) + "\n")
        for i in range(500):
            f.write(json.dumps({"image": f"images/{files[i % 40].name}", "answer": classes[i % 10],
                                "split": "test"}) + "\n")
    init = _run_init(tmp_path, str(tmp_path / "data" / "manifest.jsonl"), "--model", str(tiny_models["idefics3"]))
    assert init.returncode == 0, init.stdout + init.stderr
    assert "answers in `answer`: 500 labeled, 500 in the test split" in init.stdout
    cfg = load_config(tmp_path / "tamis.yaml")
    assert cfg.data.answers == classes and cfg.data.sources[0].answer_column == "answer"
    assert (cfg.select.strategy, cfg.select.mc_dropout_passes) == ("margin", 0)
    assert "add a labeled test set" not in init.stdout and "open answers" not in init.stdout


def _word_manifest(root: Path, answers: list[str], pool: int = 30) -> Path:
    files = shapes(root / "images", pool + len(answers))
    rows = [{"image": f"images/{p.name}"} for p in files[:pool]]
    rows += [{"image": f"images/{p.name}", "answer": a, "split": "test"} for p, a in zip(files[pool:], answers, strict=True)]
    (root / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "manifest.jsonl"


def test_cli_init_open_and_closed_flags_and_free_text_detection(tmp_path, tiny_models):
    """40 word-sign test answers, each seen once or twice: free text (open answers, semantic entropy over 4 sampled
    answers) without a flag; --closed forces the closed set, --open forces open answers over 3 repeated classes."""
    model = str(tiny_models["idefics3"])
    words = [f"sign for {w}" for w in ("hello", "thanks", "please", "sorry", "yes", "no", "water", "food", "help",
                                       "home", "school", "friend", "family", "mother", "father", "baby", "love",
                                       "happy", "sad", "tired", "hungry", "cold", "hot", "good", "bad", "more",
                                       "finish", "again", "name", "where", "what", "who", "why", "when", "how",
                                       "now", "later", "today", "tomorrow", "yesterday")]
    manifest = _word_manifest(tmp_path / "signs", words + words[:10])
    auto = _run_init(tmp_path, str(manifest), "--model", model, "--out", "auto.yaml")
    assert auto.returncode == 0, auto.stdout + auto.stderr
    cfg = load_config(tmp_path / "auto.yaml")
    assert cfg.data.answers is None
    assert (cfg.select.strategy, cfg.select.mc_dropout_passes) == ("semantic_entropy", 4)
    assert cfg.model.max_new_tokens == 14  # 3 words: 2 a word + 8
    assert "40 distinct answers in 50 labeled rows" in auto.stdout and "pass --closed" in auto.stdout

    closed = _run_init(tmp_path, str(manifest), "--model", model, "--out", "closed.yaml", "--closed")
    assert closed.returncode == 0, closed.stdout + closed.stderr
    assert load_config(tmp_path / "closed.yaml").data.answers == sorted(words)

    three = _word_manifest(tmp_path / "three", ["red", "green", "blue"] * 8)
    res = init_project(three, test=None, model=model, out=tmp_path / "three.yaml", hw=CPU)
    assert res.answers == ["blue", "green", "red"] and "pass --open if they are free text" in res.answers_why
    res = init_project(three, test=None, model=model, out=tmp_path / "open.yaml", hw=CPU, answer_mode="open")
    forced = load_config(tmp_path / "open.yaml")
    assert forced.data.answers is None and forced.select.strategy == "semantic_entropy"
    with pytest.raises(ConfigError, match="--closed: a closed answer set needs at least 2 answers, and 0"):
        init_project(three.parent / "images", test=None, model=model, out=tmp_path / "y.yaml", hw=CPU,
                     answer_mode="closed")

    both = _run_init(tmp_path, str(three), "--model", model, "--out", "x.yaml", "--open", "--closed")
    assert both.returncode == 2 and "--open and --closed: give one of them" in both.stderr
    assert not (tmp_path / "x.yaml").exists() and not (tmp_path / "y.yaml").exists()


def test_free_form_rule():
    from collections import Counter

    from pipeline.project_init.answers import free_form

    assert free_form(Counter({f"class {i}": 50 for i in range(10)})) is None  # 10 classes × 50
    assert free_form(Counter({f"w{i}": 1 for i in range(19)})) is None  # too few answers to tell
    assert "most are seen once" in free_form(Counter({f"w{i}": 1 for i in range(20)}))
    assert "median answer has 5 words" in free_form(Counter({"a red bus on a": 1, "two cats": 1, "a dog in the park": 3}))


def test_cli_init_stops_on_a_model_that_does_not_exist_and_puts_an_unreachable_one_first(tmp_path):
    """A local folder that is no model, or a checkpoint a round cannot load (text-only), stops init (nothing
    written); a hub model this offline machine cannot reach still gets its config, with the problem as its first
    line and the first next step."""
    pool, labels = photo_project(tmp_path / "data")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty-cache")}
    (tmp_path / "not-a-model").mkdir()
    bad = _run_init(tmp_path, str(pool), "--test", str(labels), "--model", str(tmp_path / "not-a-model"), env=env)
    assert bad.returncode == 2 and "not a model folder (no config.json)" in bad.stderr
    assert not (tmp_path / "tamis.yaml").exists()

    from transformers import LlamaConfig, LlamaForCausalLM

    text_only = tmp_path / "text-only"  # a checkpoint here that no round can load: stopped, with the finding
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=128)).save_pretrained(text_only)
    with pytest.raises(ModelError, match=r"a round could not load it \(family: .*text-only checkpoint"):
        init_project(pool, test=labels, model=str(text_only), out=tmp_path / "tamis.yaml", hw=CPU)
    assert not (tmp_path / "tamis.yaml").exists()

    far = _run_init(tmp_path, str(pool), "--test", str(labels), "--model", "org/some-vlm", env=env)
    assert far.returncode == 0, far.stdout + far.stderr
    first = (tmp_path / "tamis.yaml").read_text().splitlines()[0]
    assert first.startswith("# FIRST, before a round: model.name_or_path 'org/some-vlm': not in the HF cache")
    assert "hf download org/some-vlm" in first
    steps = far.stdout.split("next steps:")[1]
    assert steps.lstrip().startswith("1. fix the model first: model.name_or_path 'org/some-vlm'")


def test_init_warns_of_classes_with_fewer_than_2_images(tmp_path, tiny_models):
    pool, labels = photo_project(tmp_path)
    with labels.open("a") as f:  # one test image of a fifth class
        Image.open(next(labels.parent.glob("*.png"))).save(labels.parent / "t_mug.png")
        f.write("t_mug.png,mug\n")
    res = init_project(pool, test=labels, model=str(tiny_models["idefics3"]), out=tmp_path / "t.yaml", hw=CPU)
    assert res.answers == sorted([*PHOTOS, "mug"])
    assert len(res.warnings) == 1
    assert res.warnings[0].startswith("class 'mug' has 1 labeled image (in the test set): its test accuracy rests on "
                                      "that one image (0 or 100 %)")
    assert "stratified split" in res.warnings[0] and "label at least one more image" in res.warnings[0]
    assert not any("add a labeled test set" in s for s in res.next_steps)


SHAPE_NAMES = ("disc", "square", "bar")  # shapes() draws shape i % 3


def _shape_manifest(root: Path, pool: int, test: int, answer=lambda name: name) -> Path:
    """A JSONL manifest as a new user has one: `pool` unlabeled rows first, then `test` rows with `answer` and
    `split: test` (the only rows with an answer), one generated image each."""
    files = shapes(root / "images", pool + test)
    rows = [{"image": f"images/{p.name}"} for p in files[:pool]]
    rows += [{"image": f"images/{p.name}", "answer": answer(SHAPE_NAMES[i % 3]), "split": "test"}
             for i, p in enumerate(files[pool:], pool)]
    (root / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "manifest.jsonl"


def _label_the_batch(artifacts: Path, round_index: int, answer) -> int:
    """What a user does between rounds: fill the label column of the exported annotate.csv and drop the file into
    artifacts/inbox/. Returns the rows labeled."""
    with (artifacts / "rounds" / f"{round_index:03d}" / "export" / "annotate.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["label"] = answer(SHAPE_NAMES[int(Path(r["original_image"]).stem.removeprefix("img")) % 3])
    inbox = artifacts / "inbox"
    inbox.mkdir(parents=True, exist_ok=True)
    with (inbox / f"labels-round-{round_index:03d}.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return len(rows)


def _three_rounds(project: Path, env: dict, answer) -> list[dict]:
    states = []
    for i in range(3):
        rnd = subprocess.run([str(TAMIS), "round"], cwd=project, env=env, capture_output=True, text=True,
                             timeout=1800)
        assert rnd.returncode == 0, f"round {i}:\n{rnd.stdout}\n{rnd.stderr}"
        assert "using ./tamis.yaml" in rnd.stderr
        states.append(json.loads((project / "artifacts" / "rounds" / f"{i:03d}" / "round.json").read_text()))
        if i < 2:
            assert _label_the_batch(project / "artifacts", i, answer) == states[-1]["selected"] > 0
    return states


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["closed", "open"])
def test_cli_a_new_users_manifest_runs_from_init_to_round_2_without_hand_edits(tmp_path, tiny_models, kind):
    """Issue 47's first "done when": a JSONL manifest whose test rows come last (40 pool images, 12 test rows),
    `tamis init` (closed: the 3 shapes; open: `--open`, answers typed as short phrases), then `tamis round` three
    times in the project folder without -c, the batches labeled by filling annotate.csv into artifacts/inbox/ —
    no edit of the config written."""
    answer = (lambda name: name) if kind == "closed" else (lambda name: f"a {name}")
    manifest = _shape_manifest(tmp_path / "data", pool=40, test=12, answer=answer)
    project = tmp_path / "project"
    project.mkdir()
    env = {**os.environ, "COLUMNS": "2000"}
    init = _run_init(project, str(manifest), "--model", str(tiny_models["idefics3"]),
                     *(["--open"] if kind == "open" else []), env=env)
    assert init.returncode == 0, init.stdout + init.stderr
    assert "add a labeled test set" not in init.stdout
    cfg = load_config(project / "tamis.yaml")
    assert cfg.data.answers == (sorted(SHAPE_NAMES) if kind == "closed" else None)

    states = _three_rounds(project, env, answer)
    assert [s["round"] for s in states] == [0, 1, 2]
    assert states[2]["labeled"] == states[0]["selected"] + states[1]["selected"]
    main = "accuracy" if kind == "closed" else "token_f1"
    assert main in states[2]["metrics"] and main in states[1]["metrics"]
    if kind == "open":
        assert states[2]["strategy"].startswith("semantic_entropy")
