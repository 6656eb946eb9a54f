"""Greedy k-center over pools too big for a pass per pick: k-means blocks and triangle bounds.

At 10⁷ × 128 one pass over the pool reads 2.6 GB of float16 and costs 1.3e9 multiply-adds. Plain greedy k-center
makes one pass per pick (10⁴ picks: hours here), and the lazy form in selectors.k_center_greedy still ranks every
row's bound per pick and needs the pool as float32 in RAM (5 GB). Here the rows are grouped once into k-means blocks
of ~`BLOCK_ROWS` rows and copied block-contiguous in their own dtype (float16 stays float16). Each block keeps its
centroid μ, its radius R and each row's distance r to μ. A new centre c lowers a row's min-distance only where
‖x − c‖ < current; the triangle inequality gives ‖x − c‖ ≥ |r − ‖c − μ‖| ≥ ‖c − μ‖ − R, so a block whose bound
is above its largest min-distance is skipped unread, and inside a block only the rows whose own bound is below
their min-distance are read. The picks are the exact greedy's (selectors.k_center_greedy's, up to ties and float
rounding); the cost grows with the rows near each pick, not with the pool.

The blocks come from two-level k-means (√blocks coarse cells, then each cell split into blocks of its size), so
assigning every row costs n × (coarse + fine) distances instead of n × blocks: ~10 s for 10⁷ × 128 on 2 cores.
"""

from __future__ import annotations

import math

import faiss
import numpy as np

from pipeline.errors import SelectionError
from pipeline.strategies.base import faiss_threads, sqnorms

BLOCK_ROWS = 4096  # rows per block: big enough that a block's read is one GEMV, small enough to skip most of them
BLOCKED_MIN = 1_000_000  # rows; from here KCenter runs here (below, k_center_greedy's lazy dense form is faster)
_CHUNK = 262_144  # rows converted to float32 at a time while building (~130 MB at d = 128)
_TRAIN_PER_CENTROID = 64
_SEED_CENTRES = 16  # a block with no bound yet is first compared with its nearest centres


def _kmeans(x: np.ndarray, k: int, *, seed: int) -> faiss.Kmeans:
    """Seeded faiss k-means on at most `_TRAIN_PER_CENTROID` rows per centroid (a seeded subsample)."""
    km = faiss.Kmeans(x.shape[1], k, niter=10, seed=seed % (2**31), verbose=False,
                      max_points_per_centroid=_TRAIN_PER_CENTROID, min_points_per_centroid=1)
    km.train(x)
    return km


def _assign(km: faiss.Kmeans, x: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """Nearest centroid of every row of x (or of x[rows]), in float32 chunks."""
    n = len(x) if rows is None else len(rows)
    out = np.empty(n, dtype=np.int64)
    for s in range(0, n, _CHUNK):
        part = x[s : s + _CHUNK] if rows is None else x[rows[s : s + _CHUNK]]
        out[s : s + _CHUNK] = km.index.search(np.ascontiguousarray(part, dtype=np.float32), 1)[1][:, 0]
    return out


class BlockedRows:
    """The rows of an [n, d] matrix (in RAM or a np.memmap; float16 or float32) in k-means blocks, block-contiguous.

    `xs[i]` is row `order[i]` of the input; block b is `xs[bounds[b]:bounds[b + 1]]`. Memory: one copy of the rows
    in their dtype plus 20 bytes a row.
    """

    def __init__(self, x: np.ndarray, *, seed: int, block_rows: int = BLOCK_ROWS) -> None:
        if x.ndim != 2 or x.shape[1] == 0 or len(x) == 0:
            raise SelectionError(f"blocked k-center: embeddings must be [n, d] with n, d > 0, got shape {x.shape}")
        if block_rows < 1:
            raise SelectionError(f"blocked k-center: block_rows must be >= 1, got {block_rows}")
        n, d = x.shape
        self.n, self.d = n, d
        dtype = np.float16 if x.dtype == np.float16 else np.float32
        n_blocks = max(1, math.ceil(n / block_rows))
        n_coarse = max(1, min(n_blocks, round(math.sqrt(n_blocks))))
        rng = np.random.default_rng(seed)
        with faiss_threads():
            if n_coarse > 1:
                sample = np.sort(rng.choice(n, size=min(n, _TRAIN_PER_CENTROID * n_coarse), replace=False))
                coarse = _assign(_kmeans(np.ascontiguousarray(x[sample], dtype=np.float32), n_coarse, seed=seed), x)
            else:
                coarse = np.zeros(n, dtype=np.int64)
            by_cell = np.argsort(coarse, kind="stable")
            cell_bounds = np.r_[0, np.cumsum(np.bincount(coarse, minlength=n_coarse))]
            del coarse
            self.xs = np.empty((n, d), dtype=dtype)
            self.order = np.empty(n, dtype=np.int64)
            self.rad = np.empty(n, dtype=np.float32)  # each row's distance to its block's centroid
            self.xsq = np.empty(n, dtype=np.float32)
            cents, radii, bounds = [], [], [0]
            for c in range(n_coarse):
                rows = by_cell[cell_bounds[c] : cell_bounds[c + 1]]
                if not len(rows):
                    continue
                xc = np.ascontiguousarray(x[rows], dtype=np.float32)  # rows ascending: a forward read of a memmap
                k_fine = max(1, min(len(rows), math.ceil(len(rows) / block_rows)))
                if k_fine > 1:
                    sub = rng.choice(len(rows), size=min(len(rows), _TRAIN_PER_CENTROID * k_fine), replace=False)
                    fine = _assign(_kmeans(np.ascontiguousarray(xc[np.sort(sub)]), k_fine, seed=seed + c + 1), xc)
                else:
                    fine = np.zeros(len(rows), dtype=np.int64)
                within = np.argsort(fine, kind="stable")
                counts = np.bincount(fine, minlength=k_fine)
                lo = bounds[-1]
                xc = xc[within]
                self.xs[lo : lo + len(rows)] = xc.astype(dtype, copy=False)
                self.order[lo : lo + len(rows)] = rows[within]
                # Distances are measured on the stored rows (float16-rounded if so), as every later distance is.
                xq = self.xs[lo : lo + len(rows)].astype(np.float32)
                self.xsq[lo : lo + len(rows)] = sqnorms(xq)
                starts = np.r_[0, np.cumsum(counts)]
                for j in np.flatnonzero(counts):
                    blk = xq[starts[j] : starts[j + 1]]
                    mu = blk.mean(axis=0)
                    r = np.sqrt(np.maximum(sqnorms(blk - mu), 0.0))
                    self.rad[lo + starts[j] : lo + starts[j + 1]] = r
                    cents.append(mu)
                    radii.append(float(r.max()))
                    bounds.append(lo + int(starts[j + 1]))
        self.cent = np.asarray(cents, dtype=np.float32)
        self.radius = np.asarray(radii, dtype=np.float32)
        self.bounds = np.asarray(bounds, dtype=np.int64)

    @property
    def n_blocks(self) -> int:
        return len(self.cent)

    def k_center(
        self,
        k: int,
        *,
        centers: np.ndarray | None = None,
        first: int | None = None,
        weights: np.ndarray | None = None,
    ) -> tuple[np.ndarray, dict[str, float]]:
        """Greedy k-center picks (input row indices, pick order) and what the search read.

        Same contract as selectors.k_center_greedy: `centers` are already-labeled embeddings, else the first pick
        is input row `first`; `weights` scale the squared min-distances (argmax w_i · min_j ‖x_i − c_j‖²).
        """
        n = self.n
        if not 1 <= k <= n:
            raise SelectionError(f"blocked k-center: cannot pick {k} of {n} rows")
        n_lab = 0 if centers is None else len(centers)
        if n_lab == 0 and first is None:
            raise SelectionError("blocked k-center: needs labeled centres or a first pick")
        pos = np.empty(n, dtype=np.int64)
        pos[self.order] = np.arange(n)
        search = _Search(self, None if weights is None else np.asarray(weights, dtype=np.float32)[self.order],
                         capacity=n_lab + k)
        for c in np.asarray(centers if n_lab else np.empty((0, self.d)), dtype=np.float32):
            search.add(c)
        picks: list[int] = []
        if not n_lab:
            search.take(int(pos[first]))
            picks.append(int(first))
        while len(picks) < k:
            i = search.farthest()
            search.take(i)
            picks.append(int(self.order[i]))
        info: dict[str, float] = {
            "blocks": self.n_blocks,
            "block_updates": search.updates,
            # of the n x centres distances a greedy pass per pick computes
            "distance_share": round(search.pairs / (n * search.t), 4),
        }
        if weights is None and len(picks) < n:
            # The greedy's covering radius is the distance of the pick it would make next (settled lazily too).
            info["radius"] = float(math.sqrt(max(0.0, float(search.md[search.farthest()]))))
        return np.asarray(picks, dtype=np.int64), info

    def radius_of(self, centers: np.ndarray) -> float:
        """max_i min_j ‖x_i − c_j‖ over every row: the covering radius of `centers` (e.g. a random batch's)."""
        search = _Search(self, None, capacity=len(centers))
        for c in np.asarray(centers, dtype=np.float32):
            search.add(c)
        search.settle()
        return float(math.sqrt(max(0.0, float(search.bmax.max()))))


class _Search:
    """Lazy greedy at block granularity: each block's rows hold their exact min squared distance to the first
    `stamp[b]` centres, so the block's largest key is an upper bound of its true one (bounds only fall as centres
    are added). The block of largest bound is brought up to date against the centres added since (one GEMM, minus
    the centres its triangle bound rules out); once the top block is up to date its best row is the exact argmax."""

    def __init__(self, rows: BlockedRows, weights: np.ndarray | None, capacity: int) -> None:
        self.r = rows
        self.w = weights
        self.md = np.full(rows.n, np.inf, dtype=np.float32)
        self.taken = np.zeros(rows.n, dtype=bool)
        self.bmax = np.full(rows.n_blocks, np.inf, dtype=np.float32)  # largest md in the block (for the bound)
        self.bkey = np.full(rows.n_blocks, np.inf, dtype=np.float64)  # largest pickable key (w · md) in the block
        self.stamp = np.zeros(rows.n_blocks, dtype=np.int64)
        self.c = np.empty((max(1, capacity), rows.d), dtype=np.float32)
        self.csq = np.empty(len(self.c), dtype=np.float32)
        self.t = 0
        self.pairs = self.updates = 0

    def add(self, c: np.ndarray) -> None:
        # Callers size `capacity` to every centre they add (labeled + picks, or the batch for radius_of).
        self.c[self.t], self.csq[self.t] = c, float(c @ c)
        self.t += 1

    def _update(self, b: int) -> None:
        r, s0, t = self.r, int(self.stamp[b]), self.t
        c, csq = self.c[s0:t], self.csq[s0:t]
        self.stamp[b] = t
        self.updates += 1
        if len(c) > 1:
            dc = np.sqrt(np.maximum(float(r.cent[b] @ r.cent[b]) - 2.0 * (c @ r.cent[b]) + csq, 0.0))
            gap = np.maximum(dc - r.radius[b], 0.0)
            if not np.isfinite(self.bmax[b]) and len(c) > _SEED_CENTRES:
                # No bound yet (labeled centres, a radius_of batch): the nearest centres give one, then prune.
                near = np.argpartition(dc, _SEED_CENTRES - 1)[:_SEED_CENTRES]
                self._lower(b, c[near], csq[near])
                rest = np.ones(len(c), dtype=bool)
                rest[near] = False
                c, csq, gap = c[rest], csq[rest], gap[rest]
            keep = gap * gap < self.bmax[b]
            c, csq = c[keep], csq[keep]
        if len(c):
            self._lower(b, c, csq)
        self._refresh(b)

    def _lower(self, b: int, c: np.ndarray, csq: np.ndarray) -> None:
        """md of block b's rows = min(md, min squared distance to the centres c): one float32 GEMM per 1,024."""
        r = self.r
        lo, hi = r.bounds[b], r.bounds[b + 1]
        xb = r.xs[lo:hi].astype(np.float32, copy=False)
        md = self.md[lo:hi]
        for j in range(0, len(c), 1024):
            g = xb @ c[j : j + 1024].T
            g *= -2.0
            g += csq[None, j : j + 1024]
            np.minimum(md, g.min(axis=1) + r.xsq[lo:hi], out=md)
        np.maximum(md, 0.0, out=md)  # cancellation leaves tiny negatives for (near-)duplicates
        self.bmax[b] = md.max()
        self.pairs += len(c) * int(hi - lo)

    def _refresh(self, b: int) -> None:
        lo, hi = self.r.bounds[b], self.r.bounds[b + 1]
        md = self.md[lo:hi]
        self.bmax[b] = md.max()
        key = md.astype(np.float64) if self.w is None else md * self.w[lo:hi].astype(np.float64)
        key[self.taken[lo:hi]] = -np.inf
        self.bkey[b] = key.max()

    def settle(self) -> None:
        """Bring every block up to date (for the final radius)."""
        for b in np.flatnonzero(self.stamp < self.t):
            self._update(int(b))

    def farthest(self) -> int:
        """The untaken row (block order) of largest key, exact: stale blocks are updated until the top is fresh."""
        group = 1
        while True:
            b = int(np.argmax(self.bkey))
            if self.bkey[b] == -np.inf:
                raise SelectionError("blocked k-center: every row is already picked")
            if self.stamp[b] == self.t:
                break
            # Update the `group` highest stale bounds at once; widen while the top keeps being stale.
            top = np.argpartition(-self.bkey, group - 1)[:group] if group < len(self.bkey) else np.arange(len(self.bkey))
            for j in top[self.stamp[top] < self.t]:
                self._update(int(j))
            group = min(2 * group, len(self.bkey))
        lo, hi = self.r.bounds[b], self.r.bounds[b + 1]
        md = self.md[lo:hi].astype(np.float64)
        key = md if self.w is None else md * self.w[lo:hi]
        key[self.taken[lo:hi]] = -np.inf
        return int(lo + np.argmax(key))

    def take(self, i: int) -> None:
        self.taken[i] = True
        self.md[i] = 0.0
        self.add(self.r.xs[i].astype(np.float32))
        self._refresh(int(np.searchsorted(self.r.bounds, i, side="right") - 1))
