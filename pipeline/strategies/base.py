"""What every batch selector shares: the `Selector` base class, embedding checks and k-means (faiss threads come
from pipeline/faiss_threads.py, which the label check's kNN shares).

Selectors live in selectors.py (scores and distances) and coverage.py (coverage of the pool); both build on this
module, and only pipeline/strategies/registry.py names them.
"""

from __future__ import annotations

from typing import Any, ClassVar

import faiss
import numpy as np

from pipeline.errors import SelectionError
from pipeline.faiss_threads import faiss_threads

# Rows per distance block: keeps each temporary under ~50 MB at any pool size.
BLOCK = 1024
_FINITE_CHUNK = 262_144  # rows per finiteness check


def kmeans_labels(
    x: np.ndarray,
    n_clusters: int,
    *,
    seed: int,
    niter: int = 20,
    max_points_per_centroid: int = 64,
    nredo: int = 1,
    threads: int | None = None,
) -> np.ndarray:
    """Cluster id per row with seeded faiss k-means.

    Training reads at most `max_points_per_centroid * n_clusters` rows (a seeded subsample), then every row is
    assigned. Seeding is k-means++ where it is cheap; random seeding splits well-separated blobs wrongly, and exact
    k-means++ took ~2 s for 300 clusters of 20k x 384 here, so larger problems use AFK-MC2, its MCMC approximation
    (the same final objective to 1e-5 there, at a fraction of the cost). `nredo` runs keep the lowest objective.
    `threads`: faiss threads; by default one for cheap problems (<= 1e6 training row x cluster pairs: many tiny
    OpenMP regions, whose spinning barriers cost 100x the work when the cores are busy elsewhere), else every CPU
    this process may use.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = len(x)
    if not 1 <= n_clusters <= n:
        raise SelectionError(f"k-means: cannot make {n_clusters} clusters from {n} embeddings")
    if n_clusters == n:
        return np.arange(n, dtype=np.int64)
    rows = min(n, max_points_per_centroid * n_clusters)
    cheap = rows * n_clusters <= 1_000_000
    init = faiss.ClusteringInitMethod_KMEANS_PLUS_PLUS if cheap else faiss.ClusteringInitMethod_AFK_MC2
    with faiss_threads(threads or (1 if cheap else None)):
        km = faiss.Kmeans(
            x.shape[1], n_clusters, niter=niter, seed=seed % (2**31), verbose=False, init_method=init,
            max_points_per_centroid=max_points_per_centroid, min_points_per_centroid=1, nredo=nredo,
        )
        km.train(x)
        _, labels = km.index.search(x, 1)
    return labels[:, 0].astype(np.int64)

def sqnorms(x: np.ndarray) -> np.ndarray:
    return np.einsum("ij,ij->i", x, x)

def check_embeddings(emb: np.ndarray | None, n: int, who: str, *, keep_float16: bool = False) -> np.ndarray:
    """The embeddings as float32 [n, d], checked; `keep_float16`: float16 (e.g. a memory-mapped pool of 10⁷ rows,
    2.6 GB at d = 128, where a float32 copy would double it) is returned as given, for selectors that read it in
    blocks."""
    if emb is None:
        raise SelectionError(f"{who}: needs embeddings [n, d]; the scorer writes them next to the scores")
    e = emb if isinstance(emb, np.ndarray) else np.asarray(emb)
    if e.ndim != 2 or e.shape[0] != n or e.shape[1] == 0:
        raise SelectionError(f"{who}: embeddings must have shape [{n}, d] to match {n} scores, got {e.shape}")
    if e.dtype.kind not in "fiu":
        raise SelectionError(f"{who}: embeddings must be numbers, got dtype {e.dtype}")
    if not (keep_float16 and e.dtype == np.float16):
        e = np.ascontiguousarray(e, dtype=np.float32)
    for s in range(0, n, _FINITE_CHUNK):  # in chunks: a mask of the whole pool would be n x d bytes
        bad = ~np.isfinite(e[s : s + _FINITE_CHUNK])
        if bad.any():
            rows = s + np.unique(np.argwhere(bad)[:, 0])
            total = len(rows) + sum(int((~np.isfinite(e[t : t + _FINITE_CHUNK])).any(axis=1).sum())
                                    for t in range(s + _FINITE_CHUNK, n, _FINITE_CHUNK))
            raise SelectionError(f"{who}: {total} embedding rows contain NaN/inf (first at row {int(rows[0])}); "
                                 "rescore or quarantine them")
    return e

# The labeled set's neighbours, uncovered k-means clusters, a random fill (pipeline.strategies.candidates): SEALS's
# sources for a selector that ranks candidates by their own scores.
DEFAULT_CANDIDATE_SHARES = {"neighbors": 0.5, "clusters": 0.3, "random": 0.2}


class Selector:
    """Picks k candidates; returns indices into the candidate arrays in pick order.

    `needs_scores` is False for selectors that ignore the scores (they still validate them), so select_batch can
    run them as a cold start before any model exists. `info` holds what the last `select` chose (a radius, a
    bandwidth, a cluster count...) for callers to report; selectors with nothing to say leave it empty.
    """

    name: str = ""
    needs_scores: bool = True
    # Facts of the round a selector's constructor takes (e.g. "n_classes"): the caller passes those it knows,
    # instead of testing the selector's name.
    wants: ClassVar[tuple[str, ...]] = ()
    # How it spends predicted annotation seconds (select.cost, pipeline/strategies/cost.py): "scores" = it ranks by
    # the scores it is given, so select_batch hands it gain per second; "own" = its gain is not the score (a
    # distance, a coverage gain), its select() takes costs=[n] and divides its own gain at each greedy step;
    # "none" = it has no gain to divide and stays cost-blind.
    cost_use: ClassVar[str] = "scores"
    # What `predicted` holds when it reads it: "classes" = [n] one predicted class per candidate (stratified);
    # "box_counts" = [n, classes] how many boxes of each class the candidate's answer holds (class_balanced).
    reads_predicted: ClassVar[str] = "classes"
    # The select.candidates sources (pipeline.strategies.candidates) a restricted round draws its candidates from
    # for this selector, when select.candidates.shares is not set.
    candidate_shares: ClassVar[dict[str, float]] = DEFAULT_CANDIDATE_SHARES
    info: dict[str, Any]

    def __init__(self) -> None:
        self.info = {}

    def select(
        self,
        k: int,
        *,
        scores: np.ndarray,
        embeddings: np.ndarray | None = None,
        predicted: np.ndarray | None = None,
        seed: int,
        labeled_embeddings: np.ndarray | None = None,
    ) -> np.ndarray:
        raise NotImplementedError

    def _scores(self, k: int, scores: np.ndarray) -> np.ndarray:
        s = np.asarray(scores, dtype=np.float64)
        if s.ndim != 1:
            raise SelectionError(f"{self.name}: scores must be 1-D [n], got shape {s.shape}")
        if not 1 <= k <= len(s):
            raise SelectionError(f"{self.name}: cannot pick {k} of {len(s)} candidates; k must be in [1, {len(s)}]")
        if not np.isfinite(s).all():
            raise SelectionError(f"{self.name}: {int((~np.isfinite(s)).sum())} of {len(s)} scores are NaN/inf")
        return s
