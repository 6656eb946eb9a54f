"""Outlier-aware selection: keep samples that would poison uncertainty sampling from dominating a batch.

Two kinds are flagged (and reported, never deleted):
- far: the mean distance to the k nearest neighbours among labeled ∪ pool embeddings is extreme (robust z-score);
- persistent: the model stayed among the most uncertain on the sample for several rounds although labeled samples
  lie next to it. These "collective outliers" (Karamcheti et al. 2021) are what makes uncertainty sampling no
  better than random on VQA: the model cannot learn them, so every round spends labels on them again.
`select.outliers` then keeps, down-weights or excludes the flagged samples.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import faiss
import numpy as np

from pipeline.errors import SelectionError
from pipeline.store import atomic_write_json
from pipeline.strategies.selectors import faiss_threads

Policy = Literal["keep", "downweight", "exclude"]
POLICIES = ("keep", "downweight", "exclude")
# 1 / Φ⁻¹(3/4): makes the median absolute deviation estimate a normal standard deviation.
MAD_SCALE = 1.4826
# Mean absolute deviation → standard deviation, for when more than half the distances tie (MAD = 0).
MEANAD_SCALE = 1.2533


def _emb(x: Any, name: str, d: int | None = None) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 2 or (d is not None and a.shape[1] != d) or a.dtype.kind not in "fiu":
        want = f"[n, {d}]" if d is not None else "[n, d]"
        raise SelectionError(f"outliers: {name} must be a numeric {want} array, got shape {a.shape}, dtype {a.dtype}")
    a = np.ascontiguousarray(a, dtype=np.float32)
    if not np.isfinite(a).all():
        row = int(np.argwhere(~np.isfinite(a))[0, 0])
        raise SelectionError(f"outliers: {name} row {row} holds NaN/inf; rescore that sample or quarantine it")
    return a


def _neighbours(pool: np.ndarray, labeled: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(distances, indices) of each pool row's k nearest neighbours in pool ∪ labeled, itself left out.

    Indices < len(pool) are pool rows, the rest labeled rows. Exact search (IndexFlatL2)."""
    n = len(pool)
    db = np.concatenate([pool, labeled]) if len(labeled) else pool
    if len(db) - 1 < k:
        raise SelectionError(f"outliers: {k} neighbours requested but only {len(db) - 1} other embeddings exist; "
                             "lower select.outlier_neighbors")
    index = faiss.IndexFlatL2(pool.shape[1])
    index.add(db)
    with faiss_threads():
        dist, idx = index.search(pool, k + 1)
    # Drop each row itself; with exact duplicates it may not come first, so look for it, else drop the farthest.
    own = idx == np.arange(n)[:, None]
    drop = np.where(own.any(1), own.argmax(1), k)
    keep = np.ones_like(own)
    keep[np.arange(n), drop] = False
    dist = np.sqrt(np.maximum(dist[keep].reshape(n, k), 0.0))
    return dist, idx[keep].reshape(n, k)


def robust_z(x: np.ndarray) -> np.ndarray:
    """(x − median) / (1.4826 · MAD); falls back to the mean absolute deviation when the MAD is 0, and to zeros
    when every value is the same."""
    x = np.asarray(x, dtype=np.float64)
    med = np.median(x)
    scale = MAD_SCALE * np.median(np.abs(x - med))
    if scale == 0:
        scale = MEANAD_SCALE * np.mean(np.abs(x - med))
    return np.zeros_like(x) if scale == 0 else (x - med) / scale


def outlier_scores(pool_emb: Any, labeled_emb: Any, k: int) -> np.ndarray:
    """Robust z-score per pool row of its mean distance to its k nearest neighbours among labeled ∪ unlabeled.

    Large = far from everything (a z above ~3.5 is an outlier by the Iglewicz-Hoaglin rule). Distances are
    Euclidean on the embeddings as given."""
    pool = _emb(pool_emb, "pool embeddings")
    if k < 1:
        raise SelectionError(f"outliers: k must be ≥ 1, got {k}")
    if len(pool) == 0:
        return np.zeros(0)
    has_labeled = labeled_emb is not None and len(labeled_emb) > 0
    labeled = _emb(labeled_emb, "labeled embeddings", pool.shape[1]) if has_labeled else pool[:0]
    dist, _ = _neighbours(pool, labeled, k)
    return robust_z(dist.mean(1))


def near_labeled(pool_emb: Any, labeled_emb: Any, k: int) -> np.ndarray:
    """True where at least one of a pool row's k nearest neighbours (labeled ∪ pool) is labeled."""
    pool = _emb(pool_emb, "pool embeddings")
    if labeled_emb is None or len(labeled_emb) == 0 or len(pool) == 0:
        return np.zeros(len(pool), dtype=bool)
    labeled = _emb(labeled_emb, "labeled embeddings", pool.shape[1])
    _, idx = _neighbours(pool, labeled, min(k, len(pool) + len(labeled) - 1))
    return (idx >= len(pool)).any(1)


def persistent_uncertainty(
    history: Sequence[Mapping[str, float]],
    *,
    min_rounds: int = 3,
    quantile: float = 0.1,
    near: Sequence[str] | set[str] | None = None,
) -> set[str]:
    """Samples in the top `quantile` of uncertainty in each of the last `min_rounds` rounds of `history` (oldest
    first, one {sample_id: score} per model-scored round, higher = more uncertain). With `near` (IDs that have
    labeled neighbours), only those count: uncertainty far from any label is just unexplored ground."""
    if not 0 < quantile < 1:
        raise SelectionError(f"outliers: quantile must be in (0, 1), got {quantile}")
    if min_rounds < 1:
        raise SelectionError(f"outliers: min_rounds must be ≥ 1, got {min_rounds}")
    if len(history) < min_rounds:
        return set()
    hard: set[str] | None = None
    for scores in history[-min_rounds:]:
        if not scores:
            return set()
        ids = list(scores)
        v = np.asarray([scores[s] for s in ids], dtype=np.float64)
        top = {s for s, x in zip(ids, v >= np.quantile(v, 1 - quantile), strict=True) if x}
        hard = top if hard is None else hard & top
    hard = hard or set()
    return hard if near is None else hard & set(near)


def apply_outlier_policy(
    scores: Any,
    flags: Any,
    policy: Policy,
    *,
    ids: Sequence[str],
    weight: float = 0.5,
) -> tuple[np.ndarray, list[str]]:
    """(scores, excluded ids). keep: unchanged. downweight: flagged scores shrink towards the lowest score,
    s_min + weight · (s − s_min), whatever the heuristic's sign or scale. exclude: scores unchanged, the flagged
    IDs returned for the selection's exclude list."""
    s = np.asarray(scores, dtype=np.float64).copy()
    f = np.asarray(flags, dtype=bool)
    if s.ndim != 1 or f.shape != s.shape or len(ids) != len(s):
        raise SelectionError(f"outliers: {len(s)} scores, {f.size} flags and {len(ids)} ids must be aligned 1-D")
    if policy not in POLICIES:
        raise SelectionError(f"select.outliers {policy!r} is not one of {', '.join(POLICIES)}")
    if not 0 <= weight <= 1:
        raise SelectionError(f"outliers: weight must be in [0, 1], got {weight}")
    if policy == "downweight" and f.any():
        lo = s.min()
        s[f] = lo + weight * (s[f] - lo)
    excluded = [ids[i] for i in np.flatnonzero(f)] if policy == "exclude" else []
    return s, excluded


@dataclass
class OutlierReport:
    """Per pool sample: the distance z-score and the two flags; `flags` = far | persistent."""

    ids: list[str]
    z: np.ndarray
    far: np.ndarray
    persistent: np.ndarray
    policy: str

    @property
    def flags(self) -> np.ndarray:
        return self.far | self.persistent

    def rows(self) -> list[dict[str, Any]]:
        """The flagged samples, farthest first, with their reasons (what the round reports)."""
        out = []
        for i in np.argsort(-self.z, kind="stable"):
            if not self.flags[i]:
                continue
            reasons = []
            if self.far[i]:
                reasons.append(f"far from every neighbour (distance z = {self.z[i]:.1f})")
            if self.persistent[i]:
                reasons.append("stayed among the most uncertain for several rounds despite labeled neighbours")
            out.append({"sample_id": self.ids[i], "z": round(float(self.z[i]), 4), "far": bool(self.far[i]),
                        "persistent": bool(self.persistent[i]), "policy": self.policy, "reasons": reasons})
        return out


def find_outliers(
    ids: Sequence[str],
    embeddings: Any,
    history: Sequence[Mapping[str, float]],
    *,
    labeled_ids: Collection[str] = (),
    k: int,
    z_threshold: float,
    min_rounds: int,
    policy: Policy = "keep",
) -> OutlierReport:
    """Both outlier kinds for a scored set (rows of `embeddings` belong to `ids`) holding the pool and, marked by
    `labeled_ids`, the labeled samples: those are the neighbours that count as labeled; the report covers the pool
    rows. With fewer than three pool samples nothing is flagged and k is capped to what exists, rather than an
    error: a small last pool is not a user mistake."""
    if len(ids) != len(embeddings):
        raise SelectionError(f"outliers: {len(ids)} ids for {len(embeddings)} embeddings")
    emb = _emb(embeddings, "embeddings")
    labeled_set = set(labeled_ids)
    is_labeled = np.asarray([s in labeled_set for s in ids], dtype=bool)
    pool_ids = [s for s, lab in zip(ids, is_labeled, strict=True) if not lab]
    if len(pool_ids) < 3:
        none = np.zeros(len(pool_ids))
        return OutlierReport(pool_ids, none, none > 0, none > 0, policy)
    pool, labeled = emb[~is_labeled], emb[is_labeled]
    k = min(k, len(ids) - 1)
    z = outlier_scores(pool, labeled, k)
    near = near_labeled(pool, labeled, k)
    hard = persistent_uncertainty(history, min_rounds=min_rounds,
                                  near={s for s, x in zip(pool_ids, near, strict=True) if x})
    persistent = np.asarray([s in hard for s in pool_ids], dtype=bool)
    return OutlierReport(pool_ids, z, z > z_threshold, persistent, policy)


def write_uncertainty(path: str | os.PathLike[str], ids: Sequence[str], scores: Any) -> Path:
    """One round's pool uncertainty scores, for the next rounds' persistent_uncertainty history."""
    s = np.asarray(scores, dtype=np.float64)
    if len(ids) != len(s):
        raise SelectionError(f"outliers: {len(ids)} ids for {len(s)} scores")
    return atomic_write_json(path, {"sample_ids": list(ids), "scores": s.tolist()}, indent=None)


def read_uncertainty_history(paths: Sequence[str | os.PathLike[str]]) -> list[dict[str, float]]:
    """The files write_uncertainty wrote, in the order given (oldest round first); missing files are skipped."""
    out = []
    for p in paths:
        p = Path(p)
        if p.is_file():
            d = json.loads(p.read_text(encoding="utf-8"))
            out.append(dict(zip(d["sample_ids"], d["scores"], strict=True)))
    return out

