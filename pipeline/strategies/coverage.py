"""Coverage selectors for low budgets and cold starts: TypiClust, ProbCover, MaxHerding, and Uncertainty Herding,
which weights MaxHerding's coverage by the model's uncertainty and so moves from coverage to uncertainty by itself.

All three pick candidates that represent dense, not yet covered regions of the embedding space; model scores are
ignored (only validated), so they work before any model exists. Labeled embeddings count as already covered.
The union of candidates and labeled points is the set whose coverage is measured; only candidates are picked.

Neighbourhoods stay near-linear at pool scale (see Blocks): up to `_EXACT_MAX` points every distance is computed;
above, the points are split into ~sqrt(N) k-means blocks and each block searches only its `_PROBE` nearest blocks
(by centroid) with exact float32 GEMMs. On the 100k x 384 benchmark mixture that is 2e8 distance pairs instead of
1e10, and it finds 99.97 % of the true 50 nearest neighbours in ~3 s on 2 busy cores; faiss IVF-Flat with as many
lists and nprobe 4 took 12 s for 98.5 %. On a mixture of 2,000 small clusters 95 % of the 10 nearest are found.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Any, ClassVar

import faiss
import numpy as np
import scipy.sparse as sp
from threadpoolctl import threadpool_limits

from pipeline.errors import SelectionError
from pipeline.strategies.base import BLOCK, Selector, check_embeddings, faiss_threads, kmeans_labels, sqnorms

_EXACT_MAX = 8192  # points; up to here neighbourhoods are exact (one block)
_PROBE = 6  # blocks each block searches, itself included
_REACH = 1.5  # ... unless they hold more than this many times `_PROBE` mean blocks' rows
_SMALL = 2048  # points; smaller sets run faiss on one thread
_LAZY_BATCH = 16  # MaxHerding: stale gains refreshed per step (one vectorised gather instead of 16 Python steps)
# MaxHerding's points at most (candidates + labeled): 10k picks from 500k x 128 take ~40 s and ~3 GB here.
MAX_HERDING_POINTS = 500_000


def _labeled(lab: np.ndarray | None, d: int, who: str) -> np.ndarray:
    """Labeled embeddings as float32 [m, d]; m may be 0."""
    if lab is None or len(lab) == 0:
        return np.empty((0, d), dtype=np.float32)
    e = np.asarray(lab)
    if e.ndim != 2 or e.shape[1] != d:
        raise SelectionError(f"{who}: labeled embeddings must have shape [m, {d}] like the candidates, got {e.shape}")
    e = np.ascontiguousarray(e, dtype=np.float32)
    if not np.isfinite(e).all():
        raise SelectionError(f"{who}: labeled embeddings contain NaN/inf; rescore the labeled set")
    return e


class Blocks:
    """Approximate neighbourhoods of every row of `x` via k-means blocks (exact up to `exact_max` rows).

    `near(row)` gives the rows a pick can cover (its block's probe set) with squared distances; `knn(k)` each row's
    k nearest other rows, searched within its block's probe set. Blocks are seeded, so results are deterministic.
    Rows are kept sorted by block, so a block is a contiguous slice and `near` multiplies without gathering.
    """

    def __init__(
        self,
        x: np.ndarray,
        *,
        seed: int,
        probe: int = _PROBE,
        reach: float = _REACH,
        exact_max: int | None = None,
    ) -> None:
        n = len(x)
        if n <= (_EXACT_MAX if exact_max is None else exact_max):
            labels, nearest = np.zeros(n, dtype=np.int64), [np.zeros(1, dtype=np.int64)]
        else:
            labels = kmeans_labels(
                x, max(2, round(n**0.5)), seed=seed, niter=10, max_points_per_centroid=32, threads=_threads(n)
            )
            _, labels = np.unique(labels, return_inverse=True)  # drop empty clusters
            labels = labels.ravel()
        counts = np.bincount(labels)
        self.order = np.argsort(labels, kind="stable")
        self.bounds = np.r_[0, np.cumsum(counts)]
        self.xs = x if len(counts) == 1 else x[self.order]
        self.sqs = sqnorms(self.xs)
        if len(counts) > 1:
            cent = np.add.reduceat(self.xs, self.bounds[:-1]) / counts[:, None].astype(np.float32)
            csq = sqnorms(cent)
            cd = csq[:, None] + csq[None, :] - 2.0 * (cent @ cent.T)
            np.fill_diagonal(cd, -np.inf)  # a block always searches itself
            ranked = np.argsort(cd, axis=1, kind="stable")
            # Probe blocks nearest first while the rows searched stay under `probe` mean blocks' worth: in high
            # dimensions k-means makes a few hub blocks (8,000 rows of 100k x 384 with 2,000 true clusters), and
            # hubs probing hubs cost 10x the search time.
            cap = reach * probe * n / len(counts)
            within = np.cumsum(counts[ranked], axis=1) <= cap
            within[:, 0] = True
            within[:, probe:] = False
            nearest = [row[ok] for row, ok in zip(ranked, within, strict=True)]
        self.block, self.probe = labels, nearest
        self.pos = np.empty(n, dtype=np.int64)  # row -> position in xs
        self.pos[self.order] = np.arange(n)

    def _slices(self, b: int) -> list[slice]:
        return [slice(self.bounds[p], self.bounds[p + 1]) for p in self.probe[b]]

    def reach(self, b: int) -> np.ndarray:
        """Rows in block b's probe set (block order)."""
        return np.concatenate([self.order[s] for s in self._slices(b)])

    def near(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows in `row`'s probe set and their squared distances to it."""
        p = self.pos[row]
        v, vsq = self.xs[p], self.sqs[p]
        sl = self._slices(self.block[row])
        d2 = np.concatenate([self.sqs[s] - 2.0 * (self.xs[s] @ v) for s in sl])
        d2 += vsq
        return np.concatenate([self.order[s] for s in sl]), np.maximum(d2, 0.0)

    def near_many(self, rows: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """`near` for many rows, one GEMM per block: (rows of that block, probe set, squared distances)."""
        rows = np.asarray(rows, dtype=np.int64)
        for b in np.unique(self.block[rows]):
            mine = rows[self.block[rows] == b]
            c = self.reach(b)
            xc, csq = self.xs[self.pos[c]], self.sqs[self.pos[c]]
            for s in range(0, len(mine), BLOCK):
                q = mine[s : s + BLOCK]
                d2 = self.xs[self.pos[q]] @ xc.T
                d2 *= -2.0
                d2 += csq[None, :]
                d2 += self.sqs[self.pos[q]][:, None]
                yield q, c, np.maximum(d2, 0.0)

    def knn(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Each row's k nearest other rows: (squared distances [n, k] ascending, rows [n, k]); -1/inf if fewer."""
        n = len(self.xs)
        dist = np.full((n, k), np.inf, dtype=np.float32)
        idx = np.full((n, k), -1, dtype=np.int64)
        if k == 0:
            return dist, idx
        with faiss_threads(_threads(n)):
            self._knn_into(dist, idx, k)
        return dist, idx

    def _knn_into(self, dist: np.ndarray, idx: np.ndarray, k: int) -> None:
        for b in range(len(self.probe)):
            lo, hi = self.bounds[b], self.bounds[b + 1]
            q = self.order[lo:hi]
            sl = self._slices(b)
            xc = self.xs[sl[0]] if len(sl) == 1 else np.concatenate([self.xs[s] for s in sl])
            c = self.reach(b)
            kk = min(k + 1, len(c))
            d, i = faiss.knn(self.xs[lo:hi], xc, kk)
            i = c[i]
            drop = i == q[:, None]
            drop[~drop.any(axis=1), kk - 1] = True  # self not found (duplicates): drop the farthest instead
            dist[q, : kk - 1] = np.maximum(d[~drop].reshape(len(q), kk - 1), 0.0)
            idx[q, : kk - 1] = i[~drop].reshape(len(q), kk - 1)


def _threads(n: int) -> int | None:
    """faiss threads for n points: one for small sets. Their k-means and searches are many tiny parallel regions,
    and with the cores busy elsewhere OpenMP's spinning barriers made a 300-point TypiClust take seconds."""
    return 1 if n <= _SMALL else None


def _points(sel: Selector, k: int, scores: Any, embeddings: Any, labeled: Any) -> tuple[np.ndarray, int]:
    """Candidates then labeled rows as one float32 matrix, and the number of candidates."""
    s = sel._scores(k, scores)
    e = check_embeddings(embeddings, len(s), sel.name)
    lab = _labeled(labeled, e.shape[1], sel.name)
    return (np.concatenate([e, lab]) if len(lab) else e), len(e)


class TypiClust(Selector):
    """TypiClust (Hacohen et al. 2022): the most typical candidate of each large cluster no labeled point covers.

    Candidates and labeled points are clustered with seeded k-means into min(|labeled| + k, `max_clusters`, N)
    clusters, keeping the best of `n_init` runs. By default that is 10 (scikit-learn's long-time KMeans default)
    while k-means trains on <= 1e6 row x cluster pairs, else 1 (one run of 100k x 500 clusters takes seconds):
    single runs often merged two blobs when sparse outliers drew k-means++ seeds. Typicality = 1 / mean distance to
    the `n_neighbors` nearest neighbours over the whole set (the paper's kNN density; the authors' code measures it
    inside the cluster). Each pick takes the largest cluster not yet
    holding a labeled or picked point, skipping clusters under `min_cluster_size` points (the paper drops them as
    outliers), and its most typical unpicked candidate. When such clusters run out, the cluster with the largest
    size / (1 + labeled and picked points in it) is visited next, so big clusters get more picks.
    """

    name = "typiclust"
    needs_scores = False
    cost_use = "own"  # in the cluster it visits, the member of largest typicality / ĉ_i

    def __init__(
        self,
        n_neighbors: int = 20,
        max_clusters: int = 500,
        min_cluster_size: int = 5,
        niter: int = 20,
        n_init: int | None = None,
    ) -> None:
        super().__init__()
        if min(n_neighbors, max_clusters, min_cluster_size, niter, 1 if n_init is None else n_init) < 1:
            raise SelectionError(
                "typiclust: n_neighbors, max_clusters, min_cluster_size, niter and n_init must be >= 1, got "
                f"{n_neighbors}, {max_clusters}, {min_cluster_size}, {niter}, {n_init}"
            )
        self.n_neighbors, self.max_clusters = n_neighbors, max_clusters
        self.min_cluster_size, self.niter, self.n_init = min_cluster_size, niter, n_init

    def select(self, k, *, scores, embeddings=None, predicted=None, seed, labeled_embeddings=None, costs=None):
        x, n = _points(self, k, scores, embeddings, labeled_embeddings)
        cost = np.ones(n) if costs is None else np.asarray(costs, dtype=np.float64)
        big_n = len(x)
        nc = min(big_n - n + k, self.max_clusters, big_n)
        n_init = self.n_init or (10 if min(big_n, 64 * nc) * nc <= 1_000_000 else 1)
        with faiss_threads(_threads(big_n)):
            labels = kmeans_labels(
                x, nc, seed=seed, niter=self.niter, max_points_per_centroid=32, nredo=n_init, threads=_threads(big_n)
            )
            dist, idx = Blocks(x, seed=seed).knn(min(self.n_neighbors, big_n - 1))
        ok = idx >= 0
        mean = np.where(ok, np.sqrt(dist, where=ok, out=np.zeros_like(dist)), 0.0).sum(1, dtype=np.float64)
        mean /= np.maximum(ok.sum(1), 1)
        typ = 1.0 / (mean + 1e-12)
        size = np.bincount(labels, minlength=nc)
        taken = np.bincount(labels[n:], minlength=nc)  # labeled and picked points per cluster
        # Candidates grouped by cluster, most typical first (ties: lower index).
        pref = np.lexsort((np.arange(n), -typ[:n] / cost, labels[:n]))
        avail = np.bincount(labels[:n], minlength=nc)
        start = np.r_[0, np.cumsum(avail)[:-1]]
        bonus = float(big_n + 1)  # uncovered large clusters outrank every size / (1 + taken) <= N

        def key(c: np.ndarray) -> np.ndarray:
            fresh = (taken[c] == 0) & (size[c] >= self.min_cluster_size)
            return np.where(avail[c] == 0, -np.inf, np.where(fresh, size[c] + bonus, size[c] / (1.0 + taken[c])))

        keys = key(np.arange(nc))
        picks = np.empty(k, dtype=np.int64)
        fresh_picks = 0
        for t in range(k):
            c = int(np.argmax(keys))
            fresh_picks += bool(keys[c] >= bonus)
            picks[t] = pref[start[c]]
            start[c] += 1
            avail[c] -= 1
            taken[c] += 1
            keys[c] = key(np.array([c]))[0]
        self.info = {
            "n_clusters": nc,
            "clusters_with_labeled": int((np.bincount(labels[n:], minlength=nc) > 0).sum()),
            "picks_in_uncovered_clusters": fresh_picks,
            "n_neighbors": int(dist.shape[1]),
            "n_init": n_init,
        }
        return picks


class ProbCover(Selector):
    """ProbCover (Yehuda et al. 2022): greedy max coverage of δ-balls over candidates and labeled points.

    Each pick is the candidate whose δ-ball holds the most uncovered points; the ball's points become covered
    (labeled points cover theirs from the start). δ is `radius` if given, else the paper's purity heuristic: the set
    is split into `n_classes` k-means clusters (pass the number of answers/classes of the task), a δ-ball is pure
    when it holds only points of its centre's cluster, and δ is the largest radius whose purity over a seeded sample
    of `purity_sample` centres is >= `purity` (the candidate grid is every sampled centre's distance to its
    nearest other-cluster point, so the choice is exact for the sample).

    Scale: degrees are counted in each point's `n_neighbors` nearest neighbours (see Blocks), so a ball holding
    more points saturates at n_neighbors + 1; saturated ties go to the candidate whose n_neighbors-th neighbour is
    nearest (the densest). Covering after a pick is exact within the pick's probe blocks. Once every point is
    covered the remaining picks are drawn seeded-uniformly from the unpicked candidates (coverage cannot rank them).
    """

    name = "probcover"
    wants = ("n_classes",)  # the task's class count sets the purity clusters (ProbCover's δ heuristic)
    needs_scores = False
    cost_use = "own"  # argmax of newly covered points / ĉ_i

    def __init__(
        self,
        radius: float | None = None,
        n_classes: int = 10,
        purity: float = 0.95,
        n_neighbors: int = 50,
        purity_sample: int = 1000,
        niter: int = 20,
    ) -> None:
        super().__init__()
        if radius is not None and not (np.isfinite(radius) and radius >= 0):
            raise SelectionError(f"probcover: radius must be a finite number >= 0, got {radius}")
        if n_classes < 2 or not 0 < purity <= 1 or n_neighbors < 1 or purity_sample < 1 or niter < 1:
            raise SelectionError(
                "probcover: need n_classes >= 2, 0 < purity <= 1, n_neighbors, purity_sample, niter >= 1; got "
                f"{n_classes}, {purity}, {n_neighbors}, {purity_sample}, {niter}"
            )
        self.radius, self.n_classes, self.purity = radius, n_classes, purity
        self.n_neighbors, self.purity_sample, self.niter = n_neighbors, purity_sample, niter

    def purity_radius(self, x: np.ndarray, *, seed: int) -> tuple[float, float]:
        """(largest δ with sampled purity >= target, that purity)."""
        big_n = len(x)
        if big_n < 2:
            return 0.0, 1.0
        # Few clusters: ten k-means runs cost little and avoid one run's bad split.
        labels = kmeans_labels(
            x, min(self.n_classes, big_n), seed=seed, niter=self.niter, nredo=10, threads=_threads(big_n)
        )
        rng = np.random.default_rng(seed)
        sample = np.sort(rng.choice(big_n, min(self.purity_sample, big_n), replace=False))
        xs, ssq = x[sample], sqnorms(x[sample])
        out = np.full(len(sample), np.inf, dtype=np.float32)
        far = np.full(len(sample), -np.inf, dtype=np.float32)
        xsq = sqnorms(x)
        for j in range(0, big_n, 8 * BLOCK):
            g = xs @ x[j : j + 8 * BLOCK].T
            g *= -2.0
            g += xsq[None, j : j + 8 * BLOCK]
            np.maximum(far, g.max(axis=1), out=far)
            g[labels[sample][:, None] == labels[None, j : j + 8 * BLOCK]] = np.inf
            np.minimum(out, g.min(axis=1), out=out)
        d_out = np.sort(np.sqrt(np.maximum(out + ssq, 0.0)))
        # purity(δ) = share of sampled centres with d_out > δ; up to q of them may have d_out <= δ.
        q = min(int(np.floor((1.0 - self.purity) * len(d_out) + 1e-9)), len(d_out) - 1)
        if np.isfinite(d_out[q]):
            delta = max(float(np.nextafter(d_out[q], np.float32(0))), 0.0)
        else:  # k-means found a single cluster (e.g. duplicates): every ball is pure, one reaches everything
            delta = float(np.sqrt(max(float((far + ssq).max()), 0.0)))
        return delta, float((d_out > delta).mean())

    def select(self, k, *, scores, embeddings=None, predicted=None, seed, labeled_embeddings=None, costs=None):
        x, n = _points(self, k, scores, embeddings, labeled_embeddings)
        cost = np.ones(n) if costs is None else np.asarray(costs, dtype=np.float64)
        big_n = len(x)
        with faiss_threads(_threads(big_n)):
            if self.radius is None:
                delta, purity = self.purity_radius(x, seed=seed)
            else:
                delta, purity = float(self.radius), None
            blocks = Blocks(x, seed=seed)
            dist, idx = blocks.knn(min(self.n_neighbors, big_n - 1))
        # One pick at a time is small BLAS work: one thread (see k_center_greedy).
        with threadpool_limits(1, user_api="blas"):
            r2 = np.float32(delta) ** 2
            inside = (idx >= 0) & (dist <= r2)
            # Who counts whom: owner i (a candidate) counts row j when j is among i's neighbours within δ;
            # row j of this CSR lists j's owners.
            owner = np.repeat(np.arange(n), dist.shape[1]).reshape(n, dist.shape[1])[inside[:n]]
            counts = sp.csr_array(
                (np.ones(len(owner), dtype=np.int8), (idx[:n][inside[:n]], owner)), shape=(big_n, max(n, 1))
            )
            ptr, owners_of = counts.indptr, counts.indices
            # Saturated degrees tie; the denser candidate (nearer last neighbour) goes first.
            far = np.where(idx[:n, -1] >= 0, dist[:n, -1], np.inf) if dist.shape[1] else np.zeros(n)
            dense = np.empty(n)
            dense[np.lexsort((np.arange(n), far))] = np.arange(n)[::-1] / (n + 1.0)
            key = 1.0 + inside[:n].sum(axis=1) + dense  # +1: a candidate covers itself
            covered = np.zeros(big_n, dtype=bool)

            def cover(rows: np.ndarray) -> None:
                new = np.unique(rows[~covered[rows]])
                if not len(new):
                    return
                covered[new] = True
                lens = ptr[new + 1] - ptr[new]
                at = np.repeat(ptr[new] - np.r_[0, np.cumsum(lens)[:-1]], lens) + np.arange(lens.sum())
                np.subtract.at(key, owners_of[at], 1.0)
                key[new[new < n]] -= 1.0

            if big_n > n:
                for q, c, d2 in blocks.near_many(np.arange(n, big_n)):
                    cover(np.concatenate([q, c[np.nonzero(d2 <= r2)[1]]]))
            covered_by_labeled = float(covered.mean())
            picks: list[int] = []
            while len(picks) < k:
                ratio = np.where(key >= 1.0, key / cost, -np.inf)  # key < 1: covers nothing new
                c = int(np.argmax(ratio))
                if key[c] < 1.0:  # degree 0 everywhere: all covered
                    break
                picks.append(c)
                rows, d2 = blocks.near(c)
                cover(np.r_[c, rows[d2 <= r2]])
                key[c] = -np.inf
        greedy = len(picks)
        if greedy < k:
            rest = np.setdiff1d(np.arange(n), picks)
            picks.extend(np.random.default_rng(seed).permutation(rest)[: k - greedy].tolist())
        self.info = {
            "radius": delta,
            "purity": purity,
            "purity_target": self.purity if self.radius is None else None,
            "n_classes": self.n_classes if self.radius is None else None,
            "covered_by_labeled": covered_by_labeled,
            "coverage": float(covered.mean()),
            "greedy_picks": greedy,
            "random_picks": k - greedy,
            "saturated": float(inside[:n].all(axis=1).mean()) if n and inside.shape[1] else 0.0,
        }
        return np.asarray(picks, dtype=np.int64)


class MaxHerding(Selector):
    """MaxHerding (Bae et al. 2024): greedy maximisation of generalized coverage with a Gaussian kernel.

    C(S) = (1/N) Σ_i max_{s∈S∪labeled} k(x_i, x_s), k(x, y) = exp(-||x - y||² / (2σ²)); each pick is the candidate
    with the largest gain Σ_i max(0, k(x_i, x_c) - cur_i). σ = `bandwidth` if given, else the median distance of
    every point to its `bandwidth_neighbors`-th nearest neighbour (a local scale that adapts to the embedding
    space). Gains are summed over the kernel graph of each point's `n_neighbors` nearest neighbours (symmetrised;
    the kernel is taken as 0 beyond), while cur is updated exactly over the pick's probe blocks (see Blocks), so a
    pick in a big dense region lowers the gains of all its points. Coverage is submodular, so gains only shrink and
    lazy greedy with a heap of stale upper bounds picks a candidate of maximal gain, as plain greedy would.

    Above `max_points` candidates + labeled, C is estimated on a seeded uniform sample of the candidates (every
    labeled point kept) and the picks come from that sample: an average over 5·10⁵ points estimates the pool's to
    ~1e-3, while the kernel graph of 10⁷ points would not fit here. `info["sampled"]` says so; σ then adapts to the
    sample's density. benchmarks/pool_scale.py measures the full pool's coverage against random picks at 10⁷.
    """

    name = "maxherding"
    # Its gain is an average over the candidates it is given (Uncertainty Herding's too): a uniform sample keeps
    # that average the pool's, where the labeled set's neighbours and cluster centres would skew it. On the digits
    # (probe, 5 paired seeds, 200 candidates of 1,346), Uncertainty Herding needed 0.554× random's labels to 95 %
    # with the neighbours/clusters/random sources, 0.46× with a uniform sample, 0.432× [0.364, 0.471] scoring all
    # (benchmarks/results/label_efficiency.json `candidates_check`, docs/selection.md).
    candidate_shares: ClassVar[dict[str, float]] = {"random": 1.0}
    needs_scores = False
    cost_use = "own"  # argmax of marginal coverage gain / ĉ_i (still lazy greedy: gains only shrink, ĉ is fixed)

    def __init__(
        self,
        bandwidth: float | None = None,
        n_neighbors: int = 50,
        bandwidth_neighbors: int = 10,
        max_points: int = MAX_HERDING_POINTS,
    ) -> None:
        super().__init__()
        if bandwidth is not None and not (np.isfinite(bandwidth) and bandwidth > 0):
            raise SelectionError(f"maxherding: bandwidth must be a finite number > 0, got {bandwidth}")
        if n_neighbors < 1 or bandwidth_neighbors < 1:
            raise SelectionError(
                f"maxherding: n_neighbors and bandwidth_neighbors must be >= 1, got {n_neighbors}, {bandwidth_neighbors}"
            )
        if max_points < 2:
            raise SelectionError(f"maxherding: max_points must be >= 2, got {max_points}")
        self.bandwidth, self.n_neighbors, self.bandwidth_neighbors = bandwidth, n_neighbors, bandwidth_neighbors
        self.max_points = max_points

    def select(self, k, *, scores, embeddings=None, predicted=None, seed, labeled_embeddings=None, costs=None):
        s = self._scores(k, scores)
        e = check_embeddings(embeddings, len(s), self.name, keep_float16=True)
        lab = _labeled(labeled_embeddings, e.shape[1], self.name)
        cost = np.ones(len(e)) if costs is None else np.asarray(costs, dtype=np.float64)
        # Coverage is a pool average, so above `max_points` it is estimated on a seeded uniform sample of the
        # candidates (the labeled points stay whole: they are covered, so they only lower the sample's gains).
        keep = None
        if len(e) + len(lab) > self.max_points:
            size = min(len(e), max(k, self.max_points - len(lab)))
            keep = np.sort(np.random.default_rng(seed).choice(len(e), size=size, replace=False))
            e, cost = e[keep], cost[keep]
        e = np.ascontiguousarray(e, dtype=np.float32)
        x, n = (np.concatenate([e, lab]) if len(lab) else e), len(e)
        weight = self._weights(s if keep is None else s[keep], len(lab))
        picks = self._herd(x, n, k, cost, seed, weight)
        if keep is not None:
            self.info["sampled"] = {"candidates": len(s), "kept": len(keep), "rate": round(len(keep) / len(s), 6)}
            picks = keep[picks]
        return picks

    def _weights(self, scores: np.ndarray, n_labeled: int) -> np.ndarray | None:
        """Each point's weight in the coverage it gains (None: all equal, MaxHerding's plain coverage)."""
        return None

    def _herd(self, x: np.ndarray, n: int, k: int, cost: np.ndarray, seed: int,
              weight: np.ndarray | None = None) -> np.ndarray:
        big_n = len(x)
        with faiss_threads(_threads(big_n)):
            blocks = Blocks(x, seed=seed)
            m = min(max(self.n_neighbors, self.bandwidth_neighbors), big_n - 1)
            dist, idx = blocks.knn(m)
        with threadpool_limits(1, user_api="blas"):
            sigma = self.bandwidth or self._bandwidth(dist, idx)
            gamma = 1.0 / (2.0 * sigma * sigma)
            nn = min(self.n_neighbors, m)
            ok = idx[:, :nn] >= 0
            rows = np.r_[np.repeat(np.arange(big_n), nn)[ok.ravel()], np.arange(big_n)]
            cols = np.r_[idx[:, :nn][ok], np.arange(big_n)]
            w = np.r_[np.exp(-gamma * dist[:, :nn][ok]), np.ones(big_n, dtype=np.float32)]
            a = sp.csr_matrix((w.astype(np.float64), (rows, cols)), shape=(big_n, big_n))
            a = a.maximum(a.T).tocsr()
            a.sort_indices()
            ptr, nbr, val = a.indptr, a.indices, a.data
            cur = np.zeros(big_n)

            def absorb(rows_: np.ndarray, d2: np.ndarray) -> None:
                np.maximum.at(cur, rows_, np.exp(-gamma * d2.astype(np.float64)))

            if big_n > n:
                for q, c, d2 in blocks.near_many(np.arange(n, big_n)):
                    absorb(np.tile(c, len(q)), d2.ravel())
                cur[n:] = 1.0

            def gains(rows: np.ndarray) -> np.ndarray:
                lens = ptr[rows + 1] - ptr[rows]  # >= 1: every row holds its self-loop
                at = np.repeat(ptr[rows] - np.r_[0, np.cumsum(lens)[:-1]], lens) + np.arange(lens.sum())
                gain = np.maximum(val[at] - cur[nbr[at]], 0.0)
                if weight is not None:
                    gain *= weight[nbr[at]]
                return np.add.reduceat(gain, np.r_[0, np.cumsum(lens)[:-1]])

            heap = [(-float(g), i) for i, g in enumerate(gains(np.arange(n)) / cost)]
            heapq.heapify(heap)
            picks: list[int] = []
            evals = 0
            while len(picks) < k:
                # Refresh the top few bounds at once; the best fresh gain wins once no stale bound exceeds it.
                top = np.array([heapq.heappop(heap)[1] for _ in range(min(_LAZY_BATCH, len(heap)))])
                g = gains(top) / cost[top]
                evals += len(top)
                best = int(np.lexsort((top, -g))[0])
                won = not heap or g[best] >= -heap[0][0]
                for j, (gj, c) in enumerate(zip(g.tolist(), top.tolist(), strict=True)):
                    if not (won and j == best):
                        heapq.heappush(heap, (-gj, c))
                if won:
                    c = int(top[best])
                    picks.append(c)
                    near, d2 = blocks.near(c)
                    absorb(near, d2)
                    cur[c] = 1.0
        self.info = {
            "bandwidth": float(sigma),
            "bandwidth_rule": "given" if self.bandwidth else f"median distance to neighbour {self.bandwidth_neighbors}",
            "coverage": float(cur.mean()),
            **({} if weight is None else {"uncertainty_coverage": _weighted_mean(cur[:n], weight[:n])}),
            "gain_evaluations": evals,
            "n_neighbors": nn,
        }
        return np.asarray(picks, dtype=np.int64)

    def _bandwidth(self, dist: np.ndarray, idx: np.ndarray) -> float:
        """Median distance to the bandwidth_neighbors-th neighbour; 1.0 when that is undefined or zero."""
        if dist.shape[1] == 0:
            return 1.0
        j = min(self.bandwidth_neighbors, dist.shape[1]) - 1
        d = np.sqrt(dist[idx[:, j] >= 0, j])
        sigma = float(np.median(d)) if len(d) else 0.0
        if not sigma > 0:  # duplicates: fall back to the median positive neighbour distance
            pos = np.sqrt(dist[(idx >= 0) & (dist > 0)])
            sigma = float(np.median(pos)) if len(pos) else 1.0
        return sigma


def _weighted_mean(x: np.ndarray, w: np.ndarray) -> float:
    return float((x * w).sum() / max(float(w.sum()), 1e-12))


class UncertaintyHerding(MaxHerding):
    """Uncertainty Herding (Bae et al., ICLR 2025, arXiv 2412.20644): MaxHerding's greedy coverage, each covered
    point weighted by the model's uncertainty about it.

    UC(S) = (1/N) Σ_i U(x_i) max_{s∈S∪labeled} k(x_i, x_s); each pick is the candidate with the largest gain
    Σ_i U(x_i) max(0, k(x_i, x_c) - cur_i). U is the round's heuristic score (select.strategy, e.g. margin's
    1 - (p1 - p2)), scaled to [0, 1] by its maximum. While the model knows little, U is nearly flat and the picks
    are MaxHerding's (coverage of dense regions); as it learns, U concentrates near its decision boundaries and the
    picks become uncertain points that still cover their neighbourhoods, so no switch point has to be set. When every
    score is equal (or zero) U is uniform and this is MaxHerding exactly.

    The paper's choices and tamis's: the kernel is MaxHerding's Gaussian with its local-scale bandwidth (the median
    distance to the 10th neighbour; the paper adapts σ to the labeled set); U is the heuristic's score as given (the
    paper temperature-scales the softmax on held-out labels first; tamis's scores are those the round computed).
    benchmarks/label_efficiency.py measures these defaults against maxherding_margin's hand-set switch.
    """

    name = "uncertainty_herding"
    needs_scores = True

    def _weights(self, scores: np.ndarray, n_labeled: int) -> np.ndarray | None:
        s = np.maximum(np.asarray(scores, dtype=np.float64), 0.0)
        top = float(s.max()) if len(s) else 0.0
        if not top > 0 or float(s.min()) == top:  # no uncertainty signal: plain coverage
            self._flat = True
            return None
        self._flat = False
        # Labeled points are covered (cur = 1), so their weight never counts; 1 keeps the array whole.
        return np.r_[s / top, np.ones(n_labeled)]

    def select(self, k, *, scores, embeddings=None, predicted=None, seed, labeled_embeddings=None, costs=None):
        picks = super().select(k, scores=scores, embeddings=embeddings, predicted=predicted, seed=seed,
                               labeled_embeddings=labeled_embeddings, costs=costs)
        self.info["uncertainty"] = "uniform (scores all equal)" if self._flat else "heuristic score / max"
        return picks
