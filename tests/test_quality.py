import io

import cv2
import numpy as np
import pytest
from PIL import Image

from pipeline.config import PreprocessConfig, QualityConfig
from pipeline.preprocess import load_prepared, preprocess_dataset
from pipeline.quality import (
    assess_quality,
    blur_score,
    dhash64,
    excluded_ids,
    load_quality,
    near_duplicate_twins,
    quality_report,
)
from pipeline.store import read_manifest


def textured(seed: int, size: int = 64) -> np.ndarray:
    """Random blocks: sharp edges everywhere, and unrelated images get unrelated hashes."""
    rng = np.random.default_rng(seed)
    return cv2.resize(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8), (size, size), interpolation=cv2.INTER_NEAREST)


def bmp(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "BMP")
    return buf.getvalue()


@pytest.fixture
def scored(tmp_path, image_dataset):
    base = textured(1)
    images = [
        Image.fromarray(base),                                             # 0 original
        bmp(base),                                                         # 1 same pixels, other file → exact dup of 0
        Image.fromarray(np.clip(base.astype(int) + 6, 0, 255).astype(np.uint8)),  # 2 brighter → near dup of 0
        Image.fromarray(cv2.GaussianBlur(textured(2), (0, 0), 6)),         # 3 blurry
        Image.new("RGB", (50, 30), (90, 90, 90)),                          # 4 flat → low information
        Image.fromarray(textured(3)),                                      # 5 clean
        Image.fromarray(base),                                             # 6 same image, other question → clean
    ]
    questions = ["q"] * 6 + ["another question"]
    ds = image_dataset(images, questions=questions)
    preprocess_dataset(ds, PreprocessConfig(pad="square", pad_color=(255, 255, 255)), tmp_path / "prep", size=32,
                       max_pixels=10**8)
    prepared = load_prepared(tmp_path / "prep")
    cfg = QualityConfig(blur_threshold=50.0, low_information_std=2.0, near_duplicate_distance=4,
                        exclude=["exact_duplicate", "low_information"])
    m = assess_quality(prepared, cfg, tmp_path / "quality")
    return prepared, m, tmp_path / "quality"


def test_flags_and_reasons(scored):
    ds, m, qdir = scored
    table = load_quality(qdir)
    assert [r["sample_id"] for r in table] == ds["sample_id"][:]  # nothing deleted, same order
    flags = [r["flags"] for r in table]
    ids = ds["sample_id"][:]
    assert flags[0] == [] and flags[5] == [] and flags[6] == []
    assert flags[1] == ["exact_duplicate"] and table[1]["duplicate_of"] == ids[0]
    assert flags[2] == ["near_duplicate"] and table[2]["duplicate_of"] == ids[0]
    assert "hash distance" in table[2]["reasons"][0]
    assert flags[3] == ["blurry"] and "< quality.blur_threshold 50.0" in table[3]["reasons"][0]
    # Flat image with white padding: the padding is ignored, so it stays flat (and so also has no edges).
    assert set(flags[4]) == {"low_information", "blurry"}
    assert [r["excluded"] for r in table] == [False, True, False, False, True, False, False]
    assert excluded_ids(qdir) == {ids[1], ids[4]}
    assert m.info["counts"] == {"blurry": 2, "exact_duplicate": 1, "near_duplicate": 1, "low_information": 1}
    assert read_manifest(qdir).outputs["table"].path == "quality.jsonl"


def test_blur_score_orders_sharp_above_blurred():
    grey = cv2.cvtColor(textured(4), cv2.COLOR_RGB2GRAY)
    scores = [blur_score(cv2.GaussianBlur(grey, (0, 0), s)) if s else blur_score(grey) for s in (0, 1, 3)]
    assert scores[0] > scores[1] > scores[2]


def test_near_duplicates_group_keeps_first_and_scales_to_many_identical_hashes():
    grey = cv2.cvtColor(textured(5), cv2.COLOR_RGB2GRAY)
    code = dhash64(grey)
    other = dhash64(cv2.cvtColor(textured(6), cv2.COLOR_RGB2GRAY))
    assert bin(int(code.tobytes().hex(), 16) ^ int(other.tobytes().hex(), 16)).count("1") > 8
    n = 3000  # all identical: collapsed before the search, so this stays fast
    codes = np.stack([code] * n + [other])
    twins = near_duplicate_twins(codes, ["q"] * (n + 1), 4)
    assert 0 not in twins and n not in twins
    assert all(twins[i] == (0, 0) for i in range(1, n))
    one_bit = code.copy()
    one_bit[0] ^= 1
    assert near_duplicate_twins(np.stack([code, one_bit]), ["q", "q"], 0) == {}
    assert near_duplicate_twins(np.stack([code, one_bit]), ["q", "q"], 1) == {1: (0, 1)}


def test_exclude_follows_config(scored, tmp_path):
    ds, _, _ = scored
    m = assess_quality(ds, QualityConfig(blur_threshold=50.0, exclude=["blurry", "near_duplicate"]), tmp_path / "q2")
    table = load_quality(tmp_path / "q2")
    assert [r["excluded"] for r in table] == [False, False, True, True, True, False, False]
    assert m.info["excluded"] == 3


def test_quality_report(scored):
    ds, _, qdir = scored
    rep = quality_report(qdir, ds, top=1)
    assert rep["rows"] == 7 and rep["excluded"] == 2
    assert rep["counts"]["blurry"] == 2
    assert len(rep["worst"]["blurry"]) == 1
    worst = rep["worst"]["blurry"][0]
    assert worst["sample_id"] == ds[4]["sample_id"]  # the flat image has the lowest blur score
    assert worst["image_path"] == "/data/img4.png" and "pixel std" in worst["reason"]
    assert rep["worst"]["exact_duplicate"][0]["duplicate_of"] == ds[0]["sample_id"]


@pytest.mark.parametrize("distance", [0, 3, 4, 6, 9])
def test_near_duplicate_twins_match_brute_force_and_judge_only_rows_from_start(distance):
    # Clusters of codes a few bits apart, two questions: multi-index hashing (distance ≤ 4) and the flat scan
    # (above) must both give each row its earliest earlier twin of the same question, as comparing every pair does.
    rng = np.random.default_rng(distance)
    centres = rng.integers(0, 256, (60, 8), dtype=np.uint8)
    bits = np.unpackbits(centres[rng.integers(0, 60, 1500)], axis=1)
    codes = np.packbits(bits ^ (rng.random(bits.shape) < 0.04), axis=1)
    questions = [str(q) for q in rng.integers(0, 2, len(codes))]
    pair = np.unpackbits(codes[:, None, :] ^ codes[None, :, :], axis=2).sum(2)
    expected = {}
    for i in range(len(codes)):
        near = [j for j in range(i) if pair[i, j] <= distance and questions[j] == questions[i]]
        if near:
            expected[i] = (near[0], int(pair[i, near[0]]))
    assert len(expected) > 40  # exact copies at distance 0, hundreds of twins above
    assert near_duplicate_twins(codes, questions, distance) == expected
    assert near_duplicate_twins(codes, questions, distance, start=1000) == {i: t for i, t in expected.items()
                                                                          if i >= 1000}


def test_flags_explain_themselves_and_a_flag_on_most_of_the_pool_is_its_norm(scored):
    from pipeline.quality import explain_flags

    _, m, _ = scored
    cfg = QualityConfig(blur_threshold=50.0, low_information_std=2.0, near_duplicate_distance=4,
                        exclude=["exact_duplicate", "low_information"])
    assert m.info["medians"]["blur_score"] > 50  # the pool's own median, beside the absolute threshold
    lines = {line.split(":")[0]: line for line in explain_flags(m.info, cfg)}
    assert set(lines) == {"blurry", "exact_duplicate", "near_duplicate", "low_information"}
    assert lines["blurry"].startswith("blurry: 2 of 7 samples (29%); measures soft edges")
    assert "threshold: blur score < quality.blur_threshold 50" in lines["blurry"]
    assert "does not keep them out of the pool" in lines["blurry"] and "norm" not in lines["blurry"]
    assert "keeps them out of the pool (quality.exclude)" in lines["low_information"]
    # A threshold every image misses: reported as what the pool is like, with its median and why it is absolute.
    strict = cfg.model_copy(update={"blur_threshold": 10.0**9})
    info = {**m.info, "counts": {**m.info["counts"], "blurry": 7}}
    norm = next(x for x in explain_flags(info, strict) if x.startswith("blurry"))
    assert "On 100% of the samples this is the pool's norm, not a defect of each image" in norm
    assert f"the pool's median blur score is {m.info['medians']['blur_score']:g}" in norm
    assert "the threshold is absolute" in norm and "lower the threshold or preprocess.size" in norm
