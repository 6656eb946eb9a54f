"""Quality flags over the prepared images: blur, exact and near duplicates, low information. Nothing is deleted.

Each sample gets flags + human-readable reasons in one table; `quality.exclude` decides which flags keep it out of
the pool. Duplicates are judged per question: the same image asked two different questions is two samples (the
sample ID is image + question), so only rows with the same question can be duplicates of each other.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import logging
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
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
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_jsonl,
    digest_json,
    find_valid_manifest,
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


_QUERY_BATCH = 16_384  # hashes per faiss range search (radii above 4 bits): bounds the pairs held at once


def _earliest_by_chunks(uniq: np.ndarray, first_row: np.ndarray, queries: np.ndarray, distance: int) -> np.ndarray:
    """For each distinct hash, the earliest row whose hash is within `distance` bits (itself included); exact for
    the `queries` (indices into `uniq`), untouched for the others.

    Multi-index hashing with overlapping keys: split the 64 bits into 8 bytes; two hashes within `distance` bits
    differ in at most `distance` bytes, so they agree on some 8 − distance of them, and meet in the table keyed by
    those bytes. Each of the C(8, 8 − distance) tables (70 at 4 bits) sorts the hashes by (key, earliest row); a
    query compares itself with the members of its bucket from the earliest on and stops at the first within
    `distance` bits: that member is the bucket's earliest neighbour. Keys of 4 bytes and more keep buckets to hashes
    that are truly alike; the disjoint 12-bit chunks of faiss' multi-hash index met ~10⁵ unrelated hashes per query
    on 10⁶ digits (whose hashes share long runs of equal bits), ~1 h for one pool."""
    n = len(uniq)
    octets = uniq.view(np.uint8).reshape(n, 8).astype(np.uint64)
    best = first_row.astype(np.int64).copy()
    is_query = np.zeros(n, bool)
    is_query[queries] = True
    by_row = np.argsort(first_row, kind="stable")
    for combo in itertools.combinations(range(8), 8 - distance):
        key = np.zeros(n, np.uint64)
        for b in combo:
            key = (key << np.uint64(8)) | octets[:, b]
        order = by_row[np.argsort(key[by_row], kind="stable")]  # by key, then by earliest row
        k = key[order]
        starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
        bucket_start = np.repeat(starts, np.diff(np.r_[starts, n]))
        active = np.flatnonzero(is_query[order] & (bucket_start < np.arange(n)))
        step = 0
        while active.size:
            cand = bucket_start[active] + step
            active, cand = active[cand < active], cand[cand < active]
            if not active.size:
                break
            near = np.bitwise_count(uniq[order[active]] ^ uniq[order[cand]]) <= distance
            mine, theirs = order[active[near]], order[cand[near]]
            best[mine] = np.minimum(best[mine], first_row[theirs])
            active = active[~near]
            step += 1
    return best


def _earliest_by_scan(uniq: np.ndarray, first_row: np.ndarray, queries: np.ndarray, distance: int) -> np.ndarray:
    """_earliest_by_chunks for radii where byte keys would be too short to narrow anything: faiss' flat range search
    (every pair compared), a batch of queries at a time, reduced to each query's earliest neighbouring row."""
    index = faiss.IndexBinaryFlat(64)
    codes8 = uniq.view(np.uint8).reshape(-1, 8)
    index.add(codes8)
    best = first_row.astype(np.int64).copy()
    for b in range(0, len(queries), _QUERY_BATCH):
        q = queries[b:b + _QUERY_BATCH]
        # faiss keeps distances strictly below the radius; every hash finds itself, so no segment is empty.
        lims, _, ids = index.range_search(np.ascontiguousarray(codes8[q]), distance + 1)
        best[q] = np.minimum.reduceat(first_row[ids], np.asarray(lims[:-1], dtype=np.int64))
    return best


def near_duplicate_twins(codes: np.ndarray, questions: list[str], distance: int, *,
                         start: int = 0) -> dict[int, tuple[int, int]]:
    """row (≥ `start`) → (earliest earlier row with the same question whose hash is within `distance` bits, that
    distance). Rows before `start` are only compared against (their own twins are known already).

    Identical hashes are collapsed first, so a thousand blank images cost one query, not a million pairs. The
    earliest row of a cluster is never in the result: it is the one kept clean.
    """
    if len(codes) == 0:
        return {}
    keys = np.ascontiguousarray(codes, dtype=np.uint8).view(np.uint64).ravel()
    groups: dict[str, int] = {}
    group = np.fromiter((groups.setdefault(q, len(groups)) for q in questions), np.int64, len(questions))
    earliest_of = _earliest_by_chunks if distance < 8 else _earliest_by_scan
    twins: dict[int, tuple[int, int]] = {}
    for g in range(len(groups)):
        rows = np.flatnonzero(group == g)
        if rows[-1] < start:
            continue
        uniq, first_at, inverse = np.unique(keys[rows], return_index=True, return_inverse=True)
        asked = rows >= start
        earliest = earliest_of(uniq, rows[first_at], np.unique(inverse[asked]), distance)
        mine = rows[asked]
        twin = earliest[inverse[asked]]
        later = twin < mine
        dist = np.bitwise_count(keys[mine[later]] ^ keys[twin[later]])
        twins.update(zip(mine[later].tolist(), zip(twin[later].tolist(), dist.tolist(), strict=True), strict=True))
    return twins


@dataclass
class Features:
    """Per-image quality features of rows in dataset order, as arrays: what the flags compare, and what a shard
    keeps on disk (features.npz) so that only new images are ever decoded again."""

    ids: list[str]
    questions: list[str]
    blur: np.ndarray  # float64 [n]: variance of the Laplacian
    std: np.ndarray  # float64 [n]: pixel standard deviation
    dhash: np.ndarray  # uint8 [n, 8]
    digests: list[str]  # prepared pixels' SHA-256

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def of(cls, rows: list[dict[str, Any]]) -> Features:
        return cls([r["sample_id"] for r in rows], [r["question"] for r in rows],
                   np.array([r["blur_score"] for r in rows], np.float64),
                   np.array([r["pixel_std"] for r in rows], np.float64),
                   np.stack([r["dhash"] for r in rows]) if rows else np.zeros((0, 8), np.uint8),
                   [r["pixel_digest"] for r in rows])

    @classmethod
    def concat(cls, parts: list[Features]) -> Features:
        return cls([s for p in parts for s in p.ids], [q for p in parts for q in p.questions],
                   np.concatenate([p.blur for p in parts]) if parts else np.zeros(0),
                   np.concatenate([p.std for p in parts]) if parts else np.zeros(0),
                   np.concatenate([p.dhash for p in parts]) if parts else np.zeros((0, 8), np.uint8),
                   [d for p in parts for d in p.digests])

    def save(self, path: Path) -> None:
        buf = io.BytesIO()
        # Plain arrays (no pickle): float64 keeps every score exactly, so flags equal a whole-dataset run's.
        np.savez(buf, ids=np.array(self.ids, dtype=str), questions=np.array(self.questions, dtype=str),
                 blur=self.blur, std=self.std, dhash=self.dhash, digests=np.array(self.digests, dtype=str))
        atomic_write_bytes(path, buf.getvalue())

    @classmethod
    def load(cls, path: Path) -> Features:
        with np.load(path, allow_pickle=False) as z:
            return cls(z["ids"].tolist(), z["questions"].tolist(), z["blur"], z["std"], z["dhash"],
                       z["digests"].tolist())


def flag_rows(rows: list[dict[str, Any]], cfg: QualityConfig) -> list[dict[str, Any]]:
    """rows: sample_id, question + image_features → quality table rows (flags, reasons, excluded)."""
    return flag_features(Features.of(rows), cfg)


def flag_features(feats: Features, cfg: QualityConfig, *, start: int = 0) -> list[dict[str, Any]]:
    """Quality table rows of feats' rows from `start` on, each judged against every row before it: a row's flags
    depend only on the rows before it, so the rows of a new shard are flagged without re-judging the old ones."""
    out = []
    first_exact: dict[tuple[str, str], int] = {}
    for i in range(start):
        first_exact.setdefault((feats.digests[i], feats.questions[i]), i)
    for i in range(start, len(feats)):
        flags, reasons, twin = [], [], None
        blur, std = float(feats.blur[i]), float(feats.std[i])
        if blur < cfg.blur_threshold:
            flags.append("blurry")
            reasons.append(f"blur score {blur:.1f} < quality.blur_threshold {cfg.blur_threshold}")
        if std < cfg.low_information_std:
            flags.append("low_information")
            reasons.append(f"pixel std {std:.2f} < quality.low_information_std {cfg.low_information_std}")
        j = first_exact.setdefault((feats.digests[i], feats.questions[i]), i)
        if j != i:
            twin = feats.ids[j]
            flags.append("exact_duplicate")
            reasons.append(f"same prepared pixels and question as {twin}")
        out.append({"sample_id": feats.ids[i], "blur_score": round(blur, 4), "pixel_std": round(std, 4),
                    "dhash": feats.dhash[i].tobytes().hex(), "duplicate_of": twin, "flags": flags,
                    "reasons": reasons})
    # The earliest row of a near-duplicate cluster stays clean; each later one names its earliest neighbour.
    twins = near_duplicate_twins(feats.dhash, feats.questions, cfg.near_duplicate_distance, start=start)
    for i, (j, d) in sorted(twins.items()):
        r = out[i - start]
        if r["duplicate_of"] is None:
            twin = feats.ids[j]
            r["duplicate_of"] = twin
            r["flags"].append("near_duplicate")
            r["reasons"].append(f"near duplicate of {twin} (hash distance {d} ≤ "
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
    return _write_table(flag_rows(_features(ds, batch_size), cfg), cfg, Path(out_dir), inputs)


def _features(ds: datasets.Dataset, batch_size: int = 256) -> list[dict[str, Any]]:
    cols = ["sample_id", "question", "prepared"] + (["prep_box"] if "prep_box" in ds.column_names else [])
    rows = []
    for batch in ds.select_columns(cols).iter(batch_size=batch_size):
        for k, sid in enumerate(batch["sample_id"]):
            feats = image_features(batch["prepared"][k], batch["prep_box"][k] if "prep_box" in batch else None)
            rows.append({"sample_id": sid, "question": batch["question"][k], **feats})
    return rows


def _summary(tables: list[list[dict[str, Any]]] | list[dict[str, Any]], excluded: int) -> dict[str, Any]:
    counts = Counter(f for t in tables for r in t for f in r["flags"])
    return {"rows": sum(len(t) for t in tables), "excluded": excluded, "counts": {f: counts[f] for f in FLAGS},
            "medians": _medians([r["blur_score"] for t in tables for r in t],
                                [r["pixel_std"] for t in tables for r in t])}


def _medians(blur: Any, std: Any) -> dict[str, float | None]:
    """The pool's own median blur score and pixel std: what explain_flags compares the absolute thresholds with."""
    blur, std = np.asarray(blur, dtype=np.float64), np.asarray(std, dtype=np.float64)
    return {"blur_score": round(float(np.median(blur)), 2) if len(blur) else None,
            "pixel_std": round(float(np.median(std)), 2) if len(std) else None}


# A flag on at least this share of the samples describes the pool (small upscaled photos, a product line shot
# alike), not a defect of each one: explain_flags reports it as the pool's norm.
POOL_NORM_SHARE = 0.5
_MEASURES = {
    "blurry": ("soft edges: the variance of the Laplacian of the prepared image (its blur score)",
               "blur score < quality.blur_threshold {blur_threshold:g}", "blur_score"),
    "low_information": ("a nearly flat image: the standard deviation of its pixels",
                        "pixel std < quality.low_information_std {low_information_std:g}", "pixel_std"),
    "exact_duplicate": ("the same prepared pixels and question as an earlier sample", "identical pixels", None),
    "near_duplicate": ("a perceptual-hash twin of an earlier sample (same question)",
                       "hash distance ≤ quality.near_duplicate_distance {near_duplicate_distance}", None),
}


def explain_flags(info: Mapping[str, Any], cfg: QualityConfig) -> list[str]:
    """One line per quality flag that fired: what it measures, its threshold, how many samples it hit and whether it
    keeps them out of the pool. A flag on at least POOL_NORM_SHARE of the samples is reported as the pool's norm,
    with the pool's own median beside the absolute threshold and why the threshold is absolute."""
    rows, medians = max(1, int(info.get("rows") or 0)), info.get("medians") or {}
    lines = []
    for flag, n in (info.get("counts") or {}).items():
        if not n or flag not in _MEASURES:
            continue
        measures, threshold, stat = _MEASURES[flag]
        threshold = threshold.format(**cfg.model_dump())
        keeps = "keeps them out of the pool (quality.exclude)" if flag in cfg.exclude else \
            "does not keep them out of the pool (not in quality.exclude)"
        line = f"{flag}: {n} of {rows} samples ({n / rows:.0%}); measures {measures}; threshold: {threshold}; {keeps}"
        if n / rows >= POOL_NORM_SHARE:
            median = medians.get(stat) if stat else None
            line += (f". On {n / rows:.0%} of the samples this is the pool's norm, not a defect of each image"
                     + (f" (the pool's median {stat.replace('_', ' ')} is {median:g})" if median is not None else "")
                     + ": the threshold is absolute, measured on the prepared image at preprocess.size, so small "
                     "images upscaled to that size all score alike; if these images are fine, lower the threshold "
                     "or preprocess.size (tamis init sizes it from your images)")
        lines.append(line)
    return lines


def _write_table(table: list[dict[str, Any]], cfg: QualityConfig, out_dir: Path,
                 inputs: Mapping[str, str] | None) -> Manifest:
    atomic_write_jsonl(out_dir / TABLE, table)
    excluded = [r["sample_id"] for r in table if r["excluded"]]
    atomic_write_json(out_dir / EXCLUDED, excluded, indent=None)
    info = _summary([table], len(excluded))
    log.info("quality: %s", info)
    return write_manifest(out_dir, stage=STAGE, stage_version=QUALITY_VERSION, inputs=inputs or {},
                          config=cfg.model_dump(mode="json"), outputs={"table": TABLE, "excluded": EXCLUDED},
                          info=info)


FEATURES_STAGE = "quality-features"
FLAGS_STAGE = "quality-flags"
FEATURES = "features.npz"
PARTS = "parts.json"  # a sharded dataset's quality: the flags folder of each shard, in dataset order
EXCLUDED = "excluded.json"  # the sample IDs quality.exclude keeps out of the pool (what every round reads)


def _shard_features(artifacts: str | os.PathLike[str], folder: Path, digest: str, done: list[str]) -> tuple[str, Path]:
    """(key, folder) of a prepared shard's per-image features (blur, pixel std, dHash, pixel digest), keyed by the
    shard's content: what costs a decode per image, computed once per shard."""
    import datasets

    inputs = {"dataset": digest}
    key = stage_key(FEATURES_STAGE, QUALITY_VERSION, inputs, {})
    out = Path(artifacts) / "quality" / "features" / key[:16]

    def compute() -> Manifest:
        done.append(out.name)
        feats = Features.of(_features(datasets.load_from_disk(str(folder))))
        feats.save(out / FEATURES)
        return write_manifest(out, stage=FEATURES_STAGE, stage_version=QUALITY_VERSION, inputs=inputs, config={},
                              outputs={"features": FEATURES}, info={"rows": len(feats)})

    return reuse_or_compute(out, key, compute).key, out


def _flags_folder(artifacts: str | os.PathLike[str], feature_keys: list[str], k: int,
                  cfg: QualityConfig) -> tuple[Path, str, dict[str, str]]:
    """(folder, key, inputs) of shard k's flags: keyed by the features of shards 0..k and the config, since a row's
    flags depend on the rows before it only. A shard appended to the dataset leaves the flags of the ones before it
    alone; a shard whose predecessors changed is judged again."""
    inputs = {"features": feature_keys[k], "before": digest_json(feature_keys[:k])}
    key = stage_key(FLAGS_STAGE, QUALITY_VERSION, inputs, cfg.model_dump(mode="json"))
    return Path(artifacts) / "quality" / "flags" / key[:16], key, inputs


def _write_flags(out: Path, table: list[dict[str, Any]], cfg: QualityConfig, inputs: dict[str, str]) -> None:
    atomic_write_jsonl(out / TABLE, table)
    excluded = [r["sample_id"] for r in table if r["excluded"]]
    atomic_write_json(out / EXCLUDED, excluded, indent=None)
    write_manifest(out, stage=FLAGS_STAGE, stage_version=QUALITY_VERSION, inputs=inputs,
                   config=cfg.model_dump(mode="json"), outputs={"table": TABLE, "excluded": EXCLUDED},
                   info=_summary([table], len(excluded)))


def _assess_shards(artifacts: str | os.PathLike[str], shards: list[tuple[str, Path, str]], cfg: QualityConfig,
                   out_dir: Path, inputs: Mapping[str, str]) -> Manifest:
    """Quality for a prepared dataset made of shards: features per shard (only new shards decode their images),
    flags per shard against every row before it (only shards from the first one without valid flags on are judged,
    in one pass), so near and exact duplicates of a new image are found among all the rows already there and the
    flags equal a whole-dataset run's."""
    computed: list[str] = []
    feats = [_shard_features(artifacts, folder, digest, computed) for _, folder, digest in shards]
    keys = [k for k, _ in feats]
    folders = [_flags_folder(artifacts, keys, k, cfg) for k in range(len(shards))]
    first = next((k for k, (out, key, _) in enumerate(folders) if find_valid_manifest(out, key) is None), len(shards))
    if first < len(shards):
        parts = [Features.load(folder / FEATURES) for _, folder in feats]
        table = flag_features(Features.concat(parts), cfg, start=sum(len(p) for p in parts[:first]))
        at = 0
        for k in range(first, len(shards)):
            out, key, flag_inputs = folders[k]
            n = len(parts[k])
            if find_valid_manifest(out, key) is None:
                _write_flags(out, table[at:at + n], cfg, flag_inputs)
            at += n
    excluded = [s for out, _, _ in folders for s in json.loads((out / EXCLUDED).read_text(encoding="utf-8"))]
    atomic_write_json(out_dir / PARTS, [str(out) for out, _, _ in folders])
    atomic_write_json(out_dir / EXCLUDED, excluded, indent=None)
    infos = [read_manifest(out).info for out, _, _ in folders]
    every = [Features.load(folder / FEATURES) for _, folder in feats]
    info = {"rows": sum(i["rows"] for i in infos), "excluded": len(excluded),
            "counts": {f: sum(i["counts"][f] for i in infos) for f in FLAGS},
            "medians": _medians(np.concatenate([p.blur for p in every]), np.concatenate([p.std for p in every]))}
    log.info("quality: %s; features of %d of %d shards computed, flags of %d judged", info, len(computed),
             len(shards), len(shards) - first)
    return write_manifest(out_dir, stage=STAGE, stage_version=QUALITY_VERSION, inputs=inputs,
                          config=cfg.model_dump(mode="json"), outputs={"parts": PARTS, "excluded": EXCLUDED},
                          info={**info, "shards": len(shards), "shards_computed": len(computed),
                                "shards_judged": len(shards) - first})


def load_quality(quality_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The quality table of a quality stage folder (manifest verified), one row per sample in dataset order."""
    folder = Path(quality_dir)
    m = read_manifest(folder)
    if m.stage != STAGE:
        raise ArtifactError(f"{folder}: holds the output of stage {m.stage!r}, not {STAGE!r}; pass a quality folder")
    if "parts" not in m.outputs:
        return read_jsonl(m.path_of("table", folder))
    parts = json.loads(m.path_of("parts", folder).read_text(encoding="utf-8"))
    return [r for p in parts for r in read_jsonl(read_manifest(Path(p)).path_of("table", Path(p)))]


def excluded_ids(quality_dir: str | os.PathLike[str]) -> set[str]:
    """Sample IDs whose flags keep them out of the pool (per the quality config the table was built with): one small
    file, so a round over 10⁶ samples does not read their whole table."""
    folder = Path(quality_dir)
    m = read_manifest(folder)
    if m.stage != STAGE:
        raise ArtifactError(f"{folder}: holds the output of stage {m.stage!r}, not {STAGE!r}; pass a quality folder")
    if "excluded" not in m.outputs:  # a table written before excluded.json existed
        return {r["sample_id"] for r in read_jsonl(m.path_of("table", folder)) if r["excluded"]}
    return set(json.loads(m.path_of("excluded", folder).read_text(encoding="utf-8")))


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


def _quality_key(artifacts: str | os.PathLike[str], dataset_digest: str, quality: dict[str, Any]) -> tuple[str, Path]:
    key = stage_key(STAGE, QUALITY_VERSION, {"dataset": dataset_digest}, quality)
    return key, Path(artifacts) / "quality" / key[:16]


@dataclass(frozen=True)
class QualityParams:
    """The quality stage's parameters, built by quality_params; its cache key is their `asdict()`."""

    artifacts: str
    dataset: str  # the prepared dataset's folder
    dataset_digest: str
    quality: dict[str, Any]  # the quality section as JSON data

    def key(self) -> tuple[str, Path]:
        return _quality_key(self.artifacts, self.dataset_digest, self.quality)


def quality_cached(params: QualityParams) -> dict[str, Any] | None:
    """The stage's ref when its verified output is on disk, else None."""
    key, out = params.key()
    m = find_valid_manifest(out, key)
    return None if m is None else stage_ref(out, m, "parts" if "parts" in m.outputs else "table")


def quality_stage(params: QualityParams) -> dict[str, Any]:
    """The quality stage: flags for the prepared dataset in artifacts/quality/<key>/ (or the verified folder
    already there). Returns its ref {"dir", "digest", "info"}."""
    import datasets

    inputs = {"dataset": params.dataset_digest}
    key, out = params.key()
    cfg = QualityConfig(**params.quality)
    shards = dataset_shards(params.dataset)
    if shards is None:
        m = reuse_or_compute(out, key, lambda: assess_quality(datasets.load_from_disk(params.dataset), cfg, out,
                                                              inputs=inputs))
    else:
        m = reuse_or_compute(out, key, lambda: _assess_shards(params.artifacts, shards, cfg, out, inputs))
    return stage_ref(out, m, "parts" if "parts" in m.outputs else "table")


def quality_params(artifacts: str | os.PathLike[str], prepared_ref: dict[str, Any],
                   quality: QualityConfig) -> QualityParams:
    """The quality stage's parameters (its cache key) for a prepared dataset's ref."""
    dataset, digest = stage_dataset(prepared_ref)
    return QualityParams(artifacts=str(artifacts), dataset=dataset, dataset_digest=digest,
                         quality=quality.model_dump(mode="json"))
