"""Score the pool in cached shards, then select the round's batch.

Each shard is one task keyed by adapter digest + shard content + scoring config + stage version, so a round killed
mid-scoring resumes at the first unfinished shard, and the shards can run on a Dask cluster (`select.runner: dask`).
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact

from flows.stages import ref_is_valid, run_stage, stage_task
from flows.ui import detach
from pipeline.config import ModelConfig, ProjectConfig
from pipeline.preprocess import load_prepared
from pipeline.scoring import SCORE_VERSION, concat_scores, load_scores, make_scorer, plan_shards, save_scores
from pipeline.store import (
    atomic_write_jsonl,
    digest_json,
    find_valid_manifest,
    read_jsonl,
    stage_key,
    write_manifest,
)

log = logging.getLogger(__name__)
SELECT_VERSION = "3"


def make_task_runner(cfg: ProjectConfig) -> Any:
    """Threads locally; a Dask cluster (or a local one when no address is given) for `select.runner: dask`."""
    if cfg.select.runner == "dask":
        from prefect_dask import DaskTaskRunner

        if cfg.select.dask_address:
            return DaskTaskRunner(address=cfg.select.dask_address)
        from pipeline.model.distributed import device_cluster, scoring_devices
        from pipeline.model.hardware import detect_hardware

        # Dask binds the dashboard of ":8787" to every interface; keep the whole local cluster on loopback.
        local = {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:8787"}
        devices = scoring_devices(cfg.select.dask_workers, detect_hardware())
        if devices is not None:  # one worker process per GPU, each pinned to its device
            return DaskTaskRunner(cluster_class=device_cluster, cluster_kwargs={"devices": devices, **local})
        workers = 2 if cfg.select.dask_workers == "auto" else cfg.select.dask_workers
        return DaskTaskRunner(cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True,
                                              **local})
    from prefect.task_runners import ThreadPoolTaskRunner

    # Torch already uses every core inside one shard; more threads would only fight over them.
    return ThreadPoolTaskRunner(max_workers=1)


@functools.lru_cache(maxsize=1)
def _loaded(model_json: str, adapter_dir: str | None, adapter_digest: str | None) -> Any:
    """One model per worker process, reused across its shards (the digest makes a retrained adapter a new entry)."""
    from pipeline.model.loading import load_model

    return load_model(ModelConfig.model_validate_json(model_json), adapter=adapter_dir)


@functools.lru_cache(maxsize=2)
def _index(prepared_dir: str) -> tuple[Any, dict[str, int]]:
    ds = load_prepared(prepared_dir)
    return ds, {sid: i for i, sid in enumerate(ds["sample_id"])}


def score_config(cfg: ProjectConfig) -> dict[str, Any]:
    return {
        "answers": cfg.data.answers,
        "length_normalize": cfg.select.length_normalize,
        "mc_dropout_passes": cfg.select.mc_dropout_passes,
        "score_batch_size": cfg.select.score_batch_size,
        "max_new_tokens": cfg.model.max_new_tokens,
        "seed": cfg.seed,
    }


def shard_inputs(adapter: dict[str, Any] | None, prepared: dict[str, Any], shard_ids: list[str]) -> dict[str, str]:
    return {"adapter": (adapter or {}).get("digest", "base"), "prepared": prepared["digest"],
            "shard": digest_json(shard_ids)}


def shard_manifest_key(inputs: dict[str, str], model: dict[str, Any], scoring: dict[str, Any]) -> str:
    return stage_key("score", SCORE_VERSION, inputs, {"model": model, "scoring": scoring})


def shard_dir(artifacts: str, adapter: dict[str, Any] | None, prepared: dict[str, Any], ids: list[str],
              model: dict[str, Any], scoring: dict[str, Any]) -> str:
    key = digest_json({"adapter": (adapter or {}).get("digest"), "prepared": prepared["digest"], "ids": ids,
                       "model": model, "scoring": scoring})
    return str(Path(artifacts) / "scores" / key[:16])


@stage_task("score_shard", SCORE_VERSION)
def score_shard_task(
    artifacts: str,
    model: dict[str, Any],
    adapter: dict[str, Any] | None,
    prepared: dict[str, Any],
    shard_ids: list[str],
    scoring: dict[str, Any],
    out_dir: str,
) -> dict[str, Any]:
    inputs = shard_inputs(adapter, prepared, shard_ids)
    # save_scores records stage "score": a "score_shard" key never matched, so a shard whose result Prefect had not
    # recorded (killed just after its manifest, or a new PREFECT_HOME) was scored again despite verified outputs.
    if (m := find_valid_manifest(out_dir, shard_manifest_key(inputs, model, scoring))) is None:
        ds, index = _index(prepared["dir"])
        rows = ds.select([index[s] for s in shard_ids])
        rows = [{"sample_id": r["sample_id"], "prepared": r["prepared"], "question": r["question"]} for r in rows]
        loaded = _loaded(json.dumps(model, sort_keys=True), adapter and adapter["dir"], adapter and adapter["digest"])
        scorer = make_scorer(loaded, scoring["answers"], length_normalize=scoring["length_normalize"],
                             max_new_tokens=scoring["max_new_tokens"])
        result = scorer.score(rows, batch_size=scoring["score_batch_size"],
                              mc_passes=scoring["mc_dropout_passes"], seed=scoring["seed"])
        m = save_scores(result, out_dir, inputs=inputs, config={"model": model, "scoring": scoring})
    return {"dir": out_dir, "digest": m.key}


@flow(name="score-pool")
def score_pool_flow(artifacts: str, model: dict[str, Any], scoring: dict[str, Any], adapter: dict[str, Any] | None,
                    prepared: dict[str, Any], pool_file: str, shard_size: int) -> list[dict[str, Any]]:
    """One task per shard on this subflow's task runner (threads, or Dask workers); a progress artifact shows
    shards done / total. The pool's IDs travel as a file: a 100k-sample pool would bloat the run's parameters."""
    pool_ids = [r["sample_id"] for r in read_jsonl(pool_file)]
    shards = plan_shards(pool_ids, shard_size)
    # Keyed, so the Artifacts page lists it (unkeyed ones show only on this subflow's page).
    progress = create_progress_artifact(progress=0.0, key="scoring-progress",
                                        description=f"pool scoring: 0 / {len(shards)} shards")
    params, futures = [], []
    for ids in shards:
        params.append(dict(
            artifacts=artifacts, model=model, adapter=adapter, prepared=prepared, shard_ids=ids,
            scoring=scoring, out_dir=shard_dir(artifacts, adapter, prepared, ids, model, scoring),
        ))
        futures.append(score_shard_task.submit(**params[-1]))
    refs = []
    for i, fut in enumerate(futures, 1):
        ref = fut.result()
        if not ref_is_valid(ref):
            # The cached ref names a shard folder deleted or damaged since: score that shard again.
            ref = score_shard_task.with_options(refresh_cache=True).submit(**params[i - 1]).result()
        refs.append(ref)
        if i == len(futures) or i % max(1, len(futures) // 20) == 0:  # ≤ 20 API calls for any pool size
            update_progress_artifact(progress, progress=100.0 * i / len(futures),
                                     description=f"pool scoring: {i} / {len(futures)} shards")
    return refs


def scored_on_disk(cfg: ProjectConfig, *, prepared: dict[str, Any], adapter: dict[str, Any] | None,
                   pool_ids: list[str]) -> list[dict[str, Any]] | None:
    """The shard refs when every shard of the pool has verified scores on disk, else None."""
    model, scoring = cfg.section("model"), score_config(cfg)
    refs = []
    for ids in plan_shards(pool_ids, cfg.select.shard_size):
        out_dir = shard_dir(str(cfg.artifacts), adapter, prepared, ids, model, scoring)
        m = find_valid_manifest(out_dir, shard_manifest_key(shard_inputs(adapter, prepared, ids), model, scoring))
        if m is None:
            return None
        refs.append({"dir": out_dir, "digest": m.key})
    return refs


def score_pool(cfg: ProjectConfig, *, prepared: dict[str, Any], adapter: dict[str, Any] | None,
               pool_ids: list[str], round_dir: Path) -> list[dict[str, Any]]:
    """Score the pool in shards with the task runner `select.runner` asks for (also under a deployment's worker)."""
    pool_file = round_dir / "pool.jsonl"
    atomic_write_jsonl(pool_file, [{"sample_id": s} for s in sorted(pool_ids)])
    if (refs := scored_on_disk(cfg, prepared=prepared, adapter=adapter, pool_ids=sorted(pool_ids))) is not None:
        # Every shard is scored and verifies: a subflow of cached tasks would only cost API round trips (about a
        # second per 20 shards), which is most of an unchanged re-run.
        log.info("pool scoring: all %d shards already scored (outputs verified); nothing to run", len(refs))
        return refs
    runner_flow = score_pool_flow.with_options(task_runner=make_task_runner(cfg),
                                               flow_run_name=f"round-{round_dir.name}-score-pool")
    # A plain copy: the subflow's own result, passed on to the select task, would make the Task Runs tab list nothing.
    return detach(runner_flow(artifacts=str(cfg.artifacts), model=cfg.section("model"), scoring=score_config(cfg),
                       adapter=adapter, prepared=prepared, pool_file=str(pool_file),
                       shard_size=cfg.select.shard_size))


EMBED_VERSION = "1"
UNCERTAINTY_FILE = "uncertainty.json"
OUTLIERS_FILE = "outliers.jsonl"


@stage_task("embeddings", EMBED_VERSION)
def embeddings_task(artifacts: str, prepared: dict[str, Any], select: dict[str, Any], model: dict[str, Any] | None,
                    file_digest: str | None, seed: int, out_dir: str) -> dict[str, Any]:
    """Selection embeddings fitted on the pool's images only; keyed by the prepared data's content, the embeddings
    config, the seed, the base model (vision_tower) and the user's file (file), never by the adapter."""
    from pipeline.embeddings import compute_selection_embeddings, embeddings_key

    cfg = ProjectConfig.model_validate({"select": select, "seed": seed, "paths": {"artifacts": artifacts},
                                        **({"model": model} if model else {})})
    inputs = {"prepared": prepared["digest"]}
    if (m := find_valid_manifest(out_dir, embeddings_key(cfg, inputs))) is None:
        m = compute_selection_embeddings(cfg, load_prepared(prepared["dir"]), out_dir, inputs=inputs)
    return {"dir": out_dir, "digest": m.key}


def embeddings_ref(cfg: ProjectConfig, prepared: dict[str, Any]) -> dict[str, Any] | None:
    """The cached selection-embeddings stage, or None when selection uses the model's own embeddings."""
    from pipeline.embeddings import file_inputs

    emb = cfg.select.embeddings
    if emb.source == "model":
        return None
    # Prefect's cache sees only parameters: a changed embeddings file must change them.
    file_digest = digest_json(file_inputs(cfg)) if emb.source == "file" else None
    params = {"prepared": prepared, "select": {"embeddings": cfg.section("select")["embeddings"]},
              "model": cfg.section("model") if emb.source == "vision_tower" else None,
              "file_digest": file_digest, "seed": cfg.seed}
    out = Path(cfg.artifacts) / "embeddings" / digest_json(params)[:16]
    return run_stage(embeddings_task, artifacts=str(cfg.artifacts), out_dir=str(out), **params)


@stage_task("select", SELECT_VERSION)
def select_task(
    artifacts: str,
    shard_refs: list[dict[str, Any]],
    select: dict[str, Any],
    answers: list[str] | None,
    exclude_digest: str,
    exclude_path: str,
    labeled_path: str,
    pool_path: str,
    history: list[dict[str, str]],
    cold_start: bool,
    phase: dict[str, str] | None,
    space: dict[str, Any] | None,
    adapter_digest: str | None,
    seed: int,
    out_dir: str,
) -> dict[str, Any]:
    from pipeline.config import SelectConfig
    from pipeline.embeddings import load_selection_embeddings
    from pipeline.selection import Space, select_round
    from pipeline.strategies.outliers import read_uncertainty_history, write_uncertainty

    sel_cfg = SelectConfig.model_validate(select)
    scores = concat_scores([load_scores(r["dir"]) for r in shard_refs]) if shard_refs else None
    sp = None
    if space is not None:
        sp = Space(*load_selection_embeddings(space["dir"]), source=sel_cfg.embeddings.source)
    result = select_round(
        sel_cfg, candidate_ids=[r["sample_id"] for r in read_jsonl(pool_path)], scores=scores, space=sp,
        labeled={r["sample_id"] for r in read_jsonl(labeled_path)},
        exclude={r["sample_id"] for r in read_jsonl(exclude_path)}, answers=answers,
        history=read_uncertainty_history([h["path"] for h in history]), cold_start=cold_start, seed=seed,
        phase=phase,
    )
    out = Path(out_dir)
    outputs = {"selection": "selection.jsonl"}
    if result.uncertainty is not None:
        write_uncertainty(out / UNCERTAINTY_FILE, *result.uncertainty)
        outputs["uncertainty"] = UNCERTAINTY_FILE
    if result.outliers is not None:
        atomic_write_jsonl(out / OUTLIERS_FILE, result.outliers)
        outputs["outliers"] = OUTLIERS_FILE
    rows = [{**r, "adapter_digest": adapter_digest} for r in result.rows]
    atomic_write_jsonl(out / "selection.jsonl", rows)
    labeled = sorted(r["sample_id"] for r in read_jsonl(labeled_path))
    m = write_manifest(out, stage="select", stage_version=SELECT_VERSION,
                       inputs={"scores": digest_json([r["digest"] for r in shard_refs]), "exclude": exclude_digest,
                               "labeled": digest_json(labeled), "space": (space or {}).get("digest", "model"),
                               "history": digest_json([h["digest"] for h in history])},
                       config={**select, "phase": phase}, outputs=outputs,
                       info={**result.info, "phase": phase})
    return {"dir": out_dir, "digest": m.key, **{k: v for k, v in result.info.items() if k != "selector"},
            "phase": phase}


def selection_table(rows: list[dict[str, Any]], top: int = 20) -> list[dict[str, Any]]:
    return [{k: r.get(k) for k in ("rank", "sample_id", "score", "prediction", "confidence")} for r in rows[:top]]


def uncertainty_history(round_dirs: list[Path]) -> list[dict[str, str]]:
    """Earlier rounds' pool uncertainty files (oldest first), with digests for the select stage's cache key."""
    from pipeline.store import digest_file

    files = [d / "selection" / UNCERTAINTY_FILE for d in round_dirs]
    return [{"path": str(f), "digest": digest_file(f)} for f in files if f.is_file()]


def select_ref(cfg: ProjectConfig, *, prepared: dict[str, Any], adapter: dict[str, Any] | None,
               pool_ids: list[str], exclude: list[str], round_dir: Path, labels: dict[str, str] | None = None,
               history_dirs: list[Path] = ()) -> dict[str, Any]:
    """Score the eligible pool (and the labeled samples, whose embeddings tell pool outliers from samples near
    labels) and select; writes round_dir/selection/. A cold start in a non-model selection space scores nothing.
    Call from inside a flow."""
    from pipeline.selection import round_phase

    labels = dict(labels or {})
    labeled_ids = sorted(labels) if adapter is not None else []
    space = embeddings_ref(cfg, prepared)
    candidates = sorted(set(pool_ids) | set(labeled_ids))
    refs = []
    if adapter is not None or space is None:
        refs = score_pool(cfg, prepared=prepared, adapter=adapter, pool_ids=candidates, round_dir=round_dir)
    pool_path = round_dir / "candidates.jsonl"
    atomic_write_jsonl(pool_path, [{"sample_id": s} for s in candidates])
    exclude_rows = [{"sample_id": s} for s in sorted(set(exclude) | set(labeled_ids))]
    exclude_path = round_dir / "exclude.jsonl"
    atomic_write_jsonl(exclude_path, exclude_rows)
    labeled_path = round_dir / "labeled_ids.jsonl"
    atomic_write_jsonl(labeled_path, [{"sample_id": s} for s in labeled_ids])
    phase = None
    if adapter is not None:
        previous = [read_jsonl(f) for d in history_dirs if (f := Path(d) / "selection" / "selection.jsonl").is_file()]
        phase = round_phase(cfg.select, labels=labels, n_classes=len(cfg.data.answers) if cfg.data.answers else None,
                            previous_selections=previous).as_dict()
    ref = run_stage(
        select_task, artifacts=str(cfg.artifacts), shard_refs=refs, select=cfg.section("select"),
        answers=cfg.data.answers, exclude_digest=digest_json(exclude_rows), exclude_path=str(exclude_path),
        labeled_path=str(labeled_path), pool_path=str(pool_path), history=uncertainty_history(list(history_dirs)),
        cold_start=adapter is None, phase=phase, space=space, adapter_digest=(adapter or {}).get("digest"),
        seed=cfg.seed, out_dir=str(round_dir / "selection"),
    )
    rows = read_jsonl(Path(ref["dir"]) / "selection.jsonl")
    create_table_artifact(key="selection", table=selection_table(rows),
                          description=f"Top of the selection ({len(rows)} samples)")
    return ref
