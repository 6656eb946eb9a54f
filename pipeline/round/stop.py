"""When a round stops selecting, and what the label budget leaves: the stop rules of the rounds section, the
batch size the budget allows, the stop set a round scores, and whether a finished round waits for its annotators.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import ProjectConfig, RoundsConfig
from pipeline.round.plan import Eligible, PoolData, RoundPlan
from pipeline.round_state import RoundState


def main_metric(answers: Sequence[str] | None, task: str = "answer") -> str:
    """The metric the rounds are judged by: accuracy on a closed answer set (data.answers), token F1 on open answers,
    mAP@0.5 on boxes (data.task: boxes)."""
    if task == "boxes":
        return "map50"
    return "accuracy" if answers else "token_f1"


def stop_reason(rc: RoundsConfig, round_index: int, n_labels: int, metrics: Sequence[Mapping[str, Any]],
                pool_left: int, stability: Mapping[str, Any] | None = None, *, main: str = "accuracy",
                hours: float = 0.0, outstanding: int = 0) -> str | None:
    """Why no further batch should be selected, or None: the first rule of `rc` (the rounds section) that says stop.
    `main`: the metric the curve is read in (main_metric); `stability`: the stop set's agreement (pipeline.stopping);
    `hours`: annotator hours recorded so far (recorded_hours); `outstanding`: tasks exported earlier and still with
    the annotators, which the label budget has already promised."""
    from pipeline.stopping import converged_reason, stable_reason

    curve = [m["value"] for m in sorted(metrics, key=lambda m: m["round"]) if m["metric"] == main]
    reasons = (  # in the order they are reported: the first that applies is the round's
        _last_round(rc, round_index),
        _label_budget(rc, n_labels, outstanding),
        _hours_budget(rc, hours),
        _target(rc, main, curve),
        _plateau(rc, main, curve),
        stable_reason(stability, rc.stop_when_stable),
        converged_reason(stability, rc.stop_when_converged),
        _pool_empty(pool_left),
    )
    return next((why for why in reasons if why is not None), None)


def _last_round(rc: RoundsConfig, round_index: int) -> str | None:
    if round_index + 1 < rc.max_rounds:
        return None
    # max_rounds counts every round, round 0 included (RoundsConfig.max_rounds says so, as docs/rounds.md).
    return (f"rounds.max_rounds = {rc.max_rounds}: round {round_index} is the last (0–{rc.max_rounds - 1}); "
            "trained, selects nothing")


def _label_budget(rc: RoundsConfig, n_labels: int, outstanding: int) -> str | None:
    if rc.label_budget is None or n_labels + outstanding < rc.label_budget:
        return None
    out = f" + {outstanding} tasks still with the annotators" if outstanding else ""
    return f"label budget spent: {n_labels} labels{out} ≥ rounds.label_budget = {rc.label_budget}"


def _hours_budget(rc: RoundsConfig, hours: float) -> str | None:
    if rc.budget_hours is None or hours < rc.budget_hours:
        return None
    return f"hours budget spent: {hours:.2f} annotator-hours recorded ≥ rounds.budget_hours = {rc.budget_hours}"


def _target(rc: RoundsConfig, main: str, curve: Sequence[float]) -> str | None:
    if rc.target_metric is None or not curve or curve[-1] < rc.target_metric:
        return None
    return f"target reached: {main} = {curve[-1]:.4f} ≥ rounds.target_metric = {rc.target_metric}"


def _plateau(rc: RoundsConfig, main: str, curve: Sequence[float]) -> str | None:
    n = rc.plateau_rounds
    if n is None or len(curve) <= n or max(curve[-n:]) > max(curve[:-n]) + 0.005:
        return None
    return f"plateau: {main} has not improved by 0.005 over the last {n} rounds"


def _pool_empty(pool_left: int) -> str | None:
    return "pool exhausted: no unlabeled samples left to select" if pool_left == 0 else None


def close_round(cfg: ProjectConfig, plan: RoundPlan, state: RoundState, eligible: Eligible, *,
                agreed: Mapping[str, Any]) -> None:
    """The round's counts once its pool is known (`eligible`: the samples it may select and the tasks still out;
    labels spent; the consensus `agreed`), then whether it stops (stop_reason, on every rule of the rounds section)
    and whether its model is still at chance (pipeline.chance)."""
    from pipeline.chance import chance_check
    from pipeline.labelcheck import labels_spent
    from pipeline.metrics import read_metrics

    art, rc, main = cfg.artifacts, cfg.rounds, main_metric(cfg.data.answers, cfg.data.task)
    hours = recorded_hours(art) if rc.budget_hours is not None else 0.0
    rows, spent = read_metrics(art), labels_spent(len(plan.labels), art, before_round=plan.index)
    stopped = stop_reason(rc, plan.index, spent, rows, len(eligible.ids), state.stability, hours=hours, main=main,
                          outstanding=len(eligible.out))
    at_chance = chance_check(rows, cfg.data.scored_answers, train=cfg.train, model=cfg.model,
                             up_to_round=plan.index).warning
    state.update(agreed)
    state.pool, state.tasks_out, state.labels_spent = len(eligible.ids), len(eligible.out), spent
    state.stopped, state.at_chance = stopped, at_chance


def budget_batch(rounds_cfg: RoundsConfig, batch_size: int, spent: int, outstanding: int = 0) -> int:
    """The round's batch size: select.batch_size, cut to what rounds.label_budget has left after the labels spent
    and the tasks still with the annotators (a budget is a cap: 90 with batches of 40 gives 40, 40, then 10)."""
    if rounds_cfg.label_budget is None:
        return batch_size
    return max(0, min(batch_size, rounds_cfg.label_budget - spent - outstanding))


def batch_for(rounds_cfg: RoundsConfig, batch_size: int, state: RoundState) -> int:
    """budget_batch for the round `state` once close_round counted its labels spent and tasks out."""
    return budget_batch(rounds_cfg, batch_size, state.labels_spent or 0, state.tasks_out)


def budget_left(rounds_cfg: RoundsConfig, state: RoundState) -> int | None:
    """What rounds.label_budget leaves after this round's batch (`state`: labels_spent, tasks_out, selected), for
    the re-label queue sent with it; None without a budget."""
    if rounds_cfg.label_budget is None:
        return None
    return budget_batch(rounds_cfg, rounds_cfg.label_budget, (state.labels_spent or 0) + state.selected_count,
                        state.tasks_out)


def redundancy_cap(rounds_cfg: RoundsConfig, state: RoundState) -> int | None:
    """The labels rounds.label_budget leaves for the redundancy queue (each second opinion costs one): what the batch
    left (budget_left) less the re-label tasks sent with it; None without a budget."""
    left = budget_left(rounds_cfg, state)
    return None if left is None else max(0, left - (state.relabel or 0))


def recorded_hours(artifacts: str | os.PathLike[str]) -> float:
    """Annotator-hours recorded in the ledger's times (every timed annotation, re-labels included)."""
    from pipeline.annotation.ledger import Ledger, ledger_path

    return sum(float(r["seconds"]) for r in Ledger(ledger_path(artifacts)).times()) / 3600


def should_wait(rounds_cfg: RoundsConfig, state: RoundState, *, deployed: bool) -> bool:
    """Whether a finished round waits for its annotators: rounds.wait_for_labels, a batch was exported, and the run
    can be suspended and resumed later (only a deployment's run can: its worker starts it again)."""
    return bool(rounds_cfg.wait_for_labels and deployed and state.export_dir and not state.stopped)


@dataclass(frozen=True)
class StopSetCheck:
    """The stop set a round scores with its adapter (rounds.stop_set) and what its agreement is measured against."""

    ids: list[str]
    round_dir: Path
    out_dir: Path  # the round's stop-set scores (round_dir/stopset)
    previous_dir: Path | None  # the previous round's folder (its adapter's answers); None in the first
    target: float  # the agreement rounds.stop_when_stable asks for


def stop_set_check(rc: RoundsConfig, plan: RoundPlan, pool: PoolData, *, seed: int) -> StopSetCheck | None:
    """The round's stop-set measurement, or None without rounds.stop_set."""
    from pipeline.stopping import STOPSET

    if not rc.stop_set:
        return None
    rule = rc.stop_when_stable
    return StopSetCheck(pool.stop_set(rc.stop_set, seed), plan.dir, plan.dir / STOPSET,
                        plan.history[-1] if plan.history else None,
                        rule.agreement if rule else 0.99)
