import json
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from PIL import Image

from pipeline import augment as aug_mod
from pipeline.augment import (
    augment_labeled,
    augment_text,
    augmented_id,
    build_image_pipeline,
    build_text_augmenters,
    load_augmented,
    wordnet_available,
)
from pipeline.config import AugmentConfig, ImageAugmentConfig, PreprocessConfig, TextAugmentConfig
from pipeline.preprocess import decode_prepared, load_prepared, preprocess_dataset
from pipeline.store import digest_dir

QUESTION = "Which digit is shown in the picture of the small house?"
STRONG_IMAGE = ImageAugmentConfig(brightness_contrast_p=1.0, affine_p=1.0, blur_p=0.5, noise_p=0.5)
STRONG_TEXT = TextAugmentConfig(keyboard_p=0.5, ocr_p=0.5, random_char_p=0.5, word_swap_p=0.5, word_delete_p=0.3)


@pytest.fixture
def prepared(tmp_path, image_dataset):
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)) for _ in range(7)]
    answers = ["3", "7", "1", None, None, "5", ""]  # rows 3, 4 and 6 are unlabeled pool rows
    splits = ["train", "train", "train", "pool", "pool", "test", "pool"]
    ds = image_dataset(images, answers=answers, splits=splits, questions=[QUESTION] * 7)
    preprocess_dataset(ds, PreprocessConfig(), tmp_path / "prep", size=32, max_pixels=10**8)
    return load_prepared(tmp_path / "prep"), tmp_path / "prep"


def test_image_pipeline_seeded_per_call():
    img = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    a, b = build_image_pipeline(STRONG_IMAGE, 0), build_image_pipeline(STRONG_IMAGE, 99)
    a.set_random_seed(5)
    first = a(image=img)["image"]
    assert first.shape == img.shape and first.dtype == np.uint8
    assert not np.array_equal(first, a(image=img)["image"])  # the stream moves on
    b.set_random_seed(5)
    np.testing.assert_array_equal(first, b(image=img)["image"])  # the row seed alone decides


def test_text_augmenters_seeded_and_restore_global_random():
    import random

    augs = build_text_augmenters(STRONG_TEXT)
    assert [n for n, _, _ in augs] == ["keyboard", "ocr", "random_char", "word_swap", "word_delete"]
    random.seed(42)
    expected_next = random.random()
    random.seed(42)
    outs = [augment_text(QUESTION, augs, s) for s in range(6)]
    assert random.random() == expected_next  # nlpaug's draws did not disturb the caller's stream
    assert outs == [augment_text(QUESTION, augs, s) for s in range(6)]
    assert len(set(outs)) > 3 and any(o != QUESTION for o in outs)
    assert build_text_augmenters(TextAugmentConfig()) == []
    assert augment_text(QUESTION, [], 1) == QUESTION


def test_augments_only_labeled_rows_and_leaves_prepared_untouched(prepared, tmp_path):
    ds, prep_dir = prepared
    before = digest_dir(prep_dir)
    cfg = AugmentConfig(copies=2, image=STRONG_IMAGE, text=STRONG_TEXT)
    m = augment_labeled(ds, cfg, 0, tmp_path / "aug")
    out = load_augmented(tmp_path / "aug")
    assert digest_dir(prep_dir) == before

    src = {r["sample_id"]: r for r in ds}
    labeled = [r["sample_id"] for r in ds if r["answer"] and r["split"] != "test"]
    assert len(labeled) == 3 and m.info["labeled_rows"] == 3
    assert len(out) == 6 and m.info["rows"] == 6
    assert set(out["augmented_from"][:]) == set(labeled)
    assert sorted(out["sample_id"][:]) == sorted(augmented_id(s, k) for s in labeled for k in range(2))
    changed_text = 0
    for row in out:
        orig = src[row["augmented_from"]]
        assert row["answer"] == orig["answer"] and row["split"] == orig["split"] == "train"
        assert row["image"] == orig["image"]
        img = decode_prepared(row["prepared"])
        assert img.shape == decode_prepared(orig["prepared"]).shape
        assert row["prepared"] != orig["prepared"]
        changed_text += row["question"] != orig["question"]
    assert changed_text > 0


def _run(ds, tmp_path, name, seed, num_proc=1):
    cfg = AugmentConfig(copies=2, image=STRONG_IMAGE, text=STRONG_TEXT, num_proc=num_proc)
    augment_labeled(ds, cfg, seed, tmp_path / name)
    out = load_augmented(tmp_path / name).sort("sample_id")
    return out["prepared"][:], out["question"][:]


def test_same_seed_same_output_across_processes_different_seed_differs(prepared, tmp_path):
    ds, _ = prepared
    one = _run(ds, tmp_path, "a", seed=7)
    two = _run(ds, tmp_path, "b", seed=7, num_proc=2)
    assert one == two
    other = _run(ds, tmp_path, "c", seed=8)
    assert other[0] != one[0]
    assert other[1] != one[1]


def test_same_output_in_a_process_with_another_hash_seed():
    # Fork-based num_proc shares the parent's hash seed; a fresh interpreter with another one must agree too.
    code = textwrap.dedent(f"""
        import json, numpy as np
        from pipeline.augment import augment_text, build_image_pipeline, build_text_augmenters
        from pipeline.config import ImageAugmentConfig, TextAugmentConfig
        img = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)
        pipe = build_image_pipeline(ImageAugmentConfig(**{STRONG_IMAGE.model_dump()!r}), 0)
        texts = build_text_augmenters(TextAugmentConfig(**{STRONG_TEXT.model_dump()!r}))
        out = []
        for s in range(4):
            pipe.set_random_seed(s)
            out.append([int(pipe(image=img)["image"].astype(np.int64).sum()), augment_text({QUESTION!r}, texts, s)])
        print(json.dumps(out))
    """)
    env = {**os.environ, "PYTHONHASHSEED": "12345", "NO_ALBUMENTATIONS_UPDATE": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    theirs = json.loads(res.stdout.strip().splitlines()[-1])
    img = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    pipe, texts = build_image_pipeline(STRONG_IMAGE, 0), build_text_augmenters(STRONG_TEXT)
    ours = []
    for s in range(4):
        pipe.set_random_seed(s)
        ours.append([int(pipe(image=img)["image"].astype(np.int64).sum()), augment_text(QUESTION, texts, s)])
    assert ours == theirs


def test_zero_copies_gives_empty_dataset_with_schema(prepared, tmp_path):
    ds, _ = prepared
    m = augment_labeled(ds, AugmentConfig(copies=0), 0, tmp_path / "aug")
    out = load_augmented(tmp_path / "aug")
    assert len(out) == 0 and m.info["rows"] == 0
    assert set(out.column_names) == set(ds.column_names) | {"augmented_from"}


def test_missing_wordnet_is_a_clear_warning_not_a_crash(prepared, tmp_path, monkeypatch, caplog):
    ds, _ = prepared
    monkeypatch.setattr(aug_mod, "_find_wordnet", lambda: None)
    with caplog.at_level(logging.WARNING, logger="pipeline.augment"):
        augs = build_text_augmenters(TextAugmentConfig(synonym_p=1.0, ocr_p=0.5))
        m = augment_labeled(ds, AugmentConfig(copies=1, text=TextAugmentConfig(synonym_p=1.0)), 0, tmp_path / "aug")
    assert [n for n, _, _ in augs] == ["ocr"]
    assert "apt-get install wordnet-base" in caplog.text and "nltk.downloader wordnet" in caplog.text
    assert m.info["skipped_text_augmenters"] == ["synonym"] and m.info["rows"] == 3


@pytest.mark.skipif(not wordnet_available(), reason="nltk + WordNet data not installed (optional)")
def test_synonyms_from_local_wordnet():
    augs = build_text_augmenters(TextAugmentConfig(synonym_p=1.0))
    outs = {augment_text(QUESTION, augs, s) for s in range(5)}
    assert len(outs) > 1 and all(o.endswith("?") for o in outs)
