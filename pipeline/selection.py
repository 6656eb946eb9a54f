"""One round's selection from its inputs: the pool's scores (none at a cold start in a non-model space), the
selection space, the labeled set, what may not be picked, the uncertainty history, and the round's phase.

No Prefect here: flows/select.py loads the inputs, calls `select_round` and writes what it returns.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.config import SelectConfig
from pipeline.errors import SelectionError
from pipeline.strategies import get_heuristic, select_batch
from pipeline.strategies.schedule import Phase, choose_phase, newest_label_accuracy


@dataclass(frozen=True)
class Space:
    """Selection embeddings keyed by sample ID (pipeline.embeddings); None stands for the scorer's (source model)."""

    ids: list[str]
    emb: np.ndarray
    source: str

    def rows(self, wanted: Sequence[str]) -> np.ndarray:
        from pipeline.embeddings import lookup  # its module imports the image stack; selection alone need not

        return lookup(self.ids, self.emb, wanted)


@dataclass
class RoundSelection:
    rows: list[dict[str, Any]]  # selection.jsonl, pick order
    strategy: str
    diversity: str
    uncertainty: tuple[list[str], np.ndarray] | None = None  # pool ids → entropy, for later rounds' outlier history
    outliers: list[dict[str, Any]] | None = None
    info: dict[str, Any] = field(default_factory=dict)


def heuristic_input(scores: Any, strategy: str) -> np.ndarray | None:
    """The array a heuristic reads: candidate probs ([n, c] or MC [n, c, k]), token entropies, or agreement codes."""
    from pipeline.scoring import agreement_codes

    if strategy == "token_entropy":
        return scores.token_entropy
    if strategy == "answer_disagreement":
        return agreement_codes(scores.mc_answers) if scores.mc_answers else None
    if strategy == "bald":
        return scores.mc_probs
    if strategy == "random":
        return None
    return scores.mc_probs.mean(-1) if scores.mc_probs is not None and scores.probs is None else scores.probs


def predictions(scores: Any, answers: list[str] | None) -> tuple[list[str | None], list[float | None]]:
    """The model's current answer and its confidence per sample (pre-annotations for the annotators)."""
    if scores.probs is not None and answers:
        best = scores.probs.argmax(1)
        return [answers[i] for i in best], [float(p) for p in scores.probs.max(1)]
    if scores.answers is not None:
        mean_lp = np.nanmean(np.where(np.isfinite(scores.token_logprobs), scores.token_logprobs, np.nan), axis=1)
        return list(scores.answers), [float(np.exp(x)) if np.isfinite(x) else None for x in mean_lp]
    return [None] * len(scores.sample_ids), [None] * len(scores.sample_ids)


def pool_uncertainty(scores: Any) -> np.ndarray | None:
    """The uncertainty the outlier history tracks, whatever the selection strategy (random included): entropy of the
    (MC-averaged) answer probabilities for closed sets, mean per-token entropy of the greedy answer for open ones."""
    probs = heuristic_input(scores, "entropy")
    if probs is not None:
        return get_heuristic("entropy").score(probs)
    if scores.token_entropy is not None:
        return get_heuristic("token_entropy").score(scores.token_entropy)
    return None


def cold_start_choice(cold_start: str) -> tuple[str, str]:
    """(strategy, diversity) of the first batch, picked before any model exists."""
    return ("random", "top_k") if cold_start == "random" else ("random", cold_start)


def round_phase(sel_cfg: SelectConfig, *, labels: Mapping[str, str], n_classes: int | None,
                previous_selections: Sequence[Sequence[Mapping[str, Any]]]) -> Phase:
    """The phase of a round after the cold start: `previous_selections` are earlier rounds' selection rows (oldest
    first), whose pre-annotations measured against the labels they got give the newest-labels accuracy history."""
    history = [a for rows in previous_selections if (a := newest_label_accuracy(rows, labels)) is not None]
    return choose_phase(sel_cfg.schedule, strategy=sel_cfg.strategy, diversity=sel_cfg.diversity,
                        labeled=len(labels), n_classes=n_classes, newest_accuracy=history)


def select_round(
    sel_cfg: SelectConfig,
    *,
    candidate_ids: Sequence[str],
    scores: Any | None,
    space: Space | None,
    labeled: Collection[str],
    exclude: Collection[str],
    answers: list[str] | None,
    history: list[dict[str, float]],
    cold_start: bool,
    seed: int,
    phase: Mapping[str, str] | None = None,
) -> RoundSelection:
    """Pick the round's batch.

    `scores` (a ScoreResult, row-aligned with its own sample_ids) may be None only at a cold start, with `space`
    giving the embeddings; then `candidate_ids` are the candidates. Embeddings for diversity, coverage and outliers
    come from `space` when given, else from the scores. `phase` ({strategy, diversity}) overrides the configured
    pair after the cold start (the schedule's choice).
    """
    from pipeline.strategies.outliers import find_outliers

    labeled = set(labeled)
    exclude = set(exclude)
    if scores is None and (space is None or not cold_start):
        raise SelectionError("select: a round after the cold start needs the pool's scores; score the pool first")
    ids = list(scores.sample_ids) if scores is not None else sorted(candidate_ids)
    emb = space.rows(ids) if space is not None else (scores.embeddings if scores is not None else None)
    out = RoundSelection([], "", "")
    if not cold_start and scores is not None and (u := pool_uncertainty(scores)) is not None:
        pool = [i for i, s in enumerate(ids) if s not in labeled]
        out.uncertainty = ([ids[i] for i in pool], u[pool])
    downweight: list[str] = []
    if not cold_start and emb is not None:
        report = find_outliers(ids, emb, history, labeled_ids=labeled, k=sel_cfg.outlier_neighbors,
                               z_threshold=sel_cfg.outlier_z, min_rounds=sel_cfg.uncertain_rounds,
                               policy=sel_cfg.outliers)
        out.outliers = report.rows()
        out.info["outliers"] = {"flagged": len(out.outliers), "far": int(report.far.sum()),
                                "persistent": int(report.persistent.sum()), "policy": sel_cfg.outliers}
        if sel_cfg.outliers == "exclude":
            exclude |= {r["sample_id"] for r in out.outliers}
        elif sel_cfg.outliers == "downweight":
            downweight = [r["sample_id"] for r in out.outliers]
    if cold_start:
        strategy, diversity = cold_start_choice(sel_cfg.cold_start)
        probs = None
    else:
        strategy = (phase or {}).get("strategy", sel_cfg.strategy)
        diversity = (phase or {}).get("diversity", sel_cfg.diversity)
        probs = heuristic_input(scores, strategy)
        if probs is None and strategy != "random":
            need = "select.mc_dropout_passes ≥ 2" if strategy in ("bald", "answer_disagreement") else "closed answers"
            raise SelectionError(f"select.strategy {strategy!r} needs {need}; the pool was scored with "
                                 f"{sel_cfg.mc_dropout_passes} MC passes")
    labeled_emb = None
    if labeled and emb is not None:
        if space is not None:
            labeled_emb = space.rows(sorted(labeled))
        else:
            at = {s: i for i, s in enumerate(ids)}
            rows = [at[s] for s in sorted(labeled) if s in at]
            labeled_emb = emb[rows] if rows else None
    options: dict[str, Any] = {}
    if diversity == "probcover" and answers:
        options["n_classes"] = len(answers)
    predicted = scores.probs.argmax(1) if scores is not None and scores.probs is not None else None
    selection = select_batch(
        ids, k=sel_cfg.batch_size, strategy=strategy, diversity=diversity, probs=probs, embeddings=emb,
        predicted=predicted, exclude=exclude | labeled, seed=seed, labeled_embeddings=labeled_emb,
        downweight=downweight, downweight_weight=sel_cfg.outlier_weight, options=options,
    )
    if scores is not None:
        predicted_answer, confidence = predictions(scores, answers)
    else:
        predicted_answer, confidence = [None] * len(ids), [None] * len(ids)
    for row, i in zip(selection.rows(), selection.positions, strict=True):
        out.rows.append({**row, "rank": row["rank"] - 1, "prediction": predicted_answer[i],
                         "confidence": confidence[i], "scores": {strategy: row["score"]}})
    out.strategy, out.diversity = strategy, diversity
    out.info.update(n=len(out.rows), strategy=strategy, diversity=diversity, pool=len(ids) - len(labeled & set(ids)),
                    embeddings=space.source if space is not None else "model")
    if getattr(selection, "info", None):
        out.info["selector"] = selection.info
    return out


def select_step(
    candidate_ids: Sequence[str],
    *,
    k: int,
    strategy: str,
    diversity: str,
    seed: int,
    labeled: Collection[str] = (),
    exclude: Collection[str] = (),
    probs: np.ndarray | None = None,
    predicted: np.ndarray | None = None,
    space: Space | None = None,
    embeddings: np.ndarray | None = None,
    n_classes: int | None = None,
    options: Mapping[str, Any] | None = None,
) -> Any:
    """One selection step on arrays: `k` of `candidate_ids` (minus `labeled` and `exclude`) picked by `strategy` ×
    `diversity`, for a caller that holds its own scores (a benchmark's learner) rather than a ScoreResult.

    `probs` (what the heuristic reads, `heuristic_input`) and `predicted` are row-aligned with `candidate_ids`;
    embeddings come from `space` when given, else from `embeddings` (row-aligned too); the labeled samples'
    embeddings seed k-center and count as covered for the coverage selectors. A selector whose constructor takes
    `n_classes` gets the task's class count unless `options` sets it: the selector's signature says what it needs,
    so no caller tests its name. Returns pipeline.strategies.Selection.
    """
    import inspect

    from pipeline.strategies import SELECTORS

    ids = list(candidate_ids)
    labeled = set(labeled)
    emb = space.rows(ids) if space is not None else embeddings
    labeled_emb = None
    if labeled and emb is not None:
        if space is not None:
            labeled_emb = space.rows(sorted(labeled))
        else:
            at = {s: i for i, s in enumerate(ids)}
            rows = [at[s] for s in sorted(labeled) if s in at]
            labeled_emb = emb[rows] if rows else None
    opts: dict[str, Any] = {}
    selector = SELECTORS.get(diversity)  # an unknown name is select_batch's to report
    if n_classes and selector is not None and "n_classes" in inspect.signature(selector).parameters:
        opts["n_classes"] = n_classes
    opts.update(options or {})
    return select_batch(ids, k=k, strategy=strategy, diversity=diversity, probs=probs, embeddings=emb,
                        predicted=predicted, exclude=set(exclude) | labeled, seed=seed,
                        labeled_embeddings=labeled_emb, options=opts)
