"""One round's selection from its inputs: the pool's scores (none at a cold start in a non-model space), the
selection space, the labeled set, what may not be picked, the uncertainty history, and the round's phase.

No Prefect here: flows/select.py orders the stages; `plan_selection` writes the round's ID files and returns the
select stage's parameters (one SelectParams), `select_stage` is that stage's body (load, `select_round`, write).
The round's phase travels as a typed `Phase` (pipeline.strategies.schedule) and the candidates of a step as one
`Candidates` (pipeline.strategies.pool); both become JSON only where they are written.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.codeversion import stage_version
from pipeline.config import ProjectConfig, SelectConfig
from pipeline.errors import SelectionError
from pipeline.idindex import IdIndex
from pipeline.stage_ref import StageRef
from pipeline.store import atomic_write_jsonl, digest_file, digest_json, read_jsonl, write_manifest
from pipeline.strategies import Candidates, Selection, get_heuristic, get_selector, select_batch
from pipeline.strategies.schedule import Phase, choose_phase, newest_label_accuracy, strategy_label

if TYPE_CHECKING:
    from pipeline.strategies.candidates import CandidateSet

SELECT_VERSION = stage_version("3", "pipeline.selection")
UNCERTAINTY_FILE = "uncertainty.json"
OUTLIERS_FILE = "outliers.jsonl"
SELECTION_FILE = "selection.jsonl"


@dataclass(frozen=True)
class Space:
    """Selection embeddings keyed by sample ID (pipeline.embeddings); None stands for the scorer's (source model)."""

    ids: list[str]
    emb: np.ndarray
    source: str

    @functools.cached_property
    def index(self) -> IdIndex:
        return IdIndex(self.ids)

    def rows(self, wanted: Sequence[str]) -> np.ndarray:
        from pipeline.embeddings import lookup  # its module imports the image stack; selection alone need not

        return lookup(self.index, self.emb, wanted)


@dataclass
class RoundSelection:
    rows: list[dict[str, Any]]  # selection.jsonl, pick order
    strategy: str
    diversity: str
    uncertainty: tuple[list[str], np.ndarray] | None = None  # pool ids → entropy, for later rounds' outlier history
    outliers: list[dict[str, Any]] | None = None
    info: dict[str, Any] = field(default_factory=dict)


def heuristic_input(scores: Any, strategy: str) -> np.ndarray | None:
    """The array heuristic `strategy` reads (its `input`): candidate probs ([n, c], MC-averaged when only MC
    samples exist), MC samples [n, c, k], token entropies, or agreement codes; None when the scores lack it."""
    from pipeline.scoring import agreement_codes

    kind = get_heuristic(strategy).input
    if kind == "token_entropy":
        return scores.token_entropy
    if kind == "agreement":
        return agreement_codes(scores.mc_answers) if scores.mc_answers else None
    if kind == "meanings":
        from pipeline.meaning import meaning_codes

        return meaning_codes(scores.mc_answers) if scores.mc_answers else None
    if kind == "mc_probs":
        return scores.mc_probs
    if kind == "none":
        return None
    return scores.mc_probs.mean(-1) if scores.mc_probs is not None and scores.probs is None else scores.probs


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
    phase: Phase | None = None,
    seconds: Mapping[str, float] | None = None,
    box_labels: Sequence[str] | None = None,
) -> RoundSelection:
    """Pick the round's batch.

    `scores` (a ScoreResult, row-aligned with its own sample_ids) may be None only at a cold start, with `space`
    giving the embeddings; then `candidate_ids` are the candidates. Embeddings for diversity, coverage and outliers
    come from `space` when given, else from the scores. `phase` (the schedule's choice) overrides the configured
    strategy × diversity after the cold start. `seconds` (recorded seconds per labeled sample) feed the cost model
    when `select.cost` is predicted (`round_cost`). `box_labels`: a box project's class list (data.box_labels);
    a selector that wants it (class_balanced) reads each candidate's predicted boxes per class from its answer.
    """
    from pipeline.scoring import predictions  # the scorers' module imports torch; a cold start need not

    labeled = set(labeled)
    if scores is None and (space is None or not cold_start):
        raise SelectionError("select: a round after the cold start needs the pool's scores; score the pool first")
    ids = list(scores.sample_ids) if scores is not None else sorted(candidate_ids)
    emb = space.rows(ids) if space is not None else (scores.embeddings if scores is not None else None)
    out = RoundSelection([], "", "")
    exclude, downweight = set(exclude), []
    if not cold_start:
        out.uncertainty = _pool_uncertainty(scores, ids, labeled)
        if emb is not None:
            flagged = _flag_outliers(sel_cfg, out, ids, emb, history, labeled)
            exclude |= set(flagged) if sel_cfg.outliers == "exclude" else set()
            downweight = flagged if sel_cfg.outliers == "downweight" else []
    strategy, diversity, probs = round_pair(sel_cfg, scores, cold_start=cold_start, phase=phase)
    costs, cost_x, cost_model = (None, None, None) if cold_start else round_cost(
        sel_cfg, ids=ids, emb=emb, scores=scores, labeled=labeled, seconds=seconds, seed=seed)
    predicted_answer, confidence = predictions(scores, answers) if scores is not None else ([None] * len(ids),) * 2
    predicted = scores.probs.argmax(1) if scores is not None and scores.probs is not None else None
    if box_labels and get_selector(diversity).reads_predicted == "box_counts":
        predicted = box_class_counts(predicted_answer, box_labels)
    cands = Candidates(ids, probs=probs, embeddings=emb, labeled_embeddings=labeled_rows(labeled, ids, emb, space),
                       predicted=predicted, exclude=exclude | labeled, costs=costs)
    selection = select_batch(cands, k=sel_cfg.batch_size, strategy=strategy, diversity=diversity, seed=seed,
                             options=selector_options(diversity, len(answers) if answers else None,
                                                      box_labels=box_labels),
                             downweight=downweight, downweight_weight=sel_cfg.outlier_weight)
    if cost_model is not None:
        from pipeline.strategies.cost import forecast_hours

        out.info["cost"] = {**cost_model.report, "next_batch": len(selection.positions),
                            "next_batch_hours": round(forecast_hours(cost_model, cost_x[selection.positions]), 4)}
    # `strategy` / `diversity` are the heuristic and selector that ran; `round_strategy` the round's one name.
    label = strategy_label(sel_cfg.cold_start, sel_cfg.strategy, sel_cfg.diversity, cold=cold_start,
                           phase=phase.as_dict() if phase is not None else None)
    for row, i in zip(selection.rows(), selection.positions, strict=True):
        out.rows.append({**row, "rank": row["rank"] - 1, "prediction": predicted_answer[i],
                         "confidence": confidence[i], "scores": {strategy: row["score"]}, "round_strategy": label})
    out.strategy, out.diversity = strategy, diversity
    out.info.update(n=len(out.rows), strategy=strategy, diversity=diversity, round_strategy=label,
                    pool=len(ids) - len(labeled & set(ids)),
                    embeddings=space.source if space is not None else "model")
    if getattr(selection, "info", None):
        out.info["selector"] = selection.info
    return out

def box_class_counts(answers: Sequence[str | None], box_labels: Sequence[str]) -> np.ndarray:
    """[n, classes]: how many boxes of each class (box_labels' order) each answer text holds; a class outside the
    list is not counted."""
    from pipeline.boxes.codecs import answer_classes

    at = {label: c for c, label in enumerate(box_labels)}
    out = np.zeros((len(answers), len(box_labels)), dtype=np.int64)
    for i, text in enumerate(answers):
        for label in answer_classes(text):
            if label in at:
                out[i, at[label]] += 1
    return out


def _pool_uncertainty(scores: Any, ids: list[str], labeled: set[str]) -> tuple[list[str], np.ndarray] | None:
    """The unlabeled samples' uncertainty (pool_uncertainty), for later rounds' outlier history."""
    if scores is None or (u := pool_uncertainty(scores)) is None:
        return None
    pool = [i for i, s in enumerate(ids) if s not in labeled]
    return [ids[i] for i in pool], u[pool]


def _flag_outliers(sel_cfg: SelectConfig, out: RoundSelection, ids: list[str], emb: np.ndarray,
                   history: list[dict[str, float]], labeled: set[str]) -> list[str]:
    """The samples find_outliers flags (far from the labels and persistently uncertain), recorded in `out`; what
    happens to them (select.outliers) is the caller's."""
    from pipeline.strategies.outliers import find_outliers

    report = find_outliers(ids, emb, history, labeled_ids=labeled, k=sel_cfg.outlier_neighbors,
                           z_threshold=sel_cfg.outlier_z, min_rounds=sel_cfg.uncertain_rounds, policy=sel_cfg.outliers)
    out.outliers = report.rows()
    out.info["outliers"] = {"flagged": len(out.outliers), "far": int(report.far.sum()),
                            "persistent": int(report.persistent.sum()), "policy": sel_cfg.outliers}
    return [r["sample_id"] for r in out.outliers]


def round_pair(sel_cfg: SelectConfig, scores: Any | None, *, cold_start: bool,
               phase: Phase | None) -> tuple[str, str, np.ndarray | None]:
    """(strategy, diversity, the array the heuristic reads) of a round: the cold-start pair, else the phase's (the
    schedule's choice), else the configured one."""
    if cold_start:
        return (*cold_start_choice(sel_cfg.cold_start), None)
    strategy = phase.strategy if phase is not None else sel_cfg.strategy
    diversity = phase.diversity if phase is not None else sel_cfg.diversity
    probs = heuristic_input(scores, strategy)
    heuristic = get_heuristic(strategy)
    if probs is None and heuristic.input != "none":
        raise SelectionError(f"select.strategy {strategy!r} needs {heuristic.requires}; the pool was scored "
                             f"with {sel_cfg.mc_dropout_passes} MC passes")
    return strategy, diversity, probs


def labeled_rows(labeled: Collection[str], ids: Sequence[str], emb: np.ndarray | None,
                 space: Space | None) -> np.ndarray | None:
    """The labeled samples' embeddings (Candidates.labeled_embeddings): from `space` when given, else the rows of
    `emb` (row-aligned with `ids`) that are labeled; None without embeddings or labels. A caller that gives its own
    `emb` passes no space: the labeled rows must share the candidates' space."""
    if not labeled or emb is None:
        return None
    if space is not None:
        return space.rows(sorted(labeled))
    at = {s: i for i, s in enumerate(ids)}
    rows = [at[s] for s in sorted(labeled) if s in at]
    return emb[rows] if rows else None


def selector_options(diversity: str, n_classes: int | None, options: Mapping[str, Any] | None = None, *,
                     box_labels: Sequence[str] | None = None) -> dict:
    """The round's facts a selector asks for (`Selector.wants`, e.g. n_classes, a box project's box_labels), unless
    `options` sets them; unknown facts are left out."""
    facts = {"n_classes": n_classes, "box_labels": None if box_labels is None else list(box_labels)}
    return {**{f: facts[f] for f in get_selector(diversity).wants if facts.get(f) is not None}, **(options or {})}


def round_cost(sel_cfg: SelectConfig, *, ids: Sequence[str], emb: np.ndarray | None, scores: Any | None,
               labeled: Collection[str], seconds: Mapping[str, float] | None,
               seed: int) -> tuple[np.ndarray | None, np.ndarray | None, Any]:
    """(predicted seconds per row of `ids` or None for cost-blind, the cost features, the CostModel) when
    `select.cost` is predicted; (None, None, None) otherwise. Features: the selection embeddings and the model's
    confidence in its answer (max probability) where the pool was scored with class probabilities."""
    if sel_cfg.cost != "predicted":
        return None, None, None
    from pipeline.strategies.cost import features, round_costs

    probs = scores.probs if scores is not None and scores.probs is not None else None
    x = features(emb, None if probs is None else probs.max(1))
    costs, model = round_costs(ids, x, sorted(labeled), seconds or {}, min_timed=sel_cfg.cost_min_timed,
                               min_r2=sel_cfg.cost_min_r2, seed=seed)
    return costs, x, model


# ------------------------------------------------------------------------------------------- the select stage
def uncertainty_history(round_dirs: Sequence[Path]) -> list[dict[str, str]]:
    """Earlier rounds' pool uncertainty files (oldest first), with digests for the select stage's cache key."""
    files = [Path(d) / "selection" / UNCERTAINTY_FILE for d in round_dirs]
    return [{"path": str(f), "digest": digest_file(f)} for f in files if f.is_file()]


@dataclass(frozen=True)
class SelectParams:
    """The select stage's parameters, built by plan_selection; its cache key is their `key_fields()`. The ID files
    (candidates, exclusions, labeled) are too long to be parameters: their digests key the stage on them."""

    artifacts: str
    select: dict[str, Any]  # the select section as JSON data (batch_size cut to what the label budget leaves)
    answers: list[str] | None
    candidates_digest: str
    exclude_digest: str
    exclude_path: str
    labeled_path: str
    pool_path: str
    history: list[dict[str, str]]  # earlier rounds' uncertainty files (uncertainty_history)
    cold_start: bool
    phase: Phase | None
    space: StageRef | None  # the selection-embeddings stage's output; None = the model's own embeddings
    adapter_digest: str | None
    seed: int
    out_dir: str
    candidates: dict[str, Any] | None = None  # how a restricted (or auto) round's candidates were chosen
    seconds: dict[str, str] | None = None  # {path, digest} of the labeled samples' seconds (select.cost: predicted)
    shard_refs: list[StageRef] = field(default_factory=list)  # the pool's score shards, added once scored
    box_labels: list[str] | None = None  # a box project's class list (class_balanced reads it)


@dataclass
class SelectionPlan:
    """What the select stage of a round needs: the candidates to score (pool + labeled samples, whose embeddings
    tell pool outliers from samples near labels), whether to score them at all, and the stage's parameters."""

    candidates: list[str]
    score: bool  # a cold start in a non-model selection space scores nothing
    params: SelectParams  # all but shard_refs

    def stage_params(self, shard_refs: Sequence[Mapping[str, Any]]) -> SelectParams:
        """The stage's parameters once the pool is scored (`shard_refs`: the score-shard tasks' results)."""
        return replace(self.params, shard_refs=[StageRef.of(r) for r in shard_refs])


def round_phase_of(select: SelectConfig, answers: list[str] | None, *, labels: Mapping[str, str],
                   history_dirs: Sequence[Path]) -> Phase:
    """round_phase for a round after the cold start, from earlier rounds' selection files (`history_dirs`): known
    before the round trains, so its metrics and its selection name the same phase."""
    previous = [read_jsonl(f) for d in history_dirs if (f := Path(d) / "selection" / SELECTION_FILE).is_file()]
    return round_phase(select, labels=labels, n_classes=len(answers) if answers else None,
                       previous_selections=previous)


def planned_strategy(select: SelectConfig, answers: list[str] | None, labels: Mapping[str, str],
                     history_dirs: Sequence[Path]) -> str:
    """The round's one strategy name (strategy_label) before it trains: a cold start without labels, else its phase
    (round_phase_of), so the metrics booked after training and the selection made after it carry the same name."""
    phase = round_phase_of(select, answers, labels=labels, history_dirs=history_dirs).as_dict() if labels else None
    return strategy_label(select.cold_start, select.strategy, select.diversity, cold=not labels, phase=phase)


def plan_selection(cfg: ProjectConfig, *, round_dir: Path, pool_ids: Sequence[str], exclude: Collection[str],
                   labels: Mapping[str, str], adapter: Mapping[str, Any] | None, space: Mapping[str, Any] | None,
                   history_dirs: Sequence[Path], batch_size: int | None = None) -> SelectionPlan:
    """Plan the select stage of the round in `round_dir`: writes its candidate, exclusion and labeled ID files (they
    are too long to be parameters), and decides the round's phase from earlier rounds' selections. `batch_size`:
    the batch the label budget leaves (rounds.budget_batch), when below select.batch_size. A round's planning
    function: it reads the select, data, paths and seed sections, and hands the stage only its SelectParams."""
    labeled_ids = sorted(labels) if adapter is not None else []
    answers, space_ref = cfg.data.scored_answers, StageRef.of(space) if space else None  # a box project's model writes text: scored as open answers
    phase = round_phase_of(cfg.select, answers, labels=labels, history_dirs=history_dirs) if adapter else None
    from pipeline.strategies.candidates import candidates_choice  # its module imports the embeddings' lookup

    restricted = choice = None
    if adapter is not None:
        # Only rounds that score are restricted: a cold start in a selection space scores nothing and picks from it all.
        choice = candidates_choice(cfg.select.candidates, eligible=len(pool_ids),
                                   embeddings_source=cfg.select.embeddings.source)
        if choice.method == "restrict":
            restricted = restrict_candidates(cfg.select, n_classes=len(answers) if answers else None, seed=cfg.seed,
                                             cache_dir=Path(cfg.artifacts) / "candidates", pool_ids=pool_ids,
                                             labeled_ids=labeled_ids, space=space_ref, phase=phase)
    candidates = sorted(set(restricted.ids if restricted is not None else pool_ids) | set(labeled_ids))
    pool_path, exclude_path, labeled_path = (round_dir / "candidates.jsonl", round_dir / "exclude.jsonl",
                                             round_dir / "labeled_ids.jsonl")
    atomic_write_jsonl(pool_path, [{"sample_id": s} for s in candidates])
    exclude_rows = [{"sample_id": s} for s in sorted(set(exclude) | set(labeled_ids))]
    atomic_write_jsonl(exclude_path, exclude_rows)
    atomic_write_jsonl(labeled_path, [{"sample_id": s} for s in labeled_ids])
    # The candidates travel as a file: their digest is what keys the stage on them (a cold start has no score refs).
    select = cfg.section("select")
    if batch_size is not None and batch_size < select["batch_size"]:
        select["batch_size"] = batch_size  # the key moves only for a cut batch: other rounds keep theirs
    how = None
    if restricted is not None:
        how = {**restricted.info, "method": "restrict", "scored": len(candidates), "reason": choice.reason}
    elif choice is not None and cfg.select.candidates.method == "auto":
        # Said only for auto: a project that asked for all scores every eligible sample.
        how = {"method": "all", "eligible": len(pool_ids), "scored": len(candidates), "reason": choice.reason}
    seconds = labeled_seconds(cfg.artifacts, round_dir, labeled_ids) if (
        cfg.select.cost == "predicted" and adapter is not None) else None
    params = SelectParams(artifacts=str(cfg.artifacts), select=select, answers=answers,
                          candidates_digest=digest_json(candidates), exclude_digest=digest_json(exclude_rows),
                          exclude_path=str(exclude_path), labeled_path=str(labeled_path), pool_path=str(pool_path),
                          history=uncertainty_history(list(history_dirs)), cold_start=adapter is None, phase=phase,
                          space=space_ref, adapter_digest=(adapter or {}).get("digest"), seed=cfg.seed,
                          out_dir=str(round_dir / "selection"), candidates=how, seconds=seconds,
                          box_labels=cfg.data.box_labels)
    return SelectionPlan(candidates, adapter is not None or space is None, params)


def coverage_picker(strategy: str, diversity: str, *, space: Space, labeled: Collection[str],
                    n_classes: int | None) -> tuple[str, Any] | None:
    """In a coverage phase, (selector name, pick(eligible, k, seed)): that phase's selector over the whole eligible
    pool, whose batch is a coverage phase's candidates (pipeline.strategies.candidates); None otherwise."""
    from pipeline.strategies.candidates import picks_by_space

    if not picks_by_space(strategy, diversity):
        return None

    def pick(eligible: list[str], k: int, seed: int) -> list[str]:
        return select_step(eligible, k=k, strategy=strategy, diversity=diversity, seed=seed, labeled=labeled,
                           space=space, n_classes=n_classes).ids

    return diversity, pick


def restrict_candidates(select: SelectConfig, *, n_classes: int | None, seed: int, cache_dir: Path,
                        pool_ids: Sequence[str], labeled_ids: Sequence[str], space: StageRef | None,
                        phase: Phase | None = None) -> CandidateSet:
    """The round's candidates under `select.candidates: restrict`, from the selection-embeddings stage `space`
    (pipeline.strategies.candidates); its k-means labels are cached under `cache_dir` (artifacts/candidates/)."""
    from pipeline.embeddings import load_selection_embeddings
    from pipeline.strategies.candidates import round_candidates

    if space is None:
        raise SelectionError("select.candidates: restrict needs the selection-embeddings stage; set select.embeddings "
                             "to pool, pixels, vision_tower or file")
    ids, emb = load_selection_embeddings(space.dir)
    coverage = coverage_picker(phase.strategy if phase is not None else select.strategy,
                               phase.diversity if phase is not None else select.diversity,
                               space=Space(ids, emb, select.embeddings.source), labeled=labeled_ids,
                               n_classes=n_classes)
    return round_candidates(select, pool_ids=pool_ids, labeled_ids=labeled_ids, space_ids=ids, space_emb=emb,
                            seed=seed, cache_dir=cache_dir, space_digest=space.digest, coverage=coverage,
                            diversity=phase.diversity if phase is not None else select.diversity)


def labeled_seconds(artifacts: Any, round_dir: Path, labeled_ids: Sequence[str]) -> dict[str, str]:
    """The labeled samples' recorded seconds (median per sample, from the ledger's times) as the round's
    seconds.jsonl, the cost model's training data; {path, digest} for the select stage's key."""
    from pipeline.annotation.ledger import Ledger, ledger_path
    from pipeline.strategies.cost import seconds_per_sample

    per = seconds_per_sample(Ledger(ledger_path(artifacts)).times())
    rows = [{"sample_id": s, "seconds": per[s]} for s in sorted(labeled_ids) if s in per]
    path = round_dir / "seconds.jsonl"
    atomic_write_jsonl(path, rows)
    return {"path": str(path), "digest": digest_json(rows)}


def select_stage(params: SelectParams) -> dict[str, Any]:
    """The select stage: the round's batch from its scores (and selection space) into `params.out_dir`. A restricted
    round's `params.candidates` (how they were chosen) is recorded in the manifest and the returned ref."""
    from pipeline.embeddings import load_selection_embeddings
    from pipeline.scoring import concat_scores, load_scores
    from pipeline.strategies.outliers import read_uncertainty_history, write_uncertainty

    p = params
    sel_cfg = SelectConfig.model_validate(p.select)
    scores = concat_scores([load_scores(r.dir) for r in p.shard_refs]) if p.shard_refs else None
    sp = Space(*load_selection_embeddings(p.space.dir), source=sel_cfg.embeddings.source) if p.space else None
    labeled = sorted(r["sample_id"] for r in read_jsonl(p.labeled_path))
    result = select_round(
        sel_cfg, candidate_ids=[r["sample_id"] for r in read_jsonl(p.pool_path)], scores=scores, space=sp,
        labeled=set(labeled), exclude={r["sample_id"] for r in read_jsonl(p.exclude_path)}, answers=p.answers,
        history=read_uncertainty_history([h["path"] for h in p.history]), cold_start=p.cold_start, seed=p.seed,
        phase=p.phase, seconds={r["sample_id"]: float(r["seconds"]) for r in read_jsonl(p.seconds["path"])}
        if p.seconds else None, box_labels=p.box_labels,
    )
    if p.candidates is not None:
        result.info["candidates"] = p.candidates
    out = Path(p.out_dir)
    outputs = {"selection": SELECTION_FILE}
    if result.uncertainty is not None:
        write_uncertainty(out / UNCERTAINTY_FILE, *result.uncertainty)
        outputs["uncertainty"] = UNCERTAINTY_FILE
    if result.outliers is not None:
        atomic_write_jsonl(out / OUTLIERS_FILE, result.outliers)
        outputs["outliers"] = OUTLIERS_FILE
    atomic_write_jsonl(out / SELECTION_FILE, [{**r, "adapter_digest": p.adapter_digest} for r in result.rows])
    phase = p.phase.as_dict() if p.phase is not None else None  # round.json and the manifest hold it as JSON
    m = write_manifest(out, stage="select", stage_version=SELECT_VERSION,
                       inputs={"scores": digest_json([r.digest for r in p.shard_refs]),
                               "exclude": p.exclude_digest, "candidates": p.candidates_digest,
                               "labeled": digest_json(labeled), "space": p.space.digest if p.space else "model",
                               "history": digest_json([h["digest"] for h in p.history]),
                               **({"seconds": p.seconds["digest"]} if p.seconds else {})},
                       config={**p.select, "phase": phase}, outputs=outputs, info={**result.info, "phase": phase})
    return {"dir": p.out_dir, "digest": m.key, **{k: v for k, v in result.info.items() if k != "selector"},
            "phase": phase}


def selection_rows(ref: Mapping[str, Any]) -> list[dict[str, Any]]:
    return read_jsonl(Path(ref["dir"]) / SELECTION_FILE)


def selection_table(rows: list[dict[str, Any]], top: int = 20) -> list[dict[str, Any]]:
    """The top of a selection as the Prefect UI's table shows it."""
    return [{k: r.get(k) for k in ("rank", "sample_id", "score", "prediction", "confidence")} for r in rows[:top]]


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
    downweight: Collection[str] = (),
    downweight_weight: float = 0.5,
    costs: np.ndarray | None = None,
) -> Selection:
    """select_batch for a caller that holds a labeled set and a Space rather than the Candidates (a benchmark's
    learner, coverage_picker): a thin wrapper that builds them as select_round does.

    `probs` (what the heuristic reads, `heuristic_input`), `predicted` and `costs` are row-aligned with
    `candidate_ids`; embeddings are `embeddings` (row-aligned), else `space`'s rows; the labeled samples'
    embeddings come from `space` when given (labeled_rows), and `labeled` are never picked. The round's facts a
    selector asks for are passed unless `options` sets them (selector_options).
    """
    ids = list(candidate_ids)
    labeled = set(labeled)
    emb = embeddings if embeddings is not None else (space.rows(ids) if space is not None else None)
    cands = Candidates(ids, probs=probs, embeddings=emb, predicted=predicted, costs=costs,
                       labeled_embeddings=labeled_rows(labeled, ids, emb, space if embeddings is None else None),
                       exclude=set(exclude) | labeled)
    return select_batch(cands, k=k, strategy=strategy, diversity=diversity, seed=seed,
                        options=selector_options(diversity, n_classes, options), downweight=downweight,
                        downweight_weight=downweight_weight)
