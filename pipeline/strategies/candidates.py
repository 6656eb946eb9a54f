"""Candidate restriction before scoring (`select.candidates: restrict`): which eligible samples a round scores.

Scoring is the cost of a round that grows with the pool (a VLM forward per sample), so a restricted round scores
only a candidate set chosen without the model, from the selection embeddings, in `select.candidates.shares`:

| source | what it adds | why |
|---|---|---|
| `neighbors` | the nearest eligible neighbours of the labeled samples, rank by rank (every labeled sample's 1st, then every 2nd…) | SEALS (Coleman et al. 2022): the informative samples sit near the labeled set's decision regions; rank by rank spreads the share over all labeled samples instead of the densest few |
| `clusters` | per k-means cluster (fitted once per embeddings, cached), least-labeled clusters first, the eligible samples nearest the cluster's mean, cluster by cluster | regions no label reaches yet, which the neighbours never see |
| `random` | a seeded uniform draw of what is left | keeps every eligible sample reachable; it fills whatever the other sources could not (no labels yet, fewer eligible samples than asked) |

Sources fill in the table's order and never pick a sample twice. With fewer eligible samples than the size, every
eligible sample is a candidate. The neighbours are searched through pipeline.strategies.index: exact up to its
stated size (EXACT_MAX rows), an IVF index above, whose recall against exact search benchmarks/index_recall.py
measures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from pipeline.codeversion import stage_version
from pipeline.config import CandidatesConfig, SelectConfig
from pipeline.errors import SelectionError
from pipeline.idindex import IdIndex
from pipeline.strategies.base import DEFAULT_CANDIDATE_SHARES, kmeans_labels
from pipeline.strategies.index import NeighborIndex

# The candidate clusters are reused across rounds by this key: an edit to the clustering (this module and what it
# imports) must recompute them, so the version carries the code digest as every stage's does.
CANDIDATES_VERSION = stage_version("1", "pipeline.strategies.candidates")
CLUSTERS_FILE = "clusters.npy"


@dataclass
class Pool:
    """What a candidate source reads: the eligible rows' embeddings, the labeled rows', k-means cluster labels of
    the eligible rows (and their count), and a mask of the rows already taken by earlier sources."""

    emb: np.ndarray  # [n, d] float32, eligible rows
    labeled: np.ndarray  # [m, d] float32
    clusters: np.ndarray | None  # [n] cluster id per eligible row
    labeled_clusters: np.ndarray | None  # [m] cluster id per labeled row
    taken: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))


class CandidateSource:
    """Adds up to `n` eligible rows (indices into `pool.emb`) not yet taken, in its own order of preference."""

    name: ClassVar[str] = ""
    needs_clusters: ClassVar[bool] = False

    def pick(self, n: int, pool: Pool, *, seed: int) -> np.ndarray:
        raise NotImplementedError


class Neighbors(CandidateSource):
    name = "neighbors"

    def pick(self, n: int, pool: Pool, *, seed: int) -> np.ndarray:
        total = len(pool.emb)
        if n <= 0 or not len(pool.labeled) or not total:
            return np.zeros(0, dtype=np.int64)
        # Each labeled sample's k nearest, k grown until the union (minus taken rows) fills n; exact search up to
        # the index's stated size, IVF above (pipeline.strategies.index).
        index = NeighborIndex(pool.emb, seed=seed)
        k = min(total, max(1, math.ceil(2 * n / len(pool.labeled))))
        while True:
            _, idx = index.search(pool.labeled, k)
            order = idx.T.reshape(-1)  # rank-major: every labeled sample's 1st neighbour, then every 2nd, …
            order = order[order >= 0]
            _, first = np.unique(order, return_index=True)
            ranked = order[np.sort(first)]
            ranked = ranked[~pool.taken[ranked]]
            if len(ranked) >= n or k == total:
                return ranked[:n].astype(np.int64)
            k = min(total, 2 * k)


class Clusters(CandidateSource):
    name = "clusters"
    needs_clusters = True

    def pick(self, n: int, pool: Pool, *, seed: int) -> np.ndarray:
        if n <= 0 or pool.clusters is None or not len(pool.emb):
            return np.zeros(0, dtype=np.int64)
        free = np.flatnonzero(~pool.taken)
        ids = np.unique(pool.clusters[free])
        labeled_count = {c: 0 for c in ids}
        for c in pool.labeled_clusters if pool.labeled_clusters is not None else ():
            if c in labeled_count:
                labeled_count[c] += 1
        queues = []
        for c in ids:
            rows = free[pool.clusters[free] == c]
            centre = pool.emb[rows].mean(0)
            d = ((pool.emb[rows] - centre) ** 2).sum(1)
            queues.append((labeled_count[c], -len(rows), int(c), rows[np.argsort(d, kind="stable")]))
        queues.sort(key=lambda q: q[:3])  # uncovered clusters first, the largest first among equals
        out: list[int] = []
        depth = 0
        while len(out) < n and any(depth < len(q[3]) for q in queues):
            out += [int(q[3][depth]) for q in queues if depth < len(q[3])][: n - len(out)]
            depth += 1
        return np.asarray(out, dtype=np.int64)


class RandomFill(CandidateSource):
    name = "random"

    def pick(self, n: int, pool: Pool, *, seed: int) -> np.ndarray:
        free = np.flatnonzero(~pool.taken)
        if n <= 0 or not len(free):
            return np.zeros(0, dtype=np.int64)
        return np.sort(np.random.default_rng(seed).choice(free, min(n, len(free)), replace=False)).astype(np.int64)


# Fill order: the random fill last, since it takes what the others leave.
SOURCES: dict[str, type[CandidateSource]] = {"neighbors": Neighbors, "clusters": Clusters, "random": RandomFill}


@dataclass
class CandidateSet:
    """The samples a restricted round scores, chosen before scoring (what one selection step then picks from, with
    their scores, is a pipeline.strategies.pool.Candidates)."""

    ids: list[str]  # sorted
    info: dict[str, Any]  # how they were chosen: what the selection manifest records


def share_sizes(size: int, shares: dict[str, float]) -> dict[str, int]:
    """Per source, its share of `size` (rounded down; the random fill takes the rest)."""
    out = {name: int(size * shares.get(name, 0.0)) for name in SOURCES if name != "random"}
    out["random"] = size - sum(out.values())
    return out


def pick_candidates(cand_cfg: CandidatesConfig, *, eligible: Sequence[str], eligible_emb: np.ndarray, labeled_emb: np.ndarray,
                    batch_size: int, seed: int, clusters: np.ndarray | None = None,
                    labeled_clusters: np.ndarray | None = None) -> CandidateSet:
    """The round's candidates among `eligible` (row-aligned with `eligible_emb`) under `cand_cfg`
    (a CandidatesConfig); `clusters` / `labeled_clusters`: k-means labels of the eligible and labeled rows (needed
    when the clusters source has a share). Deterministic for a seed."""
    size = cand_cfg.size_for(batch_size)
    ids = list(eligible)
    if len(eligible_emb) != len(ids):
        raise SelectionError(f"select.candidates: {len(eligible_emb)} embedding rows for {len(ids)} eligible samples")
    shares = dict(cand_cfg.shares if cand_cfg.shares is not None else DEFAULT_CANDIDATE_SHARES)
    info: dict[str, Any] = {"method": cand_cfg.method, "size": size, "eligible": len(ids), "seed": seed,
                            "labeled": len(labeled_emb), "shares": shares}
    if len(ids) <= size:
        return CandidateSet(sorted(ids), {**info, "candidates": len(ids), "sources": {"all eligible": len(ids)}})
    if batch_size > size:
        raise SelectionError(f"select.candidates.size {size} is below select.batch_size {batch_size}: a round could "
                             f"not fill its batch; raise select.candidates.size to at least {batch_size}")
    pool = Pool(np.ascontiguousarray(eligible_emb, dtype=np.float32),
                np.ascontiguousarray(labeled_emb, dtype=np.float32).reshape(-1, eligible_emb.shape[1]),
                clusters, labeled_clusters, np.zeros(len(ids), dtype=bool))
    want = share_sizes(size, shares)
    got: dict[str, int] = {}
    left = size
    for name, source in SOURCES.items():
        if source.needs_clusters and want[name] and clusters is None:
            raise SelectionError(f"select.candidates: the {name} source needs k-means labels of the eligible rows")
        n = left if name == "random" else min(want[name], left)
        rows = source().pick(n, pool, seed=seed)
        pool.taken[rows] = True
        got[name] = len(rows)
        left -= len(rows)
    chosen = sorted(ids[i] for i in np.flatnonzero(pool.taken))
    return CandidateSet(chosen, {**info, "candidates": len(chosen), "sources": got})


# ------------------------------------------------------------------------------------------- a round's candidates
def cluster_labels(ids: Sequence[str], emb: np.ndarray, *, n_clusters: int, seed: int, cache_dir: Path | None,
                   inputs: dict[str, str]) -> np.ndarray:
    """k-means labels of every row of a selection space, fitted once per (embeddings, clusters, seed) and kept in
    `cache_dir` (written atomically with a manifest, so a torn file is recomputed), or in memory without one."""
    from pipeline.store import atomic_write_bytes, reuse_or_compute, stage_key, write_manifest

    k = max(1, min(n_clusters, len(ids)))
    if cache_dir is None:
        return kmeans_labels(emb, k, seed=seed)
    config = {"clusters": k, "seed": seed}
    key = stage_key("candidate_clusters", CANDIDATES_VERSION, inputs, config)
    out = Path(cache_dir) / key[:16]

    def compute() -> Any:
        import io

        buf = io.BytesIO()
        np.save(buf, kmeans_labels(emb, k, seed=seed), allow_pickle=False)
        atomic_write_bytes(out / CLUSTERS_FILE, buf.getvalue())
        return write_manifest(out, stage="candidate_clusters", stage_version=CANDIDATES_VERSION, inputs=inputs,
                              config=config, outputs={"clusters": CLUSTERS_FILE}, info={"rows": len(ids)})

    m = reuse_or_compute(out, key, compute)
    labels = np.load(m.path_of("clusters", out), allow_pickle=False)
    if len(labels) != len(ids):
        raise SelectionError(f"{out}: {len(labels)} cluster labels for {len(ids)} embeddings; delete {out} to rebuild")
    return labels


@dataclass(frozen=True)
class CandidatesChoice:
    """What a scoring round does under select.candidates (`all` or `restrict`), and the sentence saying why."""

    method: str
    reason: str


def candidates_choice(cand: CandidatesConfig, *, eligible: int, embeddings_source: str) -> CandidatesChoice:
    """`select.candidates.method` resolved for a round with `eligible` pool samples.

    auto scores every eligible sample up to `auto_above` (10,000 by default) and restricts above it. Why that size:
    scoring everything grows with the pool (benchmarks/results/pool_scale.json scores 10k samples in 8.9 s and 100k
    in 84 s with the tiny model, a real VLM ~10-100× slower a sample), while the default selector restricted to a
    uniform sample of 10 × the batch (Selector.candidate_shares) reaches 95 % of full-data accuracy with labels
    inside the unrestricted intervals, on the digits and on 24,000 generated digits (`candidates_check` in
    benchmarks/results/label_efficiency.json, benchmarks/results/candidates_scale.json; docs/selection.md "What
    restriction costs"). Up to 10k a full pass costs little and restriction would keep most of the pool anyway;
    above it the full pass is what a round waits for.
    """
    if cand.method != "auto":
        return CandidatesChoice(cand.method, f"select.candidates.method is {cand.method}")
    if eligible <= cand.auto_above:
        return CandidatesChoice("all", f"auto: {eligible:,} eligible samples ≤ select.candidates.auto_above "
                                f"({cand.auto_above:,}), so scoring all of them is cheap")
    if embeddings_source == "model":
        return CandidatesChoice("all", f"auto: {eligible:,} eligible samples > auto_above ({cand.auto_above:,}), but "
                                "select.embeddings is model, which gives no space to restrict in before scoring; set "
                                "select.embeddings to pool, pixels or vision_tower to score only candidates")
    return CandidatesChoice("restrict", f"auto: {eligible:,} eligible samples > select.candidates.auto_above "
                            f"({cand.auto_above:,}): scoring every one costs a forward each, and restricting cost "
                            "no labels on the label-efficiency benchmark (docs/selection.md)")


def picks_by_space(strategy: str, diversity: str) -> bool:
    """Whether a round's choice reads the selection space alone (a coverage phase: a heuristic without input and a
    selector that needs no scores), so its own selector can choose its candidates without the model."""
    from pipeline.strategies.registry import get_heuristic, get_selector

    return get_heuristic(strategy).input == "none" and not get_selector(diversity).needs_scores


def shares_for(cand: CandidatesConfig, diversity: str) -> dict[str, float]:
    """select.candidates.shares, or where it is unset the round's selector's own (Selector.candidate_shares)."""
    from pipeline.strategies.registry import get_selector

    return dict(cand.shares if cand.shares is not None else get_selector(diversity).candidate_shares)


def round_candidates(sel_cfg: SelectConfig, *, pool_ids: Sequence[str], labeled_ids: Collection[str], space_ids: Sequence[str],
                     space_emb: np.ndarray, seed: int, cache_dir: Path | None, space_digest: str,
                     coverage: tuple[str, Callable[[list[str], int, int], list[str]]] | None = None,
                     diversity: str | None = None) -> CandidateSet:
    """A round's candidates from its selection space (`space_ids` → rows of `space_emb`), under `sel_cfg`
    (SelectConfig), in the shares of `diversity`'s selector (the round's phase; select.diversity by default) unless
    select.candidates.shares sets them. The random fill's seed moves with the labeled set's size, so successive
    rounds draw afresh.

    `coverage` = (selector name, pick(eligible, k, seed) -> IDs) in a coverage phase (`picks_by_space`): its
    candidates are that selector's own batch picked over the whole eligible pool (it needs no forward), so only the
    batch is scored, for its pre-annotations. A coverage selector measures coverage over the set it is given: the
    labeled set's neighbours are the regions it avoids, and even its own first `size` picks as candidates change what
    it picks from them (both cost MaxHerding + margin labels on the digits, benchmarks/results/label_efficiency.json
    at commits 6b530bb and the one after 2c4ce5f)."""
    from pipeline.embeddings import lookup_rows

    cand = sel_cfg.candidates
    cand = cand.model_copy(update={"shares": shares_for(cand, diversity or sel_cfg.diversity)})
    at = IdIndex(space_ids)
    known = sorted(labeled_ids)
    labeled = [s for s, r in zip(known, at.rows(known), strict=True) if r >= 0]
    eligible = sorted(pool_ids)
    round_seed = seed * 100_003 + len(labeled)
    size = cand.size_for(sel_cfg.batch_size)
    if coverage is not None and len(eligible) > size:
        name, pick = coverage
        chosen = sorted(pick(eligible, min(sel_cfg.batch_size, len(eligible)), round_seed))
        return CandidateSet(chosen, {"method": cand.method, "size": size, "eligible": len(eligible), "seed": round_seed,
                                   "labeled": len(labeled), "candidates": len(chosen),
                                   "sources": {f"{name} (coverage phase)": len(chosen)}, "clusters": None})
    clusters = labeled_clusters = None
    rows, labeled_rows = lookup_rows(at, eligible), lookup_rows(at, labeled)  # once: 10⁶ eligible IDs cost seconds
    if cand.shares.get("clusters", 0) > 0:
        all_labels = cluster_labels(space_ids, space_emb, n_clusters=cand.clusters, seed=seed, cache_dir=cache_dir,
                                    inputs={"space": space_digest})
        clusters, labeled_clusters = all_labels[rows], all_labels[labeled_rows]
    out = pick_candidates(cand, eligible=eligible, eligible_emb=space_emb[rows],
                          labeled_emb=space_emb[labeled_rows], batch_size=sel_cfg.batch_size,
                          seed=round_seed, clusters=clusters, labeled_clusters=labeled_clusters)
    out.info["clusters"] = cand.clusters if clusters is not None else None
    return out
