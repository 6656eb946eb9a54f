import json
from collections import Counter

import numpy as np
from PIL import Image

from pipeline.config import parse_config
from pipeline.data.demo import DIGITS_QUESTION, _stratified_test, write_digits
from pipeline.data.ingest import ingest, load_ingested
from pipeline.store import digest_dir


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tiny_slice_is_balanced_split_and_idempotent(tmp_path):
    out = write_digits(tmp_path / "d", limit=60)
    manifest, truth = jsonl(out / "manifest.jsonl"), jsonl(out / "ground_truth.jsonl")
    assert len(manifest) == len(truth) == len(list((out / "images").glob("*.png"))) == 60
    assert Counter(t["answer"] for t in truth) == {str(d): 6 for d in range(10)}
    test = [r for r in manifest if r["split"] == "test"]
    assert all("answer" in r for r in test)
    assert all("answer" not in r and r["split"] == "pool" for r in manifest if r not in test)
    answer_of = {t["image"]: t["answer"] for t in truth}
    assert Counter(answer_of[r["image"]] for r in test) == {str(d): 2 for d in range(10)}
    assert all(r["question"] == DIGITS_QUESTION for r in manifest)
    img = Image.open(out / manifest[0]["image"])
    assert (img.size, img.mode) == ((8, 8), "L") and max(img.getdata()) > 200  # 0..16 scaled to 0..255

    before = digest_dir(out)
    write_digits(tmp_path / "d", limit=60)
    assert digest_dir(out) == before


def test_ground_truth_ids_match_ingestion(tmp_path):
    out = write_digits(tmp_path / "d", limit=30)
    cfg = parse_config({"data": {"sources": [{"kind": "jsonl", "path": str(out / "manifest.jsonl")}],
                                 "answers": [str(d) for d in range(10)]}})
    m = ingest(cfg.data, cfg.artifacts, tmp_path / "ing")
    assert m.info["counts"] == {"read": 30, "ingested": 30, "quarantined": 0, "duplicates": 0}
    ds = load_ingested(tmp_path / "ing")
    truth = {t["sample_id"]: t["answer"] for t in jsonl(out / "ground_truth.jsonl")}
    assert set(ds["sample_id"]) == set(truth)
    for row in ds:
        assert row["answer"] is None if row["split"] == "pool" else row["answer"] == truth[row["sample_id"]]


def test_full_split_is_stratified_and_seeded():
    from sklearn.datasets import load_digits

    target = load_digits().target
    test = _stratified_test(target, 0.25, seed=0)
    assert len(target) == 1797 and abs(test.sum() - 0.25 * len(target)) <= 10
    for d in range(10):
        share = test[target == d].mean()
        assert abs(share - 0.25) < 0.02, (d, share)
    assert np.array_equal(test, _stratified_test(target, 0.25, seed=0))
    assert not np.array_equal(test, _stratified_test(target, 0.25, seed=1))
