"""Quality flags over the prepared images: blur, exact and near duplicates, low information. Nothing is deleted.

Each sample gets flags + human-readable reasons in one table; `quality.exclude` decides which flags keep it out of
the pool. Duplicates are judged per question: the same image asked two different questions is two samples (the
sample ID is image + question), so only rows with the same question can be duplicates of each other.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cv2
import faiss
import numpy as np

from pipeline.codeversion import stage_version
from pipeline.config import QualityConfig
from pipeline.data.shards import dataset_shards
from pipeline.errors import ArtifactError, DataError
from pipeline.preprocess import decode_prepared
from pipeline.store import (
    Manifest,
    atomic_write_jsonl,
    read_jsonl,
    read_manifest,
    reuse_or_compute,
    stage_dataset,
    stage_key,
    stage_ref,
    write_manifest,
)

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

STAGE = "quality"
QUALITY_VERSION = stage_version("1", "pipeline.quality")
FLAGS = ("blurry", "exact_duplicate", "near_duplicate", "low_information")
TABLE = "quality.jsonl"


def content(rgb: np.ndarray, box: list[int] | None) -> np.ndarray:
    """The image without its square padding (padding would add a sharp edge and fake contrast)."""
    if not box or box[2] <= 0 or box[3] <= 0:
        return rgb
    x, y, w, h = box
    return rgb[y:y + h, x:x + w]


def blur_score(grey: np.ndarray) -> float:
    """Variance of the Laplacian: low when edges are soft (blurry or flat)."""
    return float(cv2.Laplacian(grey, cv2.CV_64F).var())


def pixel_std(rgb: np.ndarray) -> float:
    # Per-channel max, so a two-colour image of equal brightness still counts as informative.
    return float(rgb.reshape(-1, 3).std(axis=0).max())


def dhash64(grey: np.ndarray) -> np.ndarray:
    """64-bit difference hash (8 packed bytes): sign of horizontal gradients on a 9×8 area-downscaled thumbnail."""
    small = cv2.resize(grey, (9, 8), interpolation=cv2.INTER_AREA).astype(np.int16)
    return np.packbits((small[:, 1:] > small[:, :-1]).ravel())


def pixel_digest(rgb: np.ndarray) -> str:
    return hashlib.sha256(repr(rgb.shape).encode() + np.ascontiguousarray(rgb).tobytes()).hexdigest()


def image_features(png: bytes, box: list[int] | None) -> dict[str, Any]:
    rgb = decode_prepared(png)
    crop = content(rgb, box)
    grey = cv2.cvtColor(crop, cv2.COLOR_RGB2GRAY)
    return {"blur_score": blur_score(grey), "pixel_std": pixel_std(crop), "dhash": dhash64(grey),
            "pixel_digest": pixel_digest(rgb)}


def near_duplicate_twins(codes: np.ndarray, questions: list[str], distance: int) -> dict[int, tuple[int, int]]:
    """row → (earliest earlier row with the same question whose hash is within `distance` bits, that distance).

    Identical hashes are collapsed before the faiss search, so a thousand blank images cost one query, not a
    million pairs. The earliest row of a cluster is never in the result: it is the one kept clean.
    """
    uniq, inverse = np.unique(codes, axis=0, return_inverse=True)
    inverse = inverse.ravel()
    index = faiss.IndexBinaryFlat(64)
    index.add(uniq)
    lims, dist, ids = index.range_search(uniq, distance + 1)  # faiss keeps distances strictly below the radius
    first: dict[tuple[int, str], int] = {}
    for row, (u, q) in enumerate(zip(inverse.tolist(), questions, strict=True)):
        first.setdefault((u, q), row)
    twins = {}
    for row, (u, q) in enumerate(zip(inverse.tolist(), questions, strict=True)):
        best = None
        for k in range(lims[u], lims[u + 1]):
            j = first.get((int(ids[k]), q))
            if j is not None and j < row and (best is None or j < best[0]):
                best = (j, int(dist[k]))
        if best is not None:
            twins[row] = best
    return twins


def flag_rows(rows: list[dict[str, Any]], cfg: QualityConfig) -> list[dict[str, Any]]:
    """rows: sample_id, question + image_features → quality table rows (flags, reasons, excluded)."""
    out = []
    first_exact: dict[tuple[str, str], int] = {}
    for i, r in enumerate(rows):
        flags, reasons, twin = [], [], None
        if r["blur_score"] < cfg.blur_threshold:
            flags.append("blurry")
            reasons.append(f"blur score {r['blur_score']:.1f} < quality.blur_threshold {cfg.blur_threshold}")
        if r["pixel_std"] < cfg.low_information_std:
            flags.append("low_information")
            reasons.append(f"pixel std {r['pixel_std']:.2f} < quality.low_information_std {cfg.low_information_std}")
        key = (r["pixel_digest"], r["question"])
        j = first_exact.setdefault(key, i)
        if j != i:
            twin = rows[j]["sample_id"]
            flags.append("exact_duplicate")
            reasons.append(f"same prepared pixels and question as {twin}")
        out.append({"sample_id": r["sample_id"], "blur_score": round(r["blur_score"], 4),
                    "pixel_std": round(r["pixel_std"], 4), "dhash": r["dhash"].tobytes().hex(),
                    "duplicate_of": twin, "flags": flags, "reasons": reasons})
    if rows:
        # The earliest row of a near-duplicate cluster stays clean; each later one names its earliest neighbour.
        codes = np.stack([r["dhash"] for r in rows])
        twins = near_duplicate_twins(codes, [r["question"] for r in rows], cfg.near_duplicate_distance)
        for i, (j, d) in sorted(twins.items()):
            if out[i]["duplicate_of"] is None:
                twin = rows[j]["sample_id"]
                out[i]["duplicate_of"] = twin
                out[i]["flags"].append("near_duplicate")
                out[i]["reasons"].append(f"near duplicate of {twin} (hash distance {d} ≤ "
                                         f"quality.near_duplicate_distance {cfg.near_duplicate_distance})")
    for r in out:
        r["excluded"] = any(f in cfg.exclude for f in r["flags"])
    return out


def assess_quality(
    ds: datasets.Dataset, cfg: QualityConfig, out_dir: str | os.PathLike[str], *,
    inputs: Mapping[str, str] | None = None, batch_size: int = 256,
) -> Manifest:
    """Score every prepared row and write `quality.jsonl` (one row per sample_id) + manifest into `out_dir`."""
    missing = {"sample_id", "prepared", "question"} - set(ds.column_names)
    if missing:
        raise DataError(f"dataset lacks column(s) {sorted(missing)}; pass the prepared dataset (run preprocess first)")
    return _write_table(_features(ds, batch_size), cfg, Path(out_dir), inputs)


def _features(ds: datasets.Dataset, batch_size: int = 256) -> list[dict[str, Any]]:
    cols = ["sample_id", "question", "prepared"] + (["prep_box"] if "prep_box" in ds.column_names else [])
    rows = []
    for batch in ds.select_columns(cols).iter(batch_size=batch_size):
        for k, sid in enumerate(batch["sample_id"]):
            feats = image_features(batch["prepared"][k], batch["prep_box"][k] if "prep_box" in batch else None)
            rows.append({"sample_id": sid, "question": batch["question"][k], **feats})
    return rows


def _write_table(rows: list[dict[str, Any]], cfg: QualityConfig, out_dir: Path,
                 inputs: Mapping[str, str] | None, extra: Mapping[str, Any] | None = None) -> Manifest:
    table = flag_rows(rows, cfg)
    atomic_write_jsonl(out_dir / TABLE, table)
    counts = Counter(f for r in table for f in r["flags"])
    info = {"rows": len(table), "excluded": sum(r["excluded"] for r in table), "counts": {f: counts[f] for f in FLAGS}}
    log.info("quality: %s", info)
    return write_manifest(out_dir, stage=STAGE, stage_version=QUALITY_VERSION, inputs=inputs or {},
                          config=cfg.model_dump(mode="json"), outputs={"table": TABLE}, info={**info, **(extra or {})})


FEATURES_STAGE = "quality-features"
FEATURES = "features.jsonl"


def _shard_features(artifacts: str | os.PathLike[str], folder: Path, digest: str,
                    done: list[str]) -> list[dict[str, Any]]:
    """A prepared shard's per-image features (blur, pixel std, dHash, pixel digest), keyed by the shard's content:
    what costs a decode per image. Flags compare rows across the whole dataset and are recomputed from these."""
    import datasets

    inputs = {"dataset": digest}
    key = stage_key(FEATURES_STAGE, QUALITY_VERSION, inputs, {})
    out = Path(artifacts) / "quality" / "features" / key[:16]

    def compute() -> Manifest:
        done.append(out.name)
        rows = _features(datasets.load_from_disk(str(folder)))
        atomic_write_jsonl(out / FEATURES, [{**r, "dhash": r["dhash"].tobytes().hex()} for r in rows])
        return write_manifest(out, stage=FEATURES_STAGE, stage_version=QUALITY_VERSION, inputs=inputs, config={},
                              outputs={"features": FEATURES}, info={"rows": len(rows)})

    reuse_or_compute(out, key, compute)
    # JSON keeps floats exactly (shortest repr), so the flags equal those of a whole-dataset run.
    return [{**r, "dhash": np.frombuffer(bytes.fromhex(r["dhash"]), np.uint8)} for r in read_jsonl(out / FEATURES)]


def _assess_shards(artifacts: str | os.PathLike[str], shards: list[tuple[str, Path, str]], cfg: QualityConfig,
                   out_dir: Path, inputs: Mapping[str, str]) -> Manifest:
    """Quality for a prepared dataset made of shards: features per shard (only new shards decode their images), then
    the flags over every row in dataset order, so near and exact duplicates of a new image are found among all the
    rows already there, and the table equals a whole-dataset run's."""
    done: list[str] = []
    rows = [r for _, folder, digest in shards for r in _shard_features(artifacts, folder, digest, done)]
    log.info("quality: features of %d of %d shards computed, %d re-used", len(done), len(shards),
             len(shards) - len(done))
    return _write_table(rows, cfg, out_dir, inputs, {"shards": len(shards), "shards_computed": len(done)})


def load_quality(quality_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The quality table of a quality stage folder (manifest verified)."""
    folder = Path(quality_dir)
    m = read_manifest(folder)
    if m.stage != STAGE:
        raise ArtifactError(f"{folder}: holds the output of stage {m.stage!r}, not {STAGE!r}; pass a quality folder")
    return read_jsonl(m.path_of("table", folder))


def excluded_ids(quality_dir: str | os.PathLike[str]) -> set[str]:
    """Sample IDs whose flags keep them out of the pool (per the quality config the table was built with)."""
    return {r["sample_id"] for r in load_quality(quality_dir) if r["excluded"]}


def quality_report(quality_dir: str | os.PathLike[str], ds: datasets.Dataset, top: int = 10) -> dict[str, Any]:
    """Counts per flag and, per flag, the `top` worst examples with their IDs, image paths and reasons."""
    table = load_quality(quality_dir)
    where = {}
    for batch in ds.select_columns(["sample_id", "image_path", "source"]).iter(batch_size=4096):
        where.update(zip(batch["sample_id"], zip(batch["image_path"], batch["source"], strict=True), strict=True))
    severity = {  # worst first
        "blurry": lambda r: r["blur_score"], "low_information": lambda r: r["pixel_std"],
        "exact_duplicate": lambda r: 0.0, "near_duplicate": lambda r: r["blur_score"],
    }
    worst = {}
    for flag in FLAGS:
        hits = sorted((r for r in table if flag in r["flags"]), key=severity[flag])[:top]
        worst[flag] = [
            {"sample_id": r["sample_id"], "image_path": where.get(r["sample_id"], ("", ""))[0],
             "source": where.get(r["sample_id"], ("", ""))[1], "blur_score": r["blur_score"],
             "pixel_std": r["pixel_std"], "duplicate_of": r["duplicate_of"],
             "reason": "; ".join(r["reasons"])}
            for r in hits
        ]
    counts = Counter(f for r in table for f in r["flags"])
    return {"rows": len(table), "excluded": sum(r["excluded"] for r in table),
            "counts": {f: counts[f] for f in FLAGS}, "worst": worst}


def quality_stage(artifacts: str | os.PathLike[str], dataset: str, dataset_digest: str,
                  quality: dict[str, Any]) -> dict[str, Any]:
    """The quality stage: flags for the prepared `dataset` in artifacts/quality/<key>/ (or the verified folder
    already there). Returns its ref {"dir", "digest", "info"}."""
    import datasets

    inputs = {"dataset": dataset_digest}
    key = stage_key(STAGE, QUALITY_VERSION, inputs, quality)
    out = Path(artifacts) / "quality" / key[:16]
    shards = dataset_shards(dataset)
    if shards is None:
        m = reuse_or_compute(out, key, lambda: assess_quality(datasets.load_from_disk(dataset),
                                                              QualityConfig(**quality), out, inputs=inputs))
    else:
        m = reuse_or_compute(out, key, lambda: _assess_shards(artifacts, shards, QualityConfig(**quality), out,
                                                              inputs))
    return stage_ref(out, m, "table")


def quality_params(artifacts: str | os.PathLike[str], prepared_ref: dict[str, Any],
                   quality: QualityConfig) -> dict[str, Any]:
    """The quality stage's parameters (its cache key) for a prepared dataset's ref."""
    dataset, digest = stage_dataset(prepared_ref)
    return {"artifacts": str(artifacts), "dataset": dataset, "dataset_digest": digest,
            "quality": quality.model_dump(mode="json")}
