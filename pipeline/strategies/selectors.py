"""Batch selectors: turn per-candidate scores (and embeddings / predicted classes) into k diverse picks.

A selector returns indices into the candidate arrays in pick order (first = picked first). Distances are Euclidean
on the embeddings as given; L2-normalise them beforehand for cosine geometry.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from threadpoolctl import threadpool_limits

from pipeline.errors import SelectionError
from pipeline.strategies.base import BLOCK, Selector, check_embeddings, faiss_threads, kmeans_labels, sqnorms
from pipeline.strategies.blocked import BLOCKED_MIN, BlockedRows
from pipeline.strategies.heuristics import rank

__all__ = ["ClusterMargin", "KCenter", "Stratified", "TopK", "Typical", "faiss_threads", "k_center_greedy",
           "kmeans_labels"]

# Centre columns per GEMM: keeps each temporary under ~50 MB at any pool size.
_CENTER_CHUNK = 1024
_DONE = np.iinfo(np.int64).max


def _min_sqdist(x: np.ndarray, xsq: np.ndarray, c: np.ndarray, csq: np.ndarray) -> np.ndarray:
    """min_j ||x_i - c_j||^2 as sq_i + min_j (csq_j - 2 x_i.c_j), a float32 GEMM per centre chunk."""
    best = np.full(len(x), np.inf, dtype=np.float32)
    for j in range(0, len(c), _CENTER_CHUNK):
        g = x @ c[j : j + _CENTER_CHUNK].T
        g *= -2.0
        g += csq[None, j : j + _CENTER_CHUNK]
        np.minimum(best, g.min(axis=1), out=best)
    best += xsq
    # Cancellation can leave tiny negatives for (near-)duplicates.
    return np.maximum(best, 0.0)


def k_center_greedy(
    x: np.ndarray,
    k: int,
    *,
    centers: np.ndarray | None = None,
    first: int | None = None,
    weights: np.ndarray | None = None,
    blas_threads: int | None = 1,
) -> np.ndarray:
    """Greedy core-set (Sener & Savarese 2018): repeatedly pick argmax_i weight_i * min_j ||x_i - c_j||^2.

    Exact, but lazy: each row keeps an upper bound of its min-distance and the number of centres it has been
    checked against. Only rows whose bound reaches the top are updated, in blocks, against the centres added since
    their last check (one float32 GEMM per block). A row is picked once its bound is exact and still the largest.
    Every (row, centre) pair is computed at most once, so the cost never exceeds one n x (L + k) GEMM, and on real
    pools only a small fraction of it (~0.65 n k pairs for 1,000 of 100,000 x 384: ~1 s on one core, where
    1,000 full passes over the pool take 5-15 s).

    `centers` are already-labeled embeddings; without them the first pick is row `first`. The blocks are small,
    so BLAS runs on `blas_threads` (None: the library default): with 2 threads on 2 busy cores OpenBLAS' spinning
    workers made this 10-20x slower here, single-threaded it stays ~1 s.
    """
    with threadpool_limits(blas_threads, user_api="blas"):
        return _k_center_lazy(x, k, centers=centers, first=first, weights=weights)


def _k_center_lazy(
    x: np.ndarray, k: int, *, centers: np.ndarray | None, first: int | None, weights: np.ndarray | None
) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, d = x.shape
    n_lab = 0 if centers is None else len(centers)
    if n_lab == 0 and first is None:
        raise SelectionError("k-center: needs labeled centres or a first pick")
    w = None if weights is None else np.asarray(weights, dtype=np.float32)
    cap = n_lab + k
    c = np.empty((max(cap, 1), d), dtype=np.float32)
    csq = np.empty(len(c), dtype=np.float32)
    picks: list[int] = []
    stamp = np.ones(n, dtype=np.int64)
    if n_lab:
        c[:n_lab] = centers
        t = n_lab
    else:
        c[0] = x[first]
        picks.append(int(first))
        t = 1
    csq[:t] = sqnorms(c[:t])
    # One pass against the first centre gives every row a finite upper bound to start from.
    xsq = sqnorms(x)
    md = _min_sqdist(x, xsq, c[:1], csq[:1])
    key = md.copy() if w is None else md * w
    for i in picks:
        key[i], stamp[i] = -np.inf, _DONE
    block = BLOCK
    while len(picks) < k:
        i = int(np.argmax(key))
        if stamp[i] >= t:
            picks.append(i)
            c[t], csq[t] = x[i], xsq[i]
            t += 1
            key[i], stamp[i] = -np.inf, _DONE
            block = BLOCK
            continue
        top = np.argpartition(key, n - block)[n - block :] if block < n else np.arange(n)
        top = top[stamp[top] < t]
        # Rows checked equally recently share the centres they still need: sort by stamp, update in groups.
        top = top[np.argsort(stamp[top], kind="stable")]
        group = max(128, block // 8)
        for s in range(0, len(top), group):
            g = top[s : s + group]
            s0 = int(stamp[g[0]])
            md[g] = np.minimum(md[g], _min_sqdist(x[g], xsq[g], c[s0:t], csq[s0:t]))
            stamp[g] = t
            key[g] = md[g] if w is None else md[g] * w[g]
        # Still not settled: the bound ordering is poor here, look at more rows next time.
        block = min(2 * block, n)
    return np.asarray(picks, dtype=np.int64)


def _order_round_robin(group: np.ndarray, within: np.ndarray, group_order: np.ndarray) -> np.ndarray:
    """Positions sorted by (round, group turn): the r-th pick of every group comes before any (r+1)-th pick."""
    return np.lexsort((group_order[group], within))


def _within_rank(group: np.ndarray) -> np.ndarray:
    """For rows already in preference order, each row's 0-based position inside its group."""
    order = np.argsort(group, kind="stable")
    sorted_g = group[order]
    starts = np.r_[0, np.flatnonzero(sorted_g[1:] != sorted_g[:-1]) + 1]
    pos = np.arange(len(group)) - np.repeat(starts, np.diff(np.r_[starts, len(group)]))
    out = np.empty(len(group), dtype=np.int64)
    out[order] = pos
    return out


class TopK(Selector):
    """The k highest scores; ties in a seeded order."""

    name = "top_k"

    def select(self, k, *, scores, embeddings=None, predicted=None, seed, labeled_embeddings=None):
        return rank(self._scores(k, scores), seed=seed)[:k]


class KCenter(Selector):
    """Greedy core-set on embeddings, starting from the labeled set (or the top-scored candidate without one).

    From `BLOCKED_MIN` rows (10⁶) the same greedy runs over k-means blocks with triangle bounds
    (pipeline/strategies/blocked.py), reading float16 or memory-mapped embeddings in place.
    uncertainty="none" ignores scores after the first pick; "product" picks argmax of min-distance x score (an
    uncertain sample far from everything chosen); "top_m" runs the core-set only over the top `top_m_factor * k`
    candidates by score (Ash et al. style "filter then diversify").
    """

    name = "k_center"
    cost_use = "own"  # argmax d_i / ĉ_i: a weight of 1 / ĉ_i² on the squared min-distance

    def __init__(self, uncertainty: Literal["none", "product", "top_m"] = "none", top_m_factor: int = 10) -> None:
        super().__init__()
        if uncertainty not in ("none", "product", "top_m"):
            raise SelectionError(f"k_center: uncertainty must be 'none', 'product' or 'top_m', got {uncertainty!r}")
        if top_m_factor < 1:
            raise SelectionError(f"k_center: top_m_factor must be >= 1, got {top_m_factor}")
        self.uncertainty, self.top_m_factor = uncertainty, top_m_factor

    def select(self, k, *, scores, embeddings=None, predicted=None, seed, labeled_embeddings=None, costs=None):
        s = self._scores(k, scores)
        e = check_embeddings(embeddings, len(s), self.name, keep_float16=True)
        lab = None
        if labeled_embeddings is not None and len(labeled_embeddings):
            lab = np.asarray(labeled_embeddings, dtype=np.float32)
            if lab.ndim != 2 or lab.shape[1] != e.shape[1]:
                raise SelectionError(
                    f"k_center: labeled embeddings must have shape [m, {e.shape[1]}] like the candidates, got {lab.shape}"
                )
            if not np.isfinite(lab).all():
                raise SelectionError("k_center: labeled embeddings contain NaN/inf; rescore the labeled set")
        order = rank(s, seed=seed)
        weights = None
        if self.uncertainty == "top_m":
            idx = order[: min(len(s), self.top_m_factor * k)]
            first = 0  # idx starts with the top-scored candidate
        else:
            idx, first = np.arange(len(s)), int(order[0])
        if self.uncertainty == "product":
            if s.min() < 0:
                raise SelectionError(f"k_center: uncertainty='product' needs scores >= 0, got minimum {s.min():.4g}")
            weights = s * s  # min-distances are squared, so argmax of d^2 s^2 = argmax of d s
        if costs is not None:
            inv = 1.0 / np.square(np.asarray(costs, dtype=np.float64))
            weights = inv if weights is None else weights * inv
        if weights is not None:
            weights = weights[idx]
        sub = e if len(idx) == len(e) else e[idx]  # no copy of the whole pool
        first = None if lab is not None else first
        if len(sub) >= BLOCKED_MIN:
            with threadpool_limits(1, user_api="blas"):  # block-sized GEMMs: see k_center_greedy
                picks, self.info = BlockedRows(sub, seed=seed).k_center(k, centers=lab, first=first, weights=weights)
        else:
            picks, self.info = k_center_greedy(sub, k, centers=lab, first=first, weights=weights), {}
        return idx[picks]


class ClusterMargin(Selector):
    """Cluster-Margin (Citovsky et al. 2021): uncertainty first, then spread across clusters.

    All candidates are clustered with seeded faiss k-means (the paper uses average-linkage HAC, which is quadratic
    in memory; k-means scales to 100k+ pools and gives the same kind of partition). The top `margin_factor * k`
    candidates by score are grouped by cluster; clusters are visited smallest first (ties: the one holding the
    higher score first), taking the most uncertain remaining candidate of each, round after round, until k.
    `n_clusters` defaults to sqrt(n); k-means trains on `max_points_per_centroid` rows per cluster, which is plenty
    for a partition that only spreads picks and keeps 100k x 384 under ~1 s.
    """

    name = "cluster_margin"

    def __init__(
        self, n_clusters: int | None = None, margin_factor: int = 10, niter: int = 20, max_points_per_centroid: int = 32
    ) -> None:
        super().__init__()
        if n_clusters is not None and n_clusters < 1:
            raise SelectionError(f"cluster_margin: n_clusters must be >= 1, got {n_clusters}")
        if margin_factor < 1:
            raise SelectionError(f"cluster_margin: margin_factor must be >= 1, got {margin_factor}")
        self.n_clusters, self.margin_factor, self.niter = n_clusters, margin_factor, niter
        self.max_points_per_centroid = max_points_per_centroid

    def select(self, k, *, scores, embeddings=None, predicted=None, seed, labeled_embeddings=None):
        s = self._scores(k, scores)
        e = check_embeddings(embeddings, len(s), self.name)
        n = len(s)
        nc = min(n, self.n_clusters or max(1, round(n**0.5)))
        labels = kmeans_labels(e, nc, seed=seed, niter=self.niter, max_points_per_centroid=self.max_points_per_centroid)
        top = rank(s, seed=seed)[: min(n, self.margin_factor * k)]
        g = labels[top]
        size = np.bincount(g, minlength=nc)
        first_seen = np.full(nc, len(top))
        np.minimum.at(first_seen, g, np.arange(len(top)))
        turn = np.empty(nc, dtype=np.int64)
        turn[np.lexsort((first_seen, size))] = np.arange(nc)
        return top[_order_round_robin(g, _within_rank(g), turn)[:k]]


class Stratified(Selector):
    """Most uncertain per predicted class.

    allocation="even" gives every class the same share (water-filling: a class with too few candidates passes its
    surplus on), which counters the class imbalance active learning tends to amplify; "proportional" follows the
    classes' frequencies among the candidates (largest-remainder rounding). Leftover slots go to classes in the order
    of their most uncertain candidate. Picks are returned in score order.
    """

    name = "stratified"

    def __init__(self, allocation: Literal["even", "proportional"] = "even") -> None:
        super().__init__()
        if allocation not in ("even", "proportional"):
            raise SelectionError(f"stratified: allocation must be 'even' or 'proportional', got {allocation!r}")
        self.allocation = allocation

    def select(self, k, *, scores, embeddings=None, predicted=None, seed, labeled_embeddings=None):
        s = self._scores(k, scores)
        if predicted is None:
            raise SelectionError("stratified: needs the predicted class of every candidate (predicted=[n])")
        p = np.asarray(predicted)
        if p.shape != s.shape:
            raise SelectionError(f"stratified: predicted must have shape {s.shape} like the scores, got {p.shape}")
        order = rank(s, seed=seed)
        _, cls = np.unique(p, return_inverse=True)
        cls = cls.ravel()
        counts = np.bincount(cls)
        nc = len(counts)
        first_seen = np.full(nc, len(s))
        np.minimum.at(first_seen, cls[order], np.arange(len(s)))
        pref = np.argsort(first_seen, kind="stable")  # classes by their most uncertain candidate
        quota = self._allocate(k, counts, pref)
        within = _within_rank(cls[order])
        chosen = order[within < quota[cls[order]]]
        return chosen

    def _allocate(self, k: int, counts: np.ndarray, pref: np.ndarray) -> np.ndarray:
        quota = np.zeros(len(counts), dtype=np.int64)
        if self.allocation == "proportional":
            exact = k * counts / counts.sum()
            quota = np.floor(exact).astype(np.int64)
            frac = (exact - quota)[pref]
            extra = pref[np.argsort(-frac, kind="stable")][: k - quota.sum()]
            quota[extra] += 1
            return quota
        left = k
        while left:
            open_ = pref[quota[pref] < counts[pref]]
            share = left // len(open_)
            if share == 0:
                quota[open_[:left]] += 1
                break
            add = np.minimum(share, counts[open_] - quota[open_])
            quota[open_] += add
            left -= int(add.sum())
        return quota


class Typical(Selector):
    """Cold start without labels (TypiClust, Hacohen et al. 2022): k-means into k clusters, then the most typical
    member of each, typicality = 1 / mean distance to its `n_neighbors` nearest neighbours inside the cluster.

    Scores are not used. Clusters larger than `max_cluster_points` have typicality measured on a seeded sample of
    that many members (the pairwise distances are quadratic in cluster size). If k-means leaves a cluster empty, the
    remaining picks are the next most typical members of the largest clusters.
    """

    name = "typical"
    needs_scores = False
    cost_use = "none"  # one pick per k-means cluster: no gain to divide by a cost

    def __init__(self, n_neighbors: int = 20, max_cluster_points: int = 2000, niter: int = 20) -> None:
        super().__init__()
        if n_neighbors < 1 or max_cluster_points < 2:
            raise SelectionError(
                f"typical: need n_neighbors >= 1 and max_cluster_points >= 2, got {n_neighbors}, {max_cluster_points}"
            )
        self.n_neighbors, self.max_cluster_points, self.niter = n_neighbors, max_cluster_points, niter

    def select(self, k, *, scores, embeddings=None, predicted=None, seed, labeled_embeddings=None):
        s = self._scores(k, scores)
        e = check_embeddings(embeddings, len(s), self.name)
        labels = kmeans_labels(e, k, seed=seed, niter=self.niter)
        rng = np.random.default_rng(seed)
        typ = np.full(len(s), -np.inf)
        for c in np.unique(labels):
            members = np.flatnonzero(labels == c)
            if len(members) > self.max_cluster_points:
                members = np.sort(rng.choice(members, self.max_cluster_points, replace=False))
            typ[members] = self._typicality(e[members])
        size = np.bincount(labels, minlength=k)
        turn = np.empty(k, dtype=np.int64)
        turn[np.lexsort((np.arange(k), -size))] = np.arange(k)
        # Members in typicality order (ties by index), then round-robin over clusters, largest first.
        pref = np.lexsort((np.arange(len(s)), -typ))
        g = labels[pref]
        return pref[_order_round_robin(g, _within_rank(g), turn)[:k]]

    def _typicality(self, x: np.ndarray) -> np.ndarray:
        m = len(x)
        if m == 1:
            return np.ones(1)
        xsq = sqnorms(x)
        d2 = xsq[:, None] + xsq[None, :] - 2.0 * (x @ x.T)
        np.fill_diagonal(d2, np.inf)
        nn = min(self.n_neighbors, m - 1)
        near = np.sqrt(np.maximum(np.partition(d2, nn - 1, axis=1)[:, :nn], 0.0))
        return 1.0 / (near.mean(axis=1, dtype=np.float64) + 1e-12)
