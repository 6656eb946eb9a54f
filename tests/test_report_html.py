"""The round report (report.html) of real rounds: two labeling rounds of the tiny 4-bit model on photographs (crops
of scikit-image's sample photos, not the digits) under the Prefect test server, then what the page shows, `tamis
report --round 1`, and the page as headless Chromium renders it."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from typer.testing import CliRunner

from pipeline.round_state import RoundState
from pipeline.roundreport import REPORT_FILE, ReportSources, build_report
from pipeline.roundreport.gather import per_class_metrics
from pipeline.roundreport.poolmap import pool_map_points
from pipeline.store import read_jsonl

PHOTOS = {"astronaut": "astronaut", "coffee": "coffee", "cat": "chelsea", "rocket": "rocket"}
QUESTION = "What does the photo show?"


def write_photos(root: Path, per_class: int = 16, seed: int = 0) -> Path:
    """Crops and jitters of four scikit-image photos as JPEG / PNG files named after what they show, a manifest
    (a quarter of each class labeled as the test split) and the ground truth the simulated annotator answers from."""
    import skimage.data

    from pipeline.schema import sample_id_for

    rng = np.random.default_rng(seed)
    manifest, truth = [], []
    (root / "images").mkdir(parents=True, exist_ok=True)
    for answer, name in PHOTOS.items():
        photo = getattr(skimage.data, name)()
        for k in range(per_class):
            side = int(rng.integers(min(photo.shape[:2]) // 3, min(photo.shape[:2])))
            y, x = (int(rng.integers(0, photo.shape[i] - side + 1)) for i in (0, 1))
            crop = np.clip(photo[y:y + side, x:x + side].astype(np.float32) * rng.uniform(0.7, 1.3), 0, 255)
            img = Image.fromarray(crop.astype(np.uint8)).resize((48, 48), Image.Resampling.LANCZOS)
            rel = f"images/{answer}_{k:02d}." + ("jpg" if k % 2 else "png")
            img.save(root / rel, quality=90) if k % 2 else img.save(root / rel)
            test = k < per_class // 4
            manifest.append({"image": rel, "question": QUESTION, "split": "test" if test else "pool",
                             **({"answer": answer} if test else {})})
            truth.append({"sample_id": sample_id_for((root / rel).read_bytes(), QUESTION), "image": rel,
                          "answer": answer})
    (root / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in manifest))
    (root / "ground_truth.jsonl").write_text("".join(json.dumps(r) + "\n" for r in truth))
    return root


def write_photo_project(root: Path, model: Path) -> Path:
    photos = write_photos(root / "photos")
    shutil.copytree(model, root / "model")
    cfg = {
        "seed": 0, "paths": {"artifacts": str(root / "artifacts")},
        "data": {"sources": [{"kind": "jsonl", "path": str(photos / "manifest.jsonl")}], "answers": list(PHOTOS),
                 "question": QUESTION, "ground_truth": str(photos / "ground_truth.jsonl")},
        "preprocess": {"size": 32, "pad": "square"},
        "model": {"name_or_path": str(root / "model"), "family": "idefics3", "mode": "qlora"},
        "train": {"batch_size": 4, "effective_batch_size": 4, "max_steps": 2, "learning_rate": 0.002},
        # A selection space of its own (pixels): the map reads the embeddings stage, the batch the score shards.
        "select": {"batch_size": 6, "strategy": "margin", "diversity": "top_k", "shard_size": 16,
                   "embeddings": {"source": "pixels", "pixels_side": 8, "pca_dim": 8}},
        "labelcheck": {"method": "off"},
        "rounds": {"max_rounds": 5, "simulate_annotator": True},
    }
    path = root / "tamis.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def photo_rounds(tmp_path_factory, tiny_models, prefect_harness):
    """(config path, artifacts, [state of round 0, state of round 1]): a cold start and a trained round."""
    from flows.round import labeling_round
    from pipeline.config import load_config

    config = write_photo_project(tmp_path_factory.mktemp("photo-rounds"), tiny_models["idefics3"])
    states = [RoundState.from_json(labeling_round(str(config))) for _ in range(2)]  # the flow returns round.json's
    return config, load_config(config).artifacts, states


def _html(art: Path, r: int) -> str:
    return (art / "rounds" / f"{r:03d}" / REPORT_FILE).read_text(encoding="utf-8")


def _data_images(html: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/[a-z]+;base64,([^"]+)"', html)]


def test_every_round_writes_its_report_with_the_batch_map_errors_and_curve(photo_rounds):
    _, art, states = photo_rounds
    for state in states:
        html = _html(art, state.round)
        batch = read_jsonl(art / "rounds" / f"{state.round:03d}" / "selection" / "selection.jsonl")
        assert len(batch) == state.selected == 6
        # Every batch sample is a card with its thumbnail, in pick order.
        cards = re.findall(r'<figure class="card" data-sample="([0-9a-f]+)">\s*<img class="thumb"', html)
        assert cards == [r["sample_id"] for r in batch]
        # Each card is headed by the user's file name (images/coffee_03.png), the sample ID second, in a tooltip.
        names = re.findall(r'<b class="name" title="sample ([0-9a-f]+)">([^<]+)</b>', html)
        assert [sid for sid, _ in names[:len(batch)]] == cards
        assert all(re.fullmatch(r"(astronaut|coffee|cat|rocket)_\d\d\.(png|jpg)", n) for _, n in names), names
        assert 'id="map"' in html and 'alt="pool map"' in html
        assert "<script" not in html and "http://" not in html and "https://" not in html  # opens offline
        for data in _data_images(html):  # every embedded picture decodes
            Image.open(io.BytesIO(data)).verify()
    cold, trained = _html(art, 0), _html(art, 1)
    assert "coverage (" in cold and "cold start, no model yet" in cold and 'alt="confusion matrix"' not in cold
    # Round 1: the model's top answers with probabilities, the uncertainty, why picked; the errors and the curve.
    assert re.search(r"(astronaut|coffee|cat|rocket) <b>0\.\d\d</b>", trained)
    assert "uncertainty (margin " in trained and "entropy " in trained
    assert 'alt="confusion matrix"' in trained and 'alt="learning curve"' in trained
    assert "Class balance of the 6 labels" in trained
    assert (art / "rounds/001/batch.png").is_file() and (art / "rounds/001/confusion.png").is_file()


def test_why_picked_says_what_the_round_scored_restricted_or_all():
    from pipeline.roundreport.gather import pick_reason

    row = {"strategy": "margin", "diversity": "top_k", "score": 0.25}
    # select.candidates: auto that scored every eligible sample records no candidates nor sources (KeyError before).
    every = {"method": "all", "eligible": 64, "scored": 70, "reason": "64 eligible samples fit the scoring budget"}
    assert pick_reason(row, RoundState(adapter={}, candidates=every)) == (
        "uncertainty (margin 0.250); scored all 64 eligible samples (select.candidates)")
    restricted = {"method": "restrict", "candidates": 40, "eligible": 1300, "scored": 46, "reason": "too many",
                  "sources": {"neighbors": 20, "clusters": 12, "random": 8}}
    assert pick_reason(row, RoundState(adapter={}, candidates=restricted)) == (
        "uncertainty (margin 0.250); scored 40 candidates of 1300 eligible (20 neighbors, 12 clusters, 8 random; "
        "select.candidates) and the 6 labeled samples")


def test_per_class_metrics_agree_with_the_evaluation_and_prefer_its_own_file(photo_rounds, tmp_path):
    _, art, states = photo_rounds
    sources = ReportSources.load(art / "rounds/001")
    pc = per_class_metrics(sources.eval_dir, sources.answers)
    preds = read_jsonl(Path(sources.eval_dir) / "predictions.jsonl")
    assert pc["accuracy"] == pytest.approx(states[1].metrics["accuracy"])
    assert pc["n"] == len(preds) == sum(c["support"] for c in pc["per_class"]) == np.sum(pc["confusion"])
    assert pc["answers"] == list(PHOTOS) and len(pc["confusion"]) == len(PHOTOS)
    assert pc["accuracy_ci95"][0] <= pc["accuracy"] <= pc["accuracy_ci95"][1]
    assert all(r["confidence"] is not None for r in preds)  # the evaluation records how sure each answer was
    # The evaluate stage's own per_class.json, when it writes one, is what the report shows.
    own = tmp_path / "eval"
    shutil.copytree(sources.eval_dir, own)
    (own / "per_class.json").write_text(json.dumps({**pc, "accuracy": 0.123}))
    assert per_class_metrics(own, sources.answers)["accuracy"] == 0.123


def test_the_round_keeps_the_sources_its_stages_read_as_the_project_derives_them(photo_rounds):
    """The round hands its report the embeddings folder and score shards its select stage read (no key worked out
    again); `tamis report` on a round that kept no report_sources.json derives them from the project: the same."""
    from pipeline.config import load_config
    from pipeline.preprocess import latest_refs
    from pipeline.roundreport.sources import resolve_sources
    from pipeline.stage_ref import PreparedRefs

    config, art, states = photo_rounds
    kept = ReportSources.load(art / "rounds/001")
    derived = resolve_sources(load_config(config), states[1], PreparedRefs.of(latest_refs(art)))
    assert kept.shards and kept.space_dir and Path(kept.space_dir).is_dir()
    assert all((Path(d) / "manifest.json").is_file() for _, d in kept.shards)
    assert dataclasses.asdict(derived) == dataclasses.asdict(kept)


def test_pool_map_is_seeded_bounded_and_marks_the_batch(photo_rounds, monkeypatch):
    from pipeline.roundreport import gather, poolmap

    _, art, states = photo_rounds
    sources = ReportSources.load(art / "rounds/001")
    labels = gather.labeled_answers(sources.round_dir)
    batch = [r["sample_id"] for r in read_jsonl(art / "rounds/001/selection/selection.jsonl")]
    one, two = (pool_map_points(sources, states[1], batch, labels) for _ in range(2))
    assert np.array_equal(one.xy, two.xy) and one.kind == two.kind  # the same round draws the same map
    assert one.kind.count("selected") == 6 and one.kind.count("labeled") == len(labels) == 6
    assert {lab for lab in one.label if lab} <= set(PHOTOS)
    assert one.space.startswith("selection embeddings (pixels)") and one.total == 64
    # A pool larger than the budget is sampled down (every selected sample kept), here with the budget lowered.
    monkeypatch.setattr(poolmap, "MAP_POINTS", 10)
    small = pool_map_points(sources, states[1], batch, labels)
    assert small.sampled < one.sampled and small.kind.count("selected") == 6
    # Without an embeddings stage the map reads the model's embeddings from the round's score shards.
    model_space = pool_map_points(dataclasses.replace(sources, space_dir=None), states[1], batch, labels)
    assert model_space.space.startswith("the model's embeddings") and model_space.kind.count("selected") == 6


def test_likely_label_errors_show_with_image_given_label_and_model_answer(photo_rounds, tmp_path):
    _, art, states = photo_rounds
    sid = read_jsonl(art / "rounds/000/selection/selection.jsonl")[0]["sample_id"]
    check = tmp_path / "labelcheck"
    check.mkdir()
    # The label check's issues.jsonl rows (pipeline.labelcheck.report.label_issue_table) and its verdict.
    (check / "issues.jsonl").write_text(json.dumps({
        "rank": 1, "sample_id": sid, "given_label": "rocket", "suggested_label": "coffee", "score": 0.8,
        "given_prob": 0.05, "suggested_prob": 0.85, "threshold": 0.5, "confidence": 0.93, "signals": ["model"],
        "annotators": ["ann-<b>"], "source_file": "x.json", "round": 0, "origin": "label", "entry_id": 1}) + "\n")
    (check / "verdict.json").write_text(json.dumps({"message": "label check: 1 likely label error"}))
    copy = shutil.copytree(art / "rounds/001", tmp_path / "001")  # the round's own report is left alone
    sources = dataclasses.replace(ReportSources.load(copy), round_dir=str(copy), labelcheck_dir=str(check))
    html = build_report(sources, states[1], None).html.read_text()
    section = html[html.index("Likely label errors"):html.index('id="quality"')]
    assert "label check: 1 likely label error" in section and "93 % likely wrong" in section
    assert 'given <b class="bad">rocket</b>' in section and "model <b>coffee</b>" in section
    assert f'title="sample {sid}"' in section
    # Headed by the user's file name (the photo's crop file), not the sample ID.
    assert re.search(r'<b class="name"\s+title="sample ' + sid + r'">(astronaut|coffee|cat|rocket)_\d\d\.(png|jpg)</b>',
                     section)
    assert "ann-&lt;b&gt;" in section and "ann-<b>" not in section  # user data is escaped, never markup


def test_tamis_report_rewrites_the_round_report(photo_rounds):
    from flows.cli.main import app

    config, art, _ = photo_rounds
    page = art / "rounds/001" / REPORT_FILE
    page.write_text("stale")
    res = CliRunner().invoke(app, ["report", "-c", str(config), "--round", "1"])
    assert res.exit_code == 0, res.output
    assert f"report: {page}" in res.output.replace("\n", "") and "kB, built in" in res.output
    assert "Labeling round 1" in page.read_text() and 'alt="confusion matrix"' in page.read_text()
    res = CliRunner().invoke(app, ["report", "-c", str(config), "--round", "7"])
    assert res.exit_code != 0 and "round 7 is not a finished round" in str(res.exception)
    assert "finished: 0, 1" in str(res.exception)


def chromium() -> str:
    """The headless browser, or skip saying why (fail under CI: a check that did not run proves nothing)."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        msg = "chromium is not installed (Debian: `apt-get install chromium`): the report's rendering is unchecked"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg)
        pytest.skip(msg)
    return exe


def screenshot(url: str, out: Path, *, width: int = 1500, height: int = 2400) -> np.ndarray:
    """A headless Chromium screenshot (device scale 1: a thumbnail's CSS pixels are its image pixels) as RGB."""
    cmd = [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--force-device-scale-factor=1", f"--window-size={width},{height}", "--virtual-time-budget=3000",
           f"--user-data-dir={out.parent / 'chromium-profile'}", f"--screenshot={out}", url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.is_file(), f"chromium wrote no screenshot ({proc.returncode}): {proc.stderr[-2000:]}"
    return np.asarray(Image.open(out).convert("RGB"))


def test_the_report_renders_in_headless_chromium_with_the_batch_images(photo_rounds, tmp_path):
    import cv2

    _, art, _ = photo_rounds
    shot = screenshot((art / "rounds/001" / REPORT_FILE).resolve().as_uri(), tmp_path / "report.png")
    assert shot.std() > 20 and len(np.unique(shot.reshape(-1, 3), axis=0)) > 1000  # not blank
    html = _html(art, 1)
    thumbs = re.findall(r'<img class="thumb" src="data:image/[a-z]+;base64,([^"]+)"', html)
    assert len(thumbs) == 6
    for b64 in thumbs:  # each batch image appears on the screen as it is in the file
        thumb = np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))
        # Searched in the page's top (the batch section): the same image further down (a test error) must not count.
        res = cv2.matchTemplate(shot[:700].astype(np.float32), thumb.astype(np.float32), cv2.TM_SQDIFF)
        best = res.min() / thumb.size
        assert best < 4.0, f"a batch thumbnail is not on the screenshot (mean squared difference {best:.1f})"


def test_the_prefect_round_summary_shows_the_contact_sheet_and_the_confusion_matrix(photo_rounds):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    _, art, _ = photo_rounds
    with get_client(sync_client=True) as client:
        summaries = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["round-summary"])),
                                          sort=ArtifactSort.CREATED_DESC)
    md = next(a.data for a in summaries if str(art / "rounds/001") in a.data)
    sheet = (art / "rounds/001/batch.png").read_bytes()
    assert f"![batch contact sheet](data:image/png;base64,{base64.b64encode(sheet).decode()})" in md
    confusion = (art / "rounds/001/confusion.png").read_bytes()
    assert f"![confusion matrix](data:image/png;base64,{base64.b64encode(confusion).decode()})" in md
    assert f"`{art / 'rounds/001' / REPORT_FILE}`" in md and "tamis report --round 1 --open" in md
    # summary.md (the file) stays readable text: no pictures inline.
    assert "data:image" not in (art / "rounds/001/summary.md").read_text()


def test_tamis_report_says_a_deleted_prepared_folder_is_gone_and_how_to_rebuild_it(photo_rounds):
    """Issue 46 #18: with the prepared data folder deleted, `tamis report` said its stage "has not finished here";
    it finished, its output is gone. The message names the path and the command that rebuilds it, which does."""
    from prefect.settings import get_current_settings

    from pipeline.roundreport.sources import SOURCES_FILE

    config, art, _ = photo_rounds
    prepared = Path(ReportSources.load(art / "rounds/001").prepared_dir)
    kept = prepared.with_name(prepared.name + ".kept")
    env = {**os.environ, "PREFECT_API_URL": str(get_current_settings().api.url), "COLUMNS": "300"}
    tamis = str(Path(sys.executable).parent / "tamis")
    prepared.rename(kept)  # the user deletes the prepared data (kept aside so the module's other tests keep theirs)
    try:
        res = subprocess.run([tamis, "report", "-c", str(config), "--round", "1"], capture_output=True, text=True,
                             env=env, timeout=300)
        err = " ".join((res.stdout + res.stderr).split())
        assert res.returncode != 0 and "has not finished here" not in err, err
        assert f"the prepared images (prepare stage): {prepared} is gone" in err
        assert "their stages ran" in err and str(art / "rounds/001" / SOURCES_FILE) in err
        assert "to rebuild the prepared images: `tamis prepare -c <your config>`" in err
        # The fix it names works: prepare writes the same folder again and the report builds.
        prep = subprocess.run([tamis, "prepare", "-c", str(config)], capture_output=True, text=True, env=env,
                              timeout=300)
        assert prep.returncode == 0 and (prepared / "manifest.json").is_file(), prep.stdout + prep.stderr
        again = subprocess.run([tamis, "report", "-c", str(config), "--round", "1"], capture_output=True, text=True,
                               env=env, timeout=300)
        assert again.returncode == 0 and "report:" in again.stdout, again.stdout + again.stderr
    finally:
        if kept.exists():
            if prepared.exists():
                shutil.rmtree(kept)
            else:
                kept.rename(prepared)
