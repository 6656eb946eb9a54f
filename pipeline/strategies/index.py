"""Nearest-neighbour search over a selection space through a faiss index: exact below a stated size, approximate above.

| rows | index | why |
|---|---|---|
| ≤ `EXACT_MAX` (200,000) | `IndexFlatL2`: exact | a query costs n × d multiply-adds; at 200k × 384 that is ~0.1 GFLOP, milliseconds per query batch |
| above | `IndexIVFFlat`, `nlist` = 4·√n lists (k-means on a seeded sample of 64 rows per list), `nprobe` = 32 | only ~32/nlist of the rows are read per query; recall against exact search is a benchmark figure (benchmarks/index_recall.py), not an assumption |
| `kind="hnsw"` on request | `IndexHNSWFlat` (M = 32, efSearch = 128) | no training; a graph build costs more than IVF's k-means on 2 cores but answers with higher recall at a given speed |

Distances are squared L2, as everywhere in pipeline.strategies. Search returns -1 / inf where fewer than k rows exist.
"""

from __future__ import annotations

import math
from typing import Literal

import faiss
import numpy as np

from pipeline.errors import SelectionError
from pipeline.strategies.base import faiss_threads

EXACT_MAX = 200_000  # rows; up to here every search is exact
IVF_PROBE = 32
HNSW_M, HNSW_EF = 32, 128

Kind = Literal["auto", "flat", "ivf", "hnsw"]


class NeighborIndex:
    """k nearest rows of `x` for query rows; `kind` auto = flat up to `exact_max` rows, IVF above."""

    def __init__(self, x: np.ndarray, *, kind: Kind = "auto", exact_max: int = EXACT_MAX, seed: int = 0,
                 nlist: int | None = None, nprobe: int = IVF_PROBE):
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] == 0:
            raise SelectionError(f"neighbour index: embeddings must be [n, d], got shape {x.shape}")
        self.n, d = x.shape
        self.kind = ("flat" if self.n <= exact_max else "ivf") if kind == "auto" else kind
        with faiss_threads(1 if self.n <= 4096 else None):
            if self.kind == "flat":
                self.index = faiss.IndexFlatL2(d)
            elif self.kind == "ivf":
                self.nlist = nlist or max(1, min(self.n // 39, int(4 * math.sqrt(self.n))))
                self.index = faiss.IndexIVFFlat(faiss.IndexFlatL2(d), d, self.nlist)
                self.index.cp.seed = seed % (2**31)
                self.index.cp.max_points_per_centroid = 64
                rows = min(self.n, 64 * self.nlist)
                train = x if rows == self.n else x[np.random.default_rng(seed).choice(self.n, rows, replace=False)]
                self.index.train(train)
                self.index.nprobe = min(nprobe, self.nlist)
            elif self.kind == "hnsw":
                self.index = faiss.IndexHNSWFlat(d, HNSW_M)
                self.index.hnsw.efSearch = HNSW_EF
            else:
                raise SelectionError(f"neighbour index: unknown kind {kind!r}; choose auto, flat, ivf or hnsw")
            self.index.add(x)

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(squared distances [m, k] ascending, row indices [m, k]) of each query's k nearest rows."""
        q = np.ascontiguousarray(q, dtype=np.float32)
        if not len(q) or k <= 0:
            return np.zeros((len(q), max(k, 0)), np.float32), np.zeros((len(q), max(k, 0)), np.int64)
        with faiss_threads(1 if self.n * len(q) < 1_000_000 else None):
            d, i = self.index.search(q, min(k, self.n))
        if k > self.n:
            d = np.pad(d, ((0, 0), (0, k - self.n)), constant_values=np.inf)
            i = np.pad(i, ((0, 0), (0, k - self.n)), constant_values=-1)
        d[i < 0] = np.inf
        return d, i.astype(np.int64)


def recall_at_k(found: np.ndarray, exact: np.ndarray) -> float:
    """Share of the exact k nearest (rows of `exact`, [m, k]) that `found` ([m, k]) also returns."""
    hits = sum(len(set(f[f >= 0].tolist()) & set(e[e >= 0].tolist())) for f, e in zip(found, exact, strict=True))
    total = int((exact >= 0).sum())
    return hits / total if total else 1.0
