"""Selection embeddings (pipeline.embeddings): pixels PCA, the SimCLR pool encoder, the frozen vision tower, embeddings
from a file, and the stage's manifest. Fitting sees the pool split's images only: never an answer, never a test row."""

from __future__ import annotations

import json

import cv2
import numpy as np
import pytest

from pipeline.config import ModelConfig, parse_config
from pipeline.embedders import EMBEDDERS, PixelsEmbedder, PoolEncoderEmbedder, VisionTowerEmbedder
from pipeline.embeddings import (
    compute_selection_embeddings,
    embeddings_key,
    embeddings_spec,
    load_file_embeddings,
    load_selection_embeddings,
    lookup,
)
from pipeline.errors import ConfigError, DataError
from pipeline.model.tiny import VISION
from pipeline.preprocess import encode_png
from pipeline.store import find_valid_manifest, read_manifest

SPLITS = ["pool"] * 24 + ["train"] * 4 + ["test"] * 8
# A few seconds of SimCLR on 24 images of 16 px: enough to test behaviour, not quality.
SMALL_ENCODER = {"dim": 16, "image_size": 16, "epochs": 2, "batch_size": 12}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def digit_images(n: int, side: int = 16, offset: int = 0) -> list[np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits().images[offset:offset + n]
    grey = [np.rint(d * 255 / 16).astype(np.uint8) for d in digits]
    return [np.repeat(cv2.resize(g, (side, side), interpolation=cv2.INTER_CUBIC)[..., None], 3, axis=2) for g in grey]


def prepared_dataset(images=None, answers=None, splits=SPLITS):
    """The prepared-dataset columns the stage may see, with PNG-encoded images; IDs s000…."""
    import datasets

    images = images if images is not None else digit_images(len(splits))
    rows = [{"sample_id": f"s{i:03d}", "image": b"", "image_path": f"/data/digits/images/{i}.png",
             "question": "Which digit is shown in the image?",
             "answer": answers[i] if answers is not None else (None if s == "pool" else str(i % 10)), "split": s,
             "prepared": encode_png(im)} for i, (im, s) in enumerate(zip(images, splits, strict=True))]
    return datasets.Dataset.from_list(rows)


def project(tmp_path, **embeddings):
    return parse_config({"select": {"embeddings": embeddings}, "seed": 0,
                         "paths": {"artifacts": str(tmp_path / "artifacts")}}, root=tmp_path)


def run_stage(tmp_path, ds, name: str, **embeddings) -> np.ndarray:
    compute_selection_embeddings(embeddings_spec(project(tmp_path, **embeddings)), ds, tmp_path / name, inputs={"dataset": "d"})
    ids, x = load_selection_embeddings(tmp_path / name)
    assert ids == list(ds["sample_id"])
    return x


def assert_unit_rows(x: np.ndarray) -> None:
    assert x.dtype == np.float32 and np.isfinite(x).all()
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)


# ------------------------------------------------------------------------------------------------ pixels
def test_pixels_rows_are_unit_norm_and_keep_aspect():
    imgs = digit_images(12)
    emb = PixelsEmbedder(side=8, dim=5).fit(imgs)
    x = emb.embed([*imgs[:3], np.zeros((4, 30, 3), np.uint8) + 200])  # a wide image is padded, not stretched
    assert x.shape == (4, 5)
    assert_unit_rows(x)
    # Whitened: the fit images' projections are uncorrelated with equal variance before normalization.
    z = ((emb.features(imgs) - emb.mean) / emb.std) @ emb.components.T / emb.scale
    np.testing.assert_allclose(np.cov(z.T), np.eye(5), atol=1e-6)
    # Fewer fit images than components: only the components the data has.
    assert PixelsEmbedder(side=8, dim=32).fit(imgs[:4]).embed(imgs).shape == (12, 3)


def test_pixels_are_fitted_on_pool_rows_only(tmp_path):
    base = run_stage(tmp_path, prepared_dataset(), "a", source="pixels", pixels_side=8, pca_dim=6)
    assert base.shape == (len(SPLITS), 6)
    assert_unit_rows(base)
    images = digit_images(len(SPLITS))
    t, p = SPLITS.index("test"), SPLITS.index("pool")
    changed_test = list(images)
    changed_test[t] = 255 - images[t]
    x = run_stage(tmp_path, prepared_dataset(changed_test), "b", source="pixels", pixels_side=8, pca_dim=6)
    others = np.arange(len(SPLITS)) != t
    np.testing.assert_array_equal(x[others], base[others])
    assert not np.allclose(x[t], base[t])
    # Whereas a pool image is fit data: changing it moves everyone.
    changed_pool = list(images)
    changed_pool[p] = 255 - images[p]
    y = run_stage(tmp_path, prepared_dataset(changed_pool), "c", source="pixels", pixels_side=8, pca_dim=6)
    assert not np.allclose(y[others], base[others])


# ------------------------------------------------------------------------------------------------ pool encoder
def test_pool_encoder_is_deterministic_per_seed_and_leaves_torch_rng_alone():
    import torch

    from pipeline.config import PoolEncoderConfig

    imgs = digit_images(24)
    cfg = PoolEncoderConfig(**SMALL_ENCODER)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = PoolEncoderEmbedder(cfg, seed=0).fit(imgs).embed(imgs)
    assert torch.equal(torch.get_rng_state(), state)
    b = PoolEncoderEmbedder(cfg, seed=0).fit(imgs).embed(imgs)
    c = PoolEncoderEmbedder(cfg, seed=1).fit(imgs).embed(imgs)
    assert a.shape == (24, 16)
    assert_unit_rows(a)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


@pytest.mark.parametrize("source", ["pixels", "pool"])
def test_a_saved_fit_embeds_new_images_as_the_fitted_embedder_does(tmp_path, source):
    # What a later round does with images added to the pool: the fit's saved arrays (npz, no pickle) restored into
    # a fresh embedder give the vectors of the embedder that was fitted, for images neither has seen.
    from pipeline.config import PoolEncoderConfig

    fit_imgs, new_imgs = digit_images(24), digit_images(6, offset=100)
    fitted = (PixelsEmbedder(side=8, dim=6) if source == "pixels"
              else PoolEncoderEmbedder(PoolEncoderConfig(**SMALL_ENCODER), seed=0)).fit(fit_imgs)
    np.savez(tmp_path / "state.npz", **fitted.state())
    with np.load(tmp_path / "state.npz", allow_pickle=False) as z:
        fresh = (PixelsEmbedder(side=8, dim=6) if source == "pixels"
                 else PoolEncoderEmbedder(PoolEncoderConfig(**SMALL_ENCODER), seed=1)).load_state(dict(z))
    np.testing.assert_array_equal(fresh.embed(new_imgs), fitted.embed(new_imgs))


def test_pool_encoder_never_reads_answers(tmp_path):
    ds = prepared_dataset()
    base = run_stage(tmp_path, ds, "a", source="pool", encoder=SMALL_ENCODER)
    relabeled = prepared_dataset(answers=[str((i * 7 + 3) % 10) for i in range(len(SPLITS))])
    np.testing.assert_array_equal(run_stage(tmp_path, relabeled, "b", source="pool", encoder=SMALL_ENCODER), base)
    unlabeled = ds.remove_columns(["answer", "question"])
    np.testing.assert_array_equal(run_stage(tmp_path, unlabeled, "c", source="pool", encoder=SMALL_ENCODER), base)
    assert (tmp_path / "a" / "embeddings.npy").read_bytes() == (tmp_path / "c" / "embeddings.npy").read_bytes()


def test_pool_encoder_is_not_fitted_on_test_rows(tmp_path):
    base = run_stage(tmp_path, prepared_dataset(), "a", source="pool", encoder=SMALL_ENCODER)
    images = digit_images(len(SPLITS))
    t = SPLITS.index("test")
    images[t] = 255 - images[t]
    x = run_stage(tmp_path, prepared_dataset(images), "b", source="pool", encoder=SMALL_ENCODER)
    others = np.arange(len(SPLITS)) != t
    np.testing.assert_array_equal(x[others], base[others])
    assert not np.allclose(x[t], base[t])


def test_pool_encoder_fits_on_a_seeded_sample_of_at_most_max_fit_images(tmp_path):
    cfg = project(tmp_path, source="pool", encoder={**SMALL_ENCODER, "max_fit_images": 10})
    m = compute_selection_embeddings(embeddings_spec(cfg), prepared_dataset(), tmp_path / "e", inputs={})
    assert m.info["fit_images"] == 10 and m.info["dim"] == 16 and m.info["source"] == "pool"


# ------------------------------------------------------------------------------------------------ vision tower
@pytest.mark.parametrize("family", ["idefics3", "qwen2_vl", "qwen2_5_vl"])
def test_vision_tower_gives_unit_rows_per_image(tiny_models, family):
    model = ModelConfig(name_or_path=str(tiny_models[family]), family=family, mode="qlora")
    imgs = [np.random.default_rng(i).integers(0, 256, (32, 32, 3), dtype=np.uint8) for i in range(5)]
    emb = VisionTowerEmbedder(model, batch_size=2)
    x = emb.embed(imgs)
    assert x.shape == (5, VISION["hidden_size"])  # the vision encoder's width, not the language model's
    assert_unit_rows(x)
    assert not np.allclose(x[0], x[1])
    # Batch-independent: an image embeds the same alone as in a batch.
    np.testing.assert_allclose(emb.embed(imgs[3:4])[0], x[3], atol=1e-5)


def test_vision_tower_pools_idefics3_tiles_but_not_padding_tiles(tiny_models):
    model = ModelConfig(name_or_path=str(tiny_models["idefics3"]), family="idefics3", mode="qlora")
    rng = np.random.default_rng(0)
    square, tall = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), rng.integers(0, 256, (64, 30, 3), dtype=np.uint8)
    emb = VisionTowerEmbedder(model, batch_size=2)
    # 64 px > the 32-px tile: 4 tiles + the global image for the square one, 2 + 1 for the tall one (padded to 5).
    x = emb.embed([square, tall])
    assert_unit_rows(x)
    np.testing.assert_allclose(emb.embed([tall])[0], x[1], atol=1e-5)


def test_vision_tower_stage_records_the_model(tmp_path, tiny_models):
    cfg = parse_config({"model": {"name_or_path": str(tiny_models["idefics3"]), "family": "idefics3"},
                        "select": {"embeddings": "vision_tower"}}, root=tmp_path)
    m = compute_selection_embeddings(embeddings_spec(cfg), prepared_dataset(images=digit_images(len(SPLITS), side=32)), tmp_path / "v",
                                     inputs={"dataset": "d"})
    assert m.config["model"]["name_or_path"] == str(tiny_models["idefics3"]) and m.info["fit_images"] == 0
    ids, x = load_selection_embeddings(tmp_path / "v")
    assert x.shape[0] == len(SPLITS)
    assert_unit_rows(x)


# ------------------------------------------------------------------------------------------------ file
def write_npy(path, keys, matrix):
    np.save(path, np.asarray(matrix))
    path.with_name(f"{path.stem}.ids.json").write_text(json.dumps(keys), encoding="utf-8")
    return path


def file_cfg(path, **kw):
    from pipeline.config import EmbeddingsConfig

    return EmbeddingsConfig(source="file", path=path, **kw)


def test_file_npy_rows_follow_the_wanted_ids(tmp_path):
    m = np.arange(12, dtype=np.float64).reshape(4, 3)
    path = write_npy(tmp_path / "emb.npy", ["d", "c", "b", "a"], m)
    x = load_file_embeddings(file_cfg(path), ["a", "b", "d"], None)
    assert x.dtype == np.float32
    np.testing.assert_array_equal(x, m[[3, 2, 0]])


def test_file_missing_sample_names_the_file_and_the_sample(tmp_path):
    path = write_npy(tmp_path / "emb.npy", ["a", "b"], np.ones((2, 3)))
    with pytest.raises(DataError) as err:
        load_file_embeddings(file_cfg(path), ["a", "zz1", "b", "zz2"], None)
    msg = str(err.value)
    assert str(path) in msg and "'zz1'" in msg and "2 of 4" in msg


def test_file_bad_rows_and_duplicates_are_named(tmp_path):
    nan = np.ones((3, 2))
    nan[1, 0] = np.nan
    path = write_npy(tmp_path / "nan.npy", ["a", "b", "c"], nan)
    with pytest.raises(DataError, match=r"nan\.npy: row 1 \(key 'b'\) holds NaN"):
        load_file_embeddings(file_cfg(path), ["a"], None)
    path = write_npy(tmp_path / "dup.npy", ["a", "b", "a"], np.ones((3, 2)))
    with pytest.raises(DataError, match=r"dup\.npy: key 'a' appears twice, in rows 0 and 2"):
        load_file_embeddings(file_cfg(path), ["a"], None)
    np.save(tmp_path / "lone.npy", np.ones((2, 2)))
    with pytest.raises(DataError, match=r"lone\.ids\.json"):
        load_file_embeddings(file_cfg(tmp_path / "lone.npy"), ["a"], None)
    path = write_npy(tmp_path / "short.npy", ["a"], np.ones((2, 2)))
    with pytest.raises(DataError, match="2 rows but short.ids.json lists 1 keys"):
        load_file_embeddings(file_cfg(path), ["a"], None)


def test_file_parquet_and_its_wrong_width(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "emb.parquet"
    pq.write_table(pa.table({"id": ["x", "y"], "vec": [[1.0, 2.0], [3.0, 4.0]]}), path)
    cfg = file_cfg(path, parquet_key_column="id", parquet_embedding_column="vec")
    np.testing.assert_array_equal(load_file_embeddings(cfg, ["y", "x"], None), [[3, 4], [1, 2]])
    with pytest.raises(DataError, match=r"column\(s\) \['embedding'\] not found"):
        load_file_embeddings(file_cfg(path, parquet_key_column="id"), ["x"], None)
    pq.write_table(pa.table({"id": ["x", "y", "z"], "vec": [[1.0, 2.0], [3.0], [5.0, 6.0]]}), path)
    with pytest.raises(DataError, match=r"emb\.parquet: row 1 \(key 'y'\) has 1 values; most rows have 2"):
        load_file_embeddings(cfg, ["x"], None)


def test_file_keys_by_image_path_match_relative_paths(tmp_path):
    path = write_npy(tmp_path / "emb.npy", ["images/1.png", "./images/0.png", "/abs/other/2.png"],
                     np.eye(3))
    cfg = file_cfg(path, key="image")
    images = ["/data/digits/images/0.png", "/data/digits/images/1.png", "/abs/other/2.png"]
    np.testing.assert_array_equal(load_file_embeddings(cfg, ["s0", "s1", "s2"], images), np.eye(3)[[1, 0, 2]])
    with pytest.raises(DataError, match=r"no embedding for sample 's3' \(image '/data/digits/images/3.png'\)"):
        load_file_embeddings(cfg, ["s0", "s3"], [images[0], "/data/digits/images/3.png"])
    with pytest.raises(DataError, match="matches two images"):
        load_file_embeddings(cfg, ["s0", "s9"], [images[0], "/elsewhere/images/0.png"])


def test_file_stage_keys_on_the_file_contents(tmp_path):
    ds = prepared_dataset()
    ids = list(ds["sample_id"])
    path = write_npy(tmp_path / "emb.npy", ids[::-1], np.random.default_rng(0).normal(size=(len(ids), 4)))
    cfg = project(tmp_path, source="file", path=str(path))
    inputs = {"dataset": "d"}
    m = compute_selection_embeddings(embeddings_spec(cfg), ds, tmp_path / "f", inputs=inputs)
    assert m.info["fit_images"] == 0 and m.info["dim"] == 4
    key = embeddings_key(embeddings_spec(cfg), inputs)
    assert find_valid_manifest(tmp_path / "f", key) is not None
    write_npy(path, ids, np.zeros((len(ids), 4)))
    assert embeddings_key(embeddings_spec(cfg), inputs) != key
    # Keyed by the image paths as the manifest gave them (relative to it): matched to the ingested absolute paths.
    by_image = write_npy(tmp_path / "by_image.npy", [f"images/{i}.png" for i in range(len(ids))], np.eye(len(ids)))
    x = run_stage(tmp_path, ds, "g", source="file", path=str(by_image), key="image")
    np.testing.assert_array_equal(x, np.eye(len(ids)))


# ------------------------------------------------------------------------------------------------ stage
def test_stage_manifest_verifies_and_is_reused_by_key(tmp_path):
    ds = prepared_dataset()
    cfg = project(tmp_path, source="pixels", pixels_side=8, pca_dim=4)
    inputs = {"dataset": "digest-1"}
    m = compute_selection_embeddings(embeddings_spec(cfg), ds, tmp_path / "e", inputs=inputs)
    assert read_manifest(tmp_path / "e").key == m.key == embeddings_key(embeddings_spec(cfg), inputs)
    assert m.stage == "embeddings" and m.config["embeddings"]["source"] == "pixels" and m.config["seed"] == 0
    assert m.info["fit_images"] == SPLITS.count("pool") and m.info["dim"] == 4 and "model" not in m.config
    assert find_valid_manifest(tmp_path / "e", embeddings_key(embeddings_spec(cfg), inputs)) is not None
    assert find_valid_manifest(tmp_path / "e", embeddings_key(embeddings_spec(cfg), {"dataset": "digest-2"})) is None
    other = project(tmp_path, source="pixels", pixels_side=8, pca_dim=5)
    assert find_valid_manifest(tmp_path / "e", embeddings_key(embeddings_spec(other), inputs)) is None
    ids, x = load_selection_embeddings(tmp_path / "e")
    np.testing.assert_array_equal(lookup(ids, x, ["s005", "s001"]), x[[5, 1]])
    with pytest.raises(DataError, match=r"sample 'nope' has no selection embedding \(1 of 2 missing\)"):
        lookup(ids, x, ["s001", "nope"])
    # A tampered output no longer verifies, so it is never reused.
    (tmp_path / "e" / "embeddings.npy").write_bytes(b"garbage")
    assert find_valid_manifest(tmp_path / "e", embeddings_key(embeddings_spec(cfg), inputs)) is None


def test_stage_refuses_model_source_and_an_empty_pool(tmp_path):
    assert set(EMBEDDERS) == {"pixels", "pool", "vision_tower"}
    with pytest.raises(ConfigError, match="scoring pass"):
        compute_selection_embeddings(embeddings_spec(project(tmp_path, source="model")), prepared_dataset(), tmp_path / "m", inputs={})
    with pytest.raises(DataError, match="no rows with split 'pool'"):
        compute_selection_embeddings(embeddings_spec(project(tmp_path, source="pixels")), prepared_dataset(splits=["test"] * len(SPLITS)),
                                     tmp_path / "p", inputs={})
