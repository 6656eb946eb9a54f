"""The training half of a round: augment → retrain the adapter → evaluate it → check the labels it learned from."""

from __future__ import annotations

from typing import Any

from flows.labelcheck import label_check_ref
from flows.prepare import augment_ref
from flows.stages import run_stage, stage_task
from flows.ui import progress_sink
from pipeline import report
from pipeline.augment import training_rows
from pipeline.config import ProjectConfig
from pipeline.evaluate import EVAL_VERSION, evaluate_stage
from pipeline.model.train_stage import TRAIN_VERSION, TrainParams, train_stage
from pipeline.round.params import evaluate_params, labeled_set, test_set, train_params
from pipeline.round.plan import PoolData, RoundPlan
from pipeline.round.records import label_check_record, record_evaluation
from pipeline.round.stop import StopSetCheck, stop_set_check
from pipeline.round_state import RoundState, adapter_ref
from pipeline.stage_ref import PreparedRefs
from pipeline.stopping import measure_stop_set

evaluate_task = stage_task("evaluate", EVAL_VERSION)(evaluate_stage)


@stage_task("train", TRAIN_VERSION)
def train_task(params: TrainParams) -> dict[str, Any]:
    reporter = report.StepReporter(lambda total: progress_sink("training-progress", f"training ({total} steps)"))
    rows = training_rows(params.labeled, params.augmented, geometry=params.box_labels is not None)
    return train_stage(params, rows, on_step=reporter)


def train_round(cfg: ProjectConfig, plan: RoundPlan, prep: PreparedRefs, state: RoundState,
                progress: report.RoundProgress,
                pool: PoolData) -> tuple[dict[str, Any], dict[str, str], dict[str, Any] | None]:
    """(the adapter's ref, the adapter as the score and select stages take it, the label check's ref or None) of a
    round that has labels; records its metrics, the stop set's agreement with the previous adapter
    (rounds.stop_set) and the label check in `state`."""
    pool.check_evaluable()
    labeled = labeled_set(pool, plan)
    aug = augment_ref(cfg, labeled) if cfg.augment.copies else None
    art = cfg.artifacts
    with progress.step("train"):
        adapter = run_stage(train_task, params=train_params(plan, artifacts=art, model=cfg.model, train=cfg.train,
                                                            seed=cfg.seed, labeled=labeled, augmented=aug,
                                                            box_labels=cfg.data.box_labels))
        scorer = adapter_ref(adapter)
    with progress.step("evaluate"):
        test = test_set(art, pool)
        record_evaluation(art, plan, state, run_stage(evaluate_task, params=evaluate_params(
            artifacts=art, model=cfg.model, answers=cfg.data.scored_answers, batch_size=cfg.select.score_batch_size,
            test=test, adapter=adapter, box_labels=cfg.data.box_labels,
            schema=cfg.data.schema)))
        if (stop := stop_set_check(cfg.rounds, plan, pool, seed=cfg.seed)) is not None:
            state.stability = stop_set_agreement(cfg, prep, scorer, stop)
    with progress.step("label check"):
        check = label_check_ref(cfg, labeled=labeled, previous=plan.last,
                                round_dir=plan.dir, prepared=prep.prepare)
    state.labelcheck = label_check_record(check)
    return adapter, scorer, check


def stop_set_agreement(cfg: ProjectConfig, prep: PreparedRefs, adapter: dict[str, str],
                       stop: StopSetCheck) -> dict[str, Any]:
    """Score the stop set with the round's adapter (cached shards, like the pool's) and compare its answers with
    the previous round's adapter's."""
    from flows.select import score_pool

    refs, _ = score_pool(cfg, prepared=prep.prepare, adapter=adapter, pool_ids=stop.ids,
                         round_dir=stop.out_dir)
    return measure_stop_set(refs, ids=stop.ids, answers=cfg.data.scored_answers, round_dir=stop.round_dir,
                            previous_dir=stop.previous_dir, target=stop.target)
