"""Score the pool in cached shards, then select the round's batch.

Each shard is one task keyed by adapter digest + shard content + scoring config + stage version, so a round killed
mid-scoring resumes at the first unfinished shard, and the shards can run on a Dask cluster (`select.runner: dask`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact

from flows.stages import ref_is_valid, run_stage, stage_task
from flows.ui import detach
from pipeline import selection as sel
from pipeline.config import ProjectConfig
from pipeline.embeddings import EMBEDDINGS_VERSION, embeddings_params, embeddings_stage
from pipeline.roundreport.sources import SelectionInputs
from pipeline.score_stage import (
    SCORE_VERSION,
    plan_pool_scoring,
    read_pool_file,
    score_shard,
    scored_on_disk,
    shard_params,
    write_pool_file,
)
from pipeline.stage_ref import StageRef

log = logging.getLogger(__name__)


def make_task_runner(cfg: ProjectConfig) -> Any:
    """Threads locally; a Dask cluster (or a local one when no address is given) for `select.runner: dask`."""
    if cfg.select.runner == "dask":
        from prefect_dask import DaskTaskRunner

        from pipeline.model.distributed import dask_runner_options
        from pipeline.model.hardware import detect_hardware

        return DaskTaskRunner(**dask_runner_options(cfg.select, detect_hardware()))
    from prefect.task_runners import ThreadPoolTaskRunner

    # Torch already uses every core inside one shard; more threads would only fight over them.
    return ThreadPoolTaskRunner(max_workers=1)


score_shard_task = stage_task("score_shard", SCORE_VERSION)(score_shard)
embeddings_task = stage_task("embeddings", EMBEDDINGS_VERSION)(embeddings_stage)
select_task = stage_task("select", sel.SELECT_VERSION)(sel.select_stage)


@flow(name="score-pool")
def score_pool_flow(artifacts: str, model: dict[str, Any], scoring: dict[str, Any], adapter: dict[str, Any] | None,
                    prepared: dict[str, Any], pool_file: str, shard_size: int) -> list[dict[str, Any]]:
    """One task per shard on this subflow's task runner (threads, or Dask workers); a keyed progress artifact (the
    Artifacts page lists it) shows shards done / total, updated at most 20 times for any pool size. The pool's
    IDs travel as a file: a 100k-sample pool would bloat the run's parameters."""
    shards = shard_params(artifacts, model=model, scoring=scoring, adapter=adapter, prepared=prepared,
                          pool_ids=read_pool_file(pool_file), shard_size=shard_size)
    progress = create_progress_artifact(progress=0.0, key="scoring-progress",
                                        description=f"pool scoring: 0 / {len(shards)} shards")
    futures = [score_shard_task.submit(params=p) for p in shards]
    refs = []
    for i, (fut, params) in enumerate(zip(futures, shards, strict=True), 1):
        ref = fut.result()
        if not ref_is_valid(ref, SCORE_VERSION):  # its shard folder was deleted, damaged or rescored since
            ref = score_shard_task.with_options(refresh_cache=True).submit(params=params).result()
        refs.append(ref)
        if i == len(futures) or i % max(1, len(futures) // 20) == 0:
            update_progress_artifact(progress, progress=100.0 * i / len(futures),
                                     description=f"pool scoring: {i} / {len(futures)} shards")
    return refs


def score_pool(cfg: ProjectConfig, *, prepared: StageRef | dict[str, Any], adapter: dict[str, Any] | None,
               pool_ids: list[str], round_dir: Path) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """Score the pool in shards with the task runner `select.runner` asks for (also under a deployment's worker).
    Returns the shards' refs and each shard's (first sample ID, folder), what the round's report reads."""
    plan = plan_pool_scoring(cfg, prepared=prepared, adapter=adapter, pool_ids=pool_ids)
    shards = [(p.shard_ids[0], p.out_dir) for p in plan.shards]
    pool_file = write_pool_file(round_dir, pool_ids)
    if (refs := scored_on_disk(plan.shards)) is not None:
        # A subflow of cached tasks would only cost API round trips (about a second per 20 shards).
        log.info("pool scoring: all %d shards already scored (outputs verified); nothing to run", len(refs))
        return refs, shards
    runner_flow = score_pool_flow.with_options(task_runner=make_task_runner(cfg),
                                               flow_run_name=f"round-{round_dir.name}-score-pool")
    # A plain copy: the subflow's own result, passed on to the select task, would make the Task Runs tab list nothing.
    return detach(runner_flow(artifacts=str(cfg.artifacts), **plan.parts, pool_file=pool_file,
                              shard_size=plan.shard_size)), shards


def embeddings_ref(cfg: ProjectConfig, prepared: StageRef | dict[str, Any]) -> dict[str, Any] | None:
    """The cached selection-embeddings stage, or None when selection uses the model's own embeddings."""
    params = embeddings_params(cfg, prepared)
    return run_stage(embeddings_task, params=params) if params is not None else None


def select_ref(cfg: ProjectConfig, *, prepared: StageRef | dict[str, Any], adapter: dict[str, Any] | None,
               pool_ids: list[str], exclude: list[str], round_dir: Path, labels: dict[str, str] | None = None,
               history_dirs: list[Path] = (), batch_size: int | None = None) -> tuple[dict[str, Any], SelectionInputs]:
    """Score the eligible pool (and the labeled samples) and select; writes round_dir/selection/. Call in a flow.
    Returns the select stage's ref and the stage folders it read (for the round's report)."""
    space = embeddings_ref(cfg, prepared)
    plan = sel.plan_selection(cfg, round_dir=round_dir, pool_ids=pool_ids, exclude=exclude, labels=dict(labels or {}),
                              adapter=adapter, space=space, history_dirs=list(history_dirs), batch_size=batch_size)
    refs, shards = score_pool(cfg, prepared=prepared, adapter=adapter, pool_ids=plan.candidates,
                               round_dir=round_dir) if plan.score else ([], [])
    ref = run_stage(select_task, params=plan.stage_params(refs))
    rows = sel.selection_rows(ref)
    create_table_artifact(key="selection", table=sel.selection_table(rows),
                          description=f"Top of the selection ({len(rows)} samples)")
    return ref, SelectionInputs(space and space["dir"], shards)
