"""The training half of a round: augment → retrain the adapter → evaluate it → check the labels it learned from."""

from __future__ import annotations

from typing import Any

from flows.labelcheck import label_check_ref
from flows.prepare import augment_ref
from flows.stages import run_stage, stage_task
from flows.ui import progress_sink
from pipeline import report, rounds
from pipeline.augment import training_rows
from pipeline.config import ProjectConfig
from pipeline.evaluate import EVAL_VERSION, evaluate_stage
from pipeline.metrics import book_metrics
from pipeline.model.train_stage import TRAIN_VERSION, train_stage
from pipeline.stopping import STOPSET, measure_stop_set

evaluate_task = stage_task("evaluate", EVAL_VERSION)(evaluate_stage)


@stage_task("train", TRAIN_VERSION)
def train_task(artifacts: str, labeled: dict, augmented: dict | None, model: dict, train: dict,
               seed: int, init_adapter: dict | None, out_dir: str) -> dict[str, Any]:
    def progress(total: int) -> Any:  # every ~20th of the run (each report is an API call)
        return report.StepReporter(total, progress_sink("training-progress", f"training ({total} steps)"),
                                   every=max(1, total // 20))

    return train_stage(artifacts, training_rows(labeled, augmented), model, train, seed, init_adapter, out_dir,
                       progress=progress)


def train_round(cfg: ProjectConfig, plan: rounds.RoundPlan, prep: dict[str, Any], state: dict[str, Any],
                progress: report.RoundProgress, pool: rounds.PoolData) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the adapter's ref, the label check's ref or None) of a round that has labels; records its metrics, the
    stop set's agreement with the previous adapter (rounds.stop_set) and the label check in `state`."""
    pool.check_evaluable()
    labeled = rounds.labeled_set(prep["prepare"], plan)
    aug = augment_ref(cfg, labeled) if cfg.augment.copies else None
    progress.start("train")
    adapter = run_stage(train_task, **rounds.train_params(cfg, plan, labeled=labeled, augmented=aug))
    progress.finish("train")
    progress.start("evaluate")
    test = rounds.test_set(cfg, prep["prepare"], pool)
    ev = run_stage(evaluate_task, **rounds.evaluate_params(cfg, test=test, adapter=adapter))
    state["metrics"], state["eval_dir"] = ev["metrics"], ev["dir"]
    book_metrics(cfg.artifacts, round_index=plan.index, labels=len(plan.labels), metrics=ev["metrics"],
                 strategy=state["strategy"], intervals=ev.get("intervals"))
    if cfg.rounds.stop_set:
        state["stability"] = stop_set_agreement(cfg, plan, prep, adapter, pool.stop_set(cfg.rounds.stop_set, cfg.seed))
    progress.finish("evaluate")
    progress.start("label check")
    check = label_check_ref(cfg, labeled=labeled, previous=plan.previous[-1] if plan.previous else None,
                            round_dir=plan.dir, prepared=prep["prepare"])
    progress.finish("label check")
    if check is not None:
        state["labelcheck"] = {k: check.get(k) for k in ("dir", "method", "checked", "issues", "abstained",
                                                         "oos_accuracy", "expected_false_alarms", "message")}
    return adapter, check


def stop_set_agreement(cfg: ProjectConfig, plan: rounds.RoundPlan, prep: dict[str, Any], adapter: dict[str, Any],
                       ids: list[str]) -> dict[str, Any]:
    """Score the stop set with the round's adapter (cached shards, like the pool's) and compare its answers with
    the previous round's adapter's."""
    from flows.select import score_pool

    refs = score_pool(cfg, prepared=prep["prepare"], adapter={"dir": adapter["adapter_dir"],
                                                                "digest": adapter["adapter_digest"]},
                      pool_ids=ids, round_dir=plan.dir / STOPSET)
    rule = cfg.rounds.stop_when_stable
    return measure_stop_set(refs, ids=ids, answers=cfg.data.answers, round_dir=plan.dir,
                            previous_dir=plan.history_dirs(cfg.artifacts)[-1] if plan.previous else None,
                            target=rule.agreement if rule else 0.99)
