"""Select the next batch from a scored pool: drop what may not be picked, score, diversify."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.errors import SelectionError
from pipeline.strategies.outliers import apply_outlier_policy
from pipeline.strategies.registry import SELECTORS, get_heuristic, get_selector

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Selection:
    """The picked samples in pick order; rank 1 is picked first."""

    ids: list[str]
    ranks: list[int]
    scores: list[float]
    strategy: str
    diversity: str
    # Index of each pick in the caller's candidate_ids, to fetch its rows without a lookup.
    positions: list[int]
    # What the selector chose (Selector.info: a radius, a bandwidth, a cluster count...), for reports.
    info: dict[str, Any] = field(default_factory=dict)

    def rows(self) -> list[dict[str, Any]]:
        """One JSON-ready row per pick (the select flow adds the adapter digest)."""
        return [
            {"sample_id": i, "rank": r, "score": s, "strategy": self.strategy, "diversity": self.diversity}
            for i, r, s in zip(self.ids, self.ranks, self.scores, strict=True)
        ]


def _aligned(name: str, a: Any, n: int) -> np.ndarray | None:
    if a is None:
        return None
    arr = np.asarray(a)
    if arr.ndim == 0 or arr.shape[0] != n:
        raise SelectionError(
            f"select: {name} has shape {arr.shape} but there are {n} candidate ids; "
            f"row i of {name} must belong to candidate_ids[i]"
        )
    return arr


@dataclass(frozen=True)
class Candidates:
    """What one selection step picks from: the sample IDs and, row-aligned with them, what the heuristic and the
    selector read (`probs`, `embeddings`, `predicted`, `costs`: predicted seconds per sample); `labeled_embeddings`
    (one row per labeled sample, not aligned) seed k_center's core-set and count as covered for the coverage
    selectors; `exclude` holds IDs that must never be picked."""

    ids: list[str]
    probs: np.ndarray | None = None
    embeddings: np.ndarray | None = None
    predicted: np.ndarray | None = None
    labeled_embeddings: np.ndarray | None = None
    exclude: Collection[str] = ()
    costs: np.ndarray | None = None


def select_batch(
    candidates: Candidates,
    *,
    k: int,
    strategy: str,
    diversity: str,
    seed: int,
    allow_partial: bool = False,
    options: Mapping[str, Any] | None = None,
    downweight: Collection[str] = (),
    downweight_weight: float = 0.5,
) -> Selection:
    """Pick `k` of `candidates.ids` with heuristic `strategy` and selector `diversity`.

    `probs`, `embeddings` and `predicted` (fields of `candidates`) are row-aligned with its ids (heuristics.py).
    `exclude` holds IDs that must never be picked: already labeled, quarantined, excluded by quality, exported but
    not yet labeled. Candidates are put in sample-ID order first, so the result does not depend on the order shards
    arrived in: the same inputs and seed give the same IDs. `options` are passed to the selector's constructor
    (e.g. {"uncertainty": "product"} for k_center); `labeled_embeddings` seed k_center's core-set and count as
    covered for the coverage selectors. Without `probs` only `random` or a selector with `needs_scores = False`
    (typical, typiclust, probcover, maxherding: a cold start) work. Scores of `downweight` IDs (outliers) shrink
    towards the lowest score by `downweight_weight` (outliers.apply_outlier_policy) before the selector sees them.
    `costs` (predicted seconds per candidate, row-aligned; select.cost: predicted) make the pick gain per second,
    as the selector's `cost_use` says (pipeline/strategies/cost.py); the returned scores are then per second.
    """
    candidate_ids, probs, embeddings, predicted = (candidates.ids, candidates.probs, candidates.embeddings,
                                                   candidates.predicted)
    exclude, labeled_embeddings, costs = candidates.exclude, candidates.labeled_embeddings, candidates.costs
    try:
        heuristic = get_heuristic(strategy, seed=seed)
    except SelectionError as exc:
        raise SelectionError(f"select: {exc}") from None
    selector_cls = get_selector(diversity)
    if k < 1:
        raise SelectionError(f"select: batch size must be >= 1, got {k}")
    ids = _unique_ids(candidate_ids)
    n = len(ids)
    probs, embeddings, predicted = (_aligned(nm, a, n) for nm, a in
                                    (("probs", probs), ("embeddings", embeddings), ("predicted", predicted)))
    pos, k = _pickable(ids, exclude, k, allow_partial)
    if k == 0:
        return Selection([], [], [], strategy, diversity, [])

    scores = _scores(heuristic, selector_cls, strategy, probs, pos)
    if downweight:
        flagged = set(downweight)
        pos_ids = [ids[i] for i in pos]
        scores, _ = apply_outlier_policy(scores, [s in flagged for s in pos_ids], "downweight", ids=pos_ids,
                                         weight=downweight_weight)
    scores, cost_kw, cost_info = _with_costs(scores, costs, n, pos, selector_cls, diversity)
    try:
        selector = selector_cls(**dict(options or {}))
    except TypeError as exc:
        raise SelectionError(f"select: bad options {dict(options or {})} for diversity {diversity!r}: {exc}") from None
    picks = selector.select(
        k,
        scores=scores,
        embeddings=None if embeddings is None else embeddings[pos],
        predicted=None if predicted is None else predicted[pos],
        seed=seed,
        labeled_embeddings=labeled_embeddings,
        **cost_kw,
    )
    chosen = pos[picks]
    return Selection(
        ids=[ids[i] for i in chosen],
        ranks=list(range(1, len(chosen) + 1)),
        scores=[float(x) for x in scores[picks]],
        strategy=strategy,
        diversity=diversity,
        positions=[int(i) for i in chosen],
        info={**selector.info, **cost_info},
    )


def _unique_ids(candidate_ids: list[str]) -> list[str]:
    ids = list(candidate_ids)
    if len(set(ids)) != len(ids):
        dup, times = Counter(ids).most_common(1)[0]
        raise SelectionError(f"select: candidate id {dup!r} appears {times} times; each sample may be scored once")
    return ids


def _pickable(ids: list[str], exclude: Collection[str], k: int, allow_partial: bool) -> tuple[np.ndarray, int]:
    """(positions of the candidates that may be picked, in sample-ID order; how many to pick), k lowered to what is
    left when `allow_partial`."""
    n = len(ids)
    excluded = set(exclude)
    keep = np.array([i for i, sid in enumerate(ids) if sid not in excluded], dtype=np.int64)
    left = len(keep)
    if left < k:
        msg = (f"Pool exhausted: {left} unlabeled samples left, {k} requested "
               f"({n} candidates, {n - left} already labeled, quarantined, flagged or exported)")
        if not allow_partial:
            raise SelectionError(f"{msg}; lower select.batch_size to {left} or add samples to the pool")
        log.warning("%s; selecting all %d", msg, left)
        k = left
    if k == 0:
        return keep, 0
    return keep[np.argsort(np.asarray([ids[i] for i in keep]), kind="stable")], k


def _scores(heuristic: Any, selector_cls: Any, strategy: str, probs: np.ndarray | None, pos: np.ndarray) -> np.ndarray:
    """The heuristic's score of each pickable candidate; zeros for a cold-start selector that reads none."""
    if probs is not None:
        scores = heuristic.score(probs[pos])
    elif heuristic.input == "none":  # random: reads no scores, only how many candidates there are
        scores = heuristic.score(pos)
    elif not selector_cls.needs_scores:
        scores = np.zeros(len(pos))  # cold start: the selector ignores scores (typicality, coverage decide)
    else:
        cold = sorted(name for name, cls in SELECTORS.items() if not cls.needs_scores)
        raise SelectionError(
            f"select: strategy {strategy!r} needs model scores (probs), got none; for a cold start without a model "
            f"use a diversity that needs no scores ({', '.join(repr(c) for c in cold)}) or strategy='random'"
        )
    if len(scores) != len(pos):
        raise SelectionError(f"select: strategy {strategy!r} returned {len(scores)} scores for {len(pos)} candidates")
    return scores


def _with_costs(scores: np.ndarray, costs: np.ndarray | None, n: int, pos: np.ndarray, selector_cls: Any,
                diversity: str) -> tuple[np.ndarray, dict[str, Any], dict[str, Any]]:
    """(scores, the selector's cost keyword, info): gain per second, or the costs for a selector that uses its own."""
    if costs is None:
        return scores, {}, {}
    from pipeline.strategies.cost import check_costs, gain_per_second

    c = check_costs(costs, n)[pos]
    cost_info = {"cost_use": selector_cls.cost_use}
    if selector_cls.cost_use == "scores":
        return gain_per_second(scores, c), {}, cost_info
    if selector_cls.cost_use == "own":
        return scores, {"costs": c}, cost_info
    log.info("select: diversity %r has no gain to divide by a cost; cost-blind", diversity)
    return scores, {}, cost_info
