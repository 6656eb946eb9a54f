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
from pipeline.errors import ConfigError, DataError
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
