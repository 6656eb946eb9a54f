"""Selection embeddings: the space diversity, coverage and outlier selection work in, independent of the adapter.

Every source but `file` is an `Embedder`: fitted on the pool split's images only (never an answer, never a test or
train image), then used to embed every row. `pixels` is downsampled pixels → standardized → whitened PCA; `pool` a
small SimCLR encoder trained on the pool; `vision_tower` the frozen vision encoder of the configured base model (no
fitting). `file` embeddings are read, not fitted. Rows come out float32 [n, d], L2-normalized (file: as given).

`compute_selection_embeddings` is the stage: embeddings.npy + ids.json + manifest, keyed by `embeddings_key`; on a
pool made of shards, `compute_sharded_embeddings` keeps the fit and embeds each shard once. The embedders themselves
are in pipeline.embedders.
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.codeversion import stage_version
from pipeline.config import EmbeddingsConfig, ModelConfig, ProjectConfig
from pipeline.data.shards import dataset_shards
from pipeline.embedders import EmbeddingsSpec, make_embedder
from pipeline.errors import ArtifactError, ConfigError, DataError
from pipeline.idindex import IdIndex
from pipeline.preprocess import decode_prepared
from pipeline.several_images import sample_embedding
from pipeline.stage_ref import StageRef
from pipeline.store import (
    Manifest,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_stream,
    column,
    digest_file,
    digest_json,
    find_valid_manifest,
    read_manifest,
    reuse_or_compute,
    stage_dataset,
    stage_key,
    write_manifest,
)

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

STAGE = "embeddings"
# Bump when the vectors change for the same inputs and config.
EMBEDDINGS_VERSION = stage_version("1", "pipeline.embeddings")
EMBEDDINGS_FILE = "embeddings.npy"
IDS_FILE = "ids.json"
CHUNK = 256  # rows decoded at a time: prepared images can be large, so the pool is never decoded all at once


# ------------------------------------------------------------------------------------------------ file
def _read_npy(path: Path) -> tuple[list[Any], np.ndarray]:
    sidecar = path.with_name(f"{path.stem}.ids.json")
    if not sidecar.is_file():
        raise DataError(f"{path}: a .npy of embeddings needs its keys beside it in {sidecar.name} (a JSON list, one "
                        "key per row); it is missing")
    try:
        matrix = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise DataError(f"{path}: not a readable .npy array of numbers ({exc})") from None
    try:
        keys = json.loads(sidecar.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{sidecar}: not valid JSON ({exc})") from None
    if not isinstance(keys, list):
        raise DataError(f"{sidecar}: must be a JSON list of keys in row order, not {type(keys).__name__}")
    if matrix.ndim != 2 or not np.issubdtype(matrix.dtype, np.number):
        raise DataError(f"{path}: expected a 2-D numeric array [rows, dim]; got shape {matrix.shape}, dtype "
                        f"{matrix.dtype}")
    if len(keys) != len(matrix):
        raise DataError(f"{path}: {len(matrix)} rows but {sidecar.name} lists {len(keys)} keys; one key per row")
    return keys, matrix


def _read_parquet(path: Path, cfg: EmbeddingsConfig) -> tuple[list[Any], np.ndarray]:
    import pyarrow.parquet as pq

    key_col, emb_col = cfg.parquet_key_column, cfg.parquet_embedding_column
    try:
        names = pq.read_schema(path).names
        missing = [c for c in (key_col, emb_col) if c not in names]
        if missing:
            raise DataError(f"{path}: column(s) {missing} not found (columns: {names}); set "
                            "select.embeddings.parquet_key_column / parquet_embedding_column")
        table = pq.read_table(path, columns=[key_col, emb_col])
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - any pyarrow failure is the same user-facing fault
        raise DataError(f"{path}: not a readable Parquet file ({exc.__class__.__name__}: {exc})") from None
    keys = table.column(key_col).to_pylist()
    vectors = table.column(emb_col).to_pylist()
    widths = {len(v) for v in vectors if v is not None}
    width = max(widths, key=lambda w: sum(len(v) == w for v in vectors if v is not None)) if widths else 0
    for i, v in enumerate(vectors):
        if v is None or len(v) != width:
            got = "no embedding" if v is None else f"{len(v)} values"
            raise DataError(f"{path}: row {i} (key {keys[i]!r}) has {got}; most rows have {width}")
    try:
        matrix = np.asarray(vectors, dtype=np.float64).reshape(len(vectors), width)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{path}: column {emb_col!r} must hold lists of numbers ({exc})") from None
    return keys, matrix


def _path_key(key: str) -> str:
    """An image path normalized for comparison: forward slashes, no '.' parts, no leading './'."""
    return PurePosixPath(os.path.normpath(str(key).replace("\\", "/"))).as_posix()


def _match_images(keys: list[str], images: list[str], path: Path) -> tuple[list[int | None], str | None]:
    """File row per sample for image-path keys: exact, then normalized, then the longest trailing-path match
    (a manifest-relative "images/3.png" matches the ingested absolute ".../digits/images/3.png")."""
    by_norm: dict[str, int] = {}
    for r, k in enumerate(keys):
        by_norm.setdefault(_path_key(k), r)
    exact = {k: r for r, k in enumerate(keys)}
    rows: list[int | None] = []
    suffix_users: dict[int, int] = {}
    for i, image in enumerate(images):
        if image in exact:
            rows.append(exact[image])
            continue
        parts = PurePosixPath(_path_key(image)).parts if image else ()
        found, trailing = None, False
        for j in range(len(parts)):
            cand = PurePosixPath(*parts[j:]).as_posix()
            if cand in by_norm:
                found, trailing = by_norm[cand], j > 0
                break
        if found is not None and trailing:
            if found in suffix_users and images[suffix_users[found]] != image:
                other = images[suffix_users[found]]
                return rows, (f"{path}: key {keys[found]!r} (row {found}) matches two images, {other!r} and "
                              f"{image!r}; give full image paths as keys")
            suffix_users[found] = i
        rows.append(found)
    return rows, None


def load_file_embeddings(cfg: EmbeddingsConfig, ids: list[str], images: list[str] | None) -> np.ndarray:
    """Embeddings brought in a file, one row per `ids` entry (float32, as given: not normalized).

    `cfg.key` says what the file's keys are: sample IDs, or image paths (matched against `images`, the samples'
    image paths, as given and by normalized trailing path).
    """
    if cfg.path is None:
        raise ConfigError("select.embeddings.path: is required with source 'file'")
    path = Path(cfg.path)
    if not path.is_file():
        raise DataError(f"{path}: embeddings file not found; fix select.embeddings.path")
    suffix = path.suffix.lower()
    if suffix == ".npy":
        keys, matrix = _read_npy(path)
    elif suffix in (".parquet", ".pq"):
        keys, matrix = _read_parquet(path, cfg)
    else:
        raise DataError(f"{path}: embeddings must be a .npy (with a {path.stem}.ids.json sidecar) or a .parquet file")
    if len(matrix) == 0 or matrix.shape[1] == 0:
        raise DataError(f"{path}: holds no embeddings (shape {matrix.shape})")
    keys = [str(k) for k in keys]
    seen: dict[str, int] = {}
    for r, k in enumerate(keys):
        if k in seen:
            raise DataError(f"{path}: key {k!r} appears twice, in rows {seen[k]} and {r}; keep one row per key")
        seen[k] = r
    bad = ~np.isfinite(matrix).all(axis=1)
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        raise DataError(f"{path}: row {r} (key {keys[r]!r}) holds NaN or infinite values ({int(bad.sum())} such "
                        "rows); fix or drop them")
    if cfg.key == "sample_id":
        rows: list[int | None] = [seen.get(s) for s in ids]
    else:
        if images is None or len(images) != len(ids):
            raise DataError(f"{path}: select.embeddings.key is 'image' but the samples' image paths are not known; "
                            "use sample_id keys")
        rows, ambiguous = _match_images(keys, images, path)
        if ambiguous:
            raise DataError(ambiguous)
    missing = [i for i, r in enumerate(rows) if r is None]
    if missing:
        i = missing[0]
        what = f"sample {ids[i]!r}" + (f" (image {images[i]!r})" if cfg.key == "image" and images else "")
        raise DataError(f"{path}: no embedding for {what}; {len(missing)} of {len(ids)} samples are missing (keys "
                        f"are {cfg.key}s); add rows for them")
    return matrix[np.asarray(rows, dtype=np.int64)].astype(np.float32)


# ------------------------------------------------------------------------------------------------ stage
def embeddings_spec(cfg: ProjectConfig) -> EmbeddingsSpec:
    """A project's EmbeddingsSpec (the sections the embeddings code reads), for callers that hold a whole config."""
    return EmbeddingsSpec.of(cfg.select, seed=cfg.seed, model=cfg.model, artifacts=cfg.artifacts)


def file_inputs(emb: EmbeddingsConfig) -> dict[str, str]:
    """Digests of a file source's embeddings (and ids sidecar): part of every cache key that depends on them."""
    e = emb
    if e.source != "file" or e.path is None:
        return {}
    path = Path(e.path)
    found = {"embeddings_file": digest_file(path)} if path.is_file() else {}
    sidecar = path.with_name(f"{path.stem}.ids.json")
    if path.suffix.lower() == ".npy" and sidecar.is_file():
        found["embeddings_ids"] = digest_file(sidecar)
    return found


def _stage_config(spec: EmbeddingsSpec) -> dict[str, Any]:
    config: dict[str, Any] = {"embeddings": spec.embeddings.model_dump(mode="json"), "seed": spec.seed}
    if spec.embeddings.source == "vision_tower":
        config["model"] = spec.model.model_dump(mode="json") if spec.model is not None else None
    return config


def embeddings_key(spec: EmbeddingsSpec, inputs: dict[str, str]) -> str:
    """Cache key of `compute_selection_embeddings` for these inputs (a file source's contents included)."""
    return stage_key(STAGE, EMBEDDINGS_VERSION, {**inputs, **file_inputs(spec.embeddings)}, _stage_config(spec))


def _images(table: datasets.Dataset, rows: Sequence[int] | None = None) -> Iterator[np.ndarray]:
    """Decoded prepared images of `rows` (all rows when None), CHUNK rows read at a time."""
    n = len(table) if rows is None else len(rows)
    for start in range(0, n, CHUNK):
        if rows is None:
            batch = table[start:start + CHUNK]["prepared"]
        else:
            batch = table.select(rows[start:start + CHUNK])["prepared"]
        yield from (decode_prepared(png) for png in batch)


def _fit_rows(spec: EmbeddingsSpec, embedder: Any, splits: Sequence[str]) -> list[int]:
    """Rows the embedder is fitted on: the pool split's, a seeded sample of them above its max_fit_images; none for
    an embedder with nothing to fit."""
    if not embedder.needs_fit:
        return []
    pool = [i for i, s in enumerate(splits) if s == "pool"]
    if not pool:
        raise DataError(f"no rows with split 'pool' to fit the {spec.embeddings.source} embeddings on; the "
                        "pool is empty")
    cap = embedder.max_fit_images
    if cap is None or len(pool) <= cap:
        return pool
    log.info("embeddings: fitting on a seeded sample of %d of %d pool images", cap, len(pool))
    pick = np.random.default_rng(spec.seed).choice(len(pool), cap, replace=False)
    return [pool[i] for i in np.sort(pick)]


def _embed(embedder: Any, table: datasets.Dataset) -> np.ndarray:
    """Every row of `table` embedded, CHUNK images decoded at a time: float32 [rows, d]. A project whose samples
    have several pictures (`more_prepared`): `_embed_samples`."""
    if "more_prepared" in table.column_names:
        return _embed_samples(embedder, table)
    chunks, batch = [], []
    for img in _images(table):
        batch.append(img)
        if len(batch) == CHUNK:
            chunks.append(embedder.embed(batch))
            batch = []
    if batch:
        chunks.append(embedder.embed(batch))
    return np.ascontiguousarray(np.concatenate(chunks) if chunks else np.zeros((0, 0), np.float32), np.float32)


def _embed_samples(embedder: Any, table: datasets.Dataset) -> np.ndarray:
    """[rows, d]: every picture of a sample embedded, the sample's vector the normalised mean of its pictures'
    (pipeline/several_images.py `sample_embedding`: each picture weighs the same; a one-picture sample's vector is
    its picture's, normalised, which cosine distances do not tell apart). The embedder is fitted on first pictures."""
    out: list[np.ndarray] = []
    for start in range(0, len(table), CHUNK):
        batch = table[start:start + CHUNK]
        pics = [[decode_prepared(p), *(decode_prepared(m) for m in more or [])]
                for p, more in zip(batch["prepared"], batch["more_prepared"], strict=True)]
        flat = embedder.embed([im for row in pics for im in row])
        at = np.cumsum([0, *(len(row) for row in pics)])
        out += [sample_embedding(list(flat[a:b])) for a, b in zip(at[:-1], at[1:], strict=True)]
    return np.ascontiguousarray(np.stack(out) if out else np.zeros((0, 0), np.float32), np.float32)


def compute_selection_embeddings(
    spec: EmbeddingsSpec, prepared: datasets.Dataset, out_dir: str | os.PathLike[str], *, inputs: dict[str, str],
) -> Manifest:
    """Fit the configured embedder on the pool split's images, embed every row; write embeddings.npy (float32
    [rows, d], dataset order), ids.json (sample IDs) and the manifest into `out_dir`.

    Reads only sample_id, split and prepared (image_path for file embeddings keyed by image): never an answer.
    """
    e = spec.embeddings
    if e.source == "model":
        raise ConfigError("select.embeddings.source is 'model': those embeddings come from the scoring pass of the "
                          "current model; compute_selection_embeddings handles pool, pixels, vision_tower and file")
    need = {"sample_id", "split", "image_path" if e.source == "file" else "prepared"}
    if e.source == "file" and e.key == "sample_id":
        need.discard("image_path")
    missing = need - set(prepared.column_names)
    if missing:
        raise DataError(f"the prepared dataset lacks column(s) {sorted(missing)}; pass the prepare stage's dataset")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    more = ["more_prepared"] if e.source != "file" and "more_prepared" in prepared.column_names else []
    table = prepared.select_columns(sorted(need) + more)
    ids = [str(s) for s in column(table, "sample_id")]
    if len(set(ids)) != len(ids):
        raise DataError("the prepared dataset repeats a sample_id; rebuild it with ingest (which de-duplicates)")
    t0 = time.perf_counter()
    fit_rows: list[int] = []
    if e.source == "file":
        images = [str(x) for x in column(table, "image_path")] if "image_path" in need else None
        vectors = load_file_embeddings(e, ids, images)
    else:
        embedder = make_embedder(spec)
        fit_rows = _fit_rows(spec, embedder, column(table, "split"))
        if fit_rows:
            embedder.fit(_images(table, fit_rows))
        vectors = _embed(embedder, table)
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    seconds = round(time.perf_counter() - t0, 3)
    buf = io.BytesIO()
    np.save(buf, vectors, allow_pickle=False)
    atomic_write_bytes(out_dir / EMBEDDINGS_FILE, buf.getvalue())
    atomic_write_json(out_dir / IDS_FILE, ids)
    dim = int(vectors.shape[1]) if vectors.ndim == 2 else 0
    log.info("embeddings: %s, %d rows × %d dims (fitted on %d pool images) in %.1f s", e.source, len(ids), dim,
             len(fit_rows), seconds)
    return write_manifest(
        out_dir, stage=STAGE, stage_version=EMBEDDINGS_VERSION, inputs={**inputs, **file_inputs(e)},
        config=_stage_config(spec), outputs={"embeddings": EMBEDDINGS_FILE, "ids": IDS_FILE},
        info={"source": e.source, "dim": dim, "rows": len(ids), "fit_images": len(fit_rows), "seconds": seconds},
    )


def load_selection_embeddings(folder: str | os.PathLike[str]) -> tuple[list[str], np.ndarray]:
    """(sample IDs, float32 [n, d]) from an embeddings stage folder, after verifying its manifest's digests.

    The matrix is memory-mapped read-only: a round reads the rows of its candidates, and the selectors that take a
    whole pool (KCenter, MaxHerding from 10⁶ rows) read it in blocks, so 10⁷ × 128 is not one 5 GB load per stage."""
    folder = Path(folder)
    m = read_manifest(folder)
    if m.stage != STAGE:
        raise ArtifactError(f"{folder}: holds the output of stage {m.stage!r}, not {STAGE!r}; pass an embeddings "
                            "folder")
    ids = json.loads(m.path_of("ids", folder).read_text(encoding="utf-8"))
    vectors = np.load(m.path_of("embeddings", folder), mmap_mode="r", allow_pickle=False)
    return ids, vectors


def lookup(ids_all: Sequence[str] | IdIndex, emb_all: np.ndarray, wanted_ids: Sequence[str]) -> np.ndarray:
    """Rows of `emb_all` for `wanted_ids`, in that order; a sample without an embedding is a DataError. Pass an
    IdIndex of `ids_all` when looking up in the same space more than once."""
    rows = lookup_rows(ids_all, wanted_ids)
    return emb_all[rows] if len(rows) else emb_all[:0]


def lookup_rows(ids_all: Sequence[str] | IdIndex, wanted_ids: Sequence[str]) -> np.ndarray:
    """Row numbers of `wanted_ids` in the selection space, in that order (what `lookup` reads); a sample without an
    embedding is a DataError. For several arrays row-aligned with the same space, look the rows up once."""
    index = ids_all if isinstance(ids_all, IdIndex) else IdIndex(ids_all)
    wanted = list(wanted_ids)
    rows = index.rows(wanted)
    missing = [wanted[i] for i in np.flatnonzero(rows < 0)]
    if missing:
        raise DataError(f"sample {missing[0]!r} has no selection embedding ({len(missing)} of {len(wanted)} "
                        "missing); recompute the selection embeddings for the current dataset")
    return rows


@dataclass(frozen=True)
class EmbeddingsParams:
    """The selection-embeddings stage's parameters, built by embeddings_params; its cache key is their
    `key_fields()`."""

    artifacts: str
    prepared: StageRef  # the prepared data
    select: dict[str, Any]  # {"embeddings": the select.embeddings section as JSON data}
    model: dict[str, Any] | None  # the model section, for source vision_tower only
    file_digest: str | None  # the user's embeddings file, for source file only
    seed: int
    out_dir: str


def embeddings_params(cfg: ProjectConfig, prepared: StageRef | Mapping[str, Any]) -> EmbeddingsParams | None:
    """The selection-embeddings stage's parameters (its cache key), or None when selection uses the model's own
    embeddings. Keyed by the prepared data's content, the embeddings config, the seed, the base model
    (vision_tower) and the user's file (file), never by the adapter. A round's planning function: it reads the
    select, model, paths and seed sections and hands the stage only what keys it."""
    emb = cfg.select.embeddings
    if emb.source == "model":
        return None
    # Prefect's cache sees only parameters: a changed embeddings file must change them.
    file_digest = digest_json(file_inputs(emb)) if emb.source == "file" else None
    prepared = StageRef.of(prepared)
    params = {"prepared": prepared.as_dict(), "select": {"embeddings": cfg.section("select")["embeddings"]},
              "model": cfg.section("model") if emb.source == "vision_tower" else None,
              "file_digest": file_digest, "seed": cfg.seed}
    out = Path(cfg.artifacts) / "embeddings" / digest_json(params)[:16]
    return EmbeddingsParams(artifacts=str(cfg.artifacts), out_dir=str(out), **{**params, "prepared": prepared})


# ------------------------------------------------------------------------------------------------ sharded pools
FIT_STAGE, SHARD_STAGE = "embeddings-fit", "embeddings-shard"
STATE_FILE, VECTORS_FILE = "state.npz", "vectors.npy"
# A fitted embedder keeps serving a pool until it has grown past this many times the pool it was fitted on: adding
# 10k images to 10⁶ embeds 10k, and the pool's space is fitted again (every row embedded once more) each doubling.
REFIT_GROWTH = 2.0


def _fitted(spec: EmbeddingsSpec, table: datasets.Dataset, artifacts: Path) -> tuple[Any, dict[str, Any]]:
    """(the embedder, how it was fitted): the project's current fit for this config when the pool has not outgrown
    it (REFIT_GROWTH), else fitted on this pool's sample and made the current one (artifacts/embeddings/fit/)."""
    embedder = make_embedder(spec)
    if not embedder.needs_fit:
        return embedder, {"fit": None}
    splits = column(table, "split")
    pool = sum(1 for s in splits if s == "pool")
    root = artifacts / "embeddings" / "fit"
    current = root / f"current-{stage_key(FIT_STAGE, EMBEDDINGS_VERSION, {}, _stage_config(spec))[:16]}.json"
    if current.is_file():
        was = json.loads(current.read_text(encoding="utf-8"))
        m = find_valid_manifest(was["dir"], was["key"])
        if m is not None and pool <= REFIT_GROWTH * was["pool"]:
            with np.load(m.path_of("state", Path(was["dir"])), allow_pickle=False) as z:
                embedder.load_state(dict(z))
            return embedder, {"fit": was["key"], "fit_pool": was["pool"], "fit_images": m.info["fit_images"],
                              "fitted_now": False}
    rows = _fit_rows(spec, embedder, splits)
    ids = column(table, "sample_id")
    inputs = {"fit_ids": digest_json([ids[i] for i in rows])}
    key = stage_key(FIT_STAGE, EMBEDDINGS_VERSION, inputs, _stage_config(spec))
    out = root / key[:16]
    m = find_valid_manifest(out, key)
    if m is None:
        embedder.fit(_images(table, rows))
        buf = io.BytesIO()
        np.savez(buf, **embedder.state())
        atomic_write_bytes(out / STATE_FILE, buf.getvalue())
        m = write_manifest(out, stage=FIT_STAGE, stage_version=EMBEDDINGS_VERSION, inputs=inputs,
                           config=_stage_config(spec), outputs={"state": STATE_FILE},
                           info={"pool": pool, "fit_images": len(rows)})
    else:
        with np.load(m.path_of("state", out), allow_pickle=False) as z:
            embedder.load_state(dict(z))
    atomic_write_json(current, {"dir": str(out), "key": key, "pool": pool})
    return embedder, {"fit": key, "fit_pool": pool, "fit_images": len(rows), "fitted_now": True}


def _shard_vectors(spec: EmbeddingsSpec, embedder: Any, fit: str | None, folder: Path, digest: str,
                   artifacts: Path, done: list[str]) -> Path:
    """A prepared shard's embeddings (vectors.npy, ids.json), keyed by its content and the fit: computed once."""
    import datasets

    inputs = {"dataset": digest, "fit": fit or "none"}
    key = stage_key(SHARD_STAGE, EMBEDDINGS_VERSION, inputs, _stage_config(spec))
    out = artifacts / "embeddings" / "shards" / key[:16]

    def compute() -> Manifest:
        done.append(out.name)
        shard = datasets.load_from_disk(str(folder))
        table = shard.select_columns(["sample_id", "prepared", *(["more_prepared"] if "more_prepared" in
                                                                 shard.column_names else [])])
        vectors = _embed(embedder, table)
        buf = io.BytesIO()
        np.save(buf, vectors, allow_pickle=False)
        atomic_write_bytes(out / VECTORS_FILE, buf.getvalue())
        atomic_write_json(out / IDS_FILE, column(table, "sample_id"), indent=None)
        return write_manifest(out, stage=SHARD_STAGE, stage_version=EMBEDDINGS_VERSION, inputs=inputs,
                              config=_stage_config(spec), outputs={"vectors": VECTORS_FILE, "ids": IDS_FILE},
                              info={"rows": len(vectors)})

    reuse_or_compute(out, key, compute)
    return out


def compute_sharded_embeddings(spec: EmbeddingsSpec, prepared: datasets.Dataset, shards: list[tuple[str, Path, str]],
                               out_dir: str | os.PathLike[str], *, inputs: dict[str, str]) -> Manifest:
    """compute_selection_embeddings for a prepared dataset made of shards (pipeline.data.shards): the fitted
    embedder is kept (_fitted), each shard embedded once, and the stage's embeddings.npy assembled from them, so
    new images cost their own embedding plus a copy of the rest. The same vectors as the whole-dataset stage while
    the pool has not grown; after that, the space of the fit it kept."""
    if spec.artifacts is None:
        raise ConfigError("sharded selection embeddings keep their fits under the artifacts folder; build the "
                          "EmbeddingsSpec with artifacts=")
    out_dir, artifacts = Path(out_dir), spec.artifacts
    t0 = time.perf_counter()
    table = prepared.select_columns(["sample_id", "split", "prepared"])
    embedder, fit = _fitted(spec, table, artifacts)
    done: list[str] = []
    parts = [_shard_vectors(spec, embedder, fit["fit"], folder, digest, artifacts, done) for _, folder, digest in shards]
    arrays = [np.load(p / VECTORS_FILE, mmap_mode="r", allow_pickle=False) for p in parts]
    ids = [s for p in parts for s in json.loads((p / IDS_FILE).read_text(encoding="utf-8"))]
    if len(set(ids)) != len(ids):
        raise DataError("the prepared dataset repeats a sample_id; rebuild it with ingest (which de-duplicates)")
    dim = next((int(a.shape[1]) for a in arrays if a.ndim == 2 and a.shape[1]), 0)

    def write(f: Any) -> None:
        np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)),
                                                  "fortran_order": False, "shape": (len(ids), dim)})
        for a in arrays:
            if len(a):
                f.write(np.ascontiguousarray(a, np.float32).tobytes())

    atomic_write_stream(out_dir / EMBEDDINGS_FILE, write, f"{len(ids):,} × {dim} embeddings")
    atomic_write_json(out_dir / IDS_FILE, ids, indent=None)
    seconds = round(time.perf_counter() - t0, 3)
    log.info("embeddings: %s, %d rows × %d dims, %d of %d shards embedded (%s) in %.1f s", spec.embeddings.source,
             len(ids), dim, len(done), len(shards), "fitted now" if fit.get("fitted_now") else "fit kept", seconds)
    return write_manifest(
        out_dir, stage=STAGE, stage_version=EMBEDDINGS_VERSION, inputs=inputs, config=_stage_config(spec),
        outputs={"embeddings": EMBEDDINGS_FILE, "ids": IDS_FILE},
        info={"source": spec.embeddings.source, "dim": dim, "rows": len(ids), "seconds": seconds,
              "shards": len(shards), "shards_computed": len(done), **fit},
    )


def embeddings_stage(params: EmbeddingsParams) -> dict[str, Any]:
    """The selection-embeddings stage: fitted on the pool's images only, written to `params.out_dir` (or reused
    there); on a sharded dataset, per shard (compute_sharded_embeddings)."""
    from pipeline.preprocess import load_prepared

    prepared, out_dir, model = params.prepared, params.out_dir, params.model
    spec = EmbeddingsSpec(EmbeddingsConfig.model_validate(params.select["embeddings"]), int(params.seed),
                          ModelConfig.model_validate(model) if model else None, artifacts=Path(params.artifacts))
    inputs = {"prepared": prepared.digest}
    dataset, _ = stage_dataset(prepared.as_dict())
    shards = dataset_shards(dataset) if spec.embeddings.source != "file" else None

    def compute() -> Manifest:
        if shards is None:
            return compute_selection_embeddings(spec, load_prepared(prepared.dir), out_dir, inputs=inputs)
        return compute_sharded_embeddings(spec, load_prepared(prepared.dir), shards, out_dir, inputs=inputs)

    m = reuse_or_compute(out_dir, embeddings_key(spec, inputs), compute)
    return {"dir": out_dir, "digest": m.key}
