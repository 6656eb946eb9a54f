"""The pool's score-shard stage: the round's pool cut into fixed shards, each scored (pipeline.scoring's scorers) by
a model loaded once per worker, into a folder keyed by adapter, prepared data, shard IDs, model and scoring settings.

Separate from pipeline/scoring.py, which scores rows with a loaded model: this module loads the model and the
prepared data (pipeline.model, pipeline.preprocess), so the scorers stay on the floor below them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.codeversion import stage_version
from pipeline.config import ModelConfig, ProjectConfig, SelectConfig
from pipeline.errors import DataError
from pipeline.idindex import IdIndex
from pipeline.scoring import make_scorer, plan_shards, pool_shard_size, save_scores
from pipeline.stage_ref import StageRef
from pipeline.store import Manifest, digest_json, find_valid_manifest, reuse_or_compute, stage_key

# This stage's code closure holds the scorers it runs (pipeline.scoring): an edit to either moves every shard's key.
SCORE_VERSION = stage_version("1", "pipeline.score_stage")

__all__ = ["SCORE_VERSION", "PoolScoring", "ShardParams", "plan_pool_scoring", "read_pool_file", "score_config",
           "score_shard", "scored_on_disk", "shard_params", "write_pool_file"]


def score_config(select: SelectConfig, model: ModelConfig, *, answers: list[str] | None,
                 seed: int) -> dict[str, Any]:
    """The settings a shard's scores depend on (part of every shard's key), from the sections that hold them."""
    return {
        "answers": answers,
        "length_normalize": select.length_normalize,
        "mc_dropout_passes": select.mc_dropout_passes,
        "score_batch_size": select.score_batch_size,
        "max_new_tokens": model.max_new_tokens,
        "seed": seed,
    }


def shard_inputs(adapter: StageRef | None, prepared: StageRef, shard_ids: list[str]) -> dict[str, str]:
    return {"adapter": adapter.digest if adapter else "base", "prepared": prepared.digest,
            "shard": digest_json(shard_ids)}


def shard_manifest_key(inputs: dict[str, str], model: dict[str, Any], scoring: dict[str, Any]) -> str:
    return stage_key("score", SCORE_VERSION, inputs, {"model": model, "scoring": scoring})


def shard_dir(artifacts: str | Path, adapter: StageRef | None, prepared: StageRef, ids: list[str],
              model: dict[str, Any], scoring: dict[str, Any]) -> str:
    key = digest_json({"adapter": adapter.digest if adapter else None, "prepared": prepared.digest, "ids": ids,
                       "model": model, "scoring": scoring})
    return str(Path(artifacts) / "scores" / key[:16])


@dataclass(frozen=True)
class ShardParams:
    """One score-shard stage's parameters, built by shard_params; its cache key is their `key_fields()`."""

    artifacts: str
    model: dict[str, Any]  # the model section with its identity (pipeline.model.identity.keyed_model)
    adapter: StageRef | None  # the round's adapter (its PEFT folder and digest: adapter_ref); None for the base model
    prepared: StageRef  # the prepared data
    shard_ids: list[str]
    scoring: dict[str, Any]  # score_config
    out_dir: str

    def inputs(self) -> dict[str, str]:
        return shard_inputs(self.adapter, self.prepared, self.shard_ids)


def shard_params(artifacts: str | Path, *, model: dict[str, Any], scoring: dict[str, Any],
                 adapter: Mapping[str, Any] | None, prepared: StageRef | Mapping[str, Any], pool_ids: Sequence[str],
                 shard_size: int) -> list[ShardParams]:
    """One score-shard stage's parameters (its cache key) per shard of the pool, in shard order; `adapter` and
    `prepared` as the flow passes them (adapter_ref, the prepare stage's result)."""
    on, data = (StageRef.of(adapter) if adapter else None), StageRef.of(prepared)
    return [ShardParams(artifacts=str(artifacts), model=model, adapter=on, prepared=data, shard_ids=ids,
                        scoring=scoring, out_dir=shard_dir(artifacts, on, data, ids, model, scoring))
            for ids in plan_shards(pool_ids, shard_size)]


@dataclass(frozen=True)
class PoolScoring:
    """How a round scores its pool: what every shard shares (`parts`: the model section with its identity, the
    scoring settings, the adapter, the prepared data), the shard size, and each shard's stage parameters.

    The one place that plans a round's shards: the select flow scores them and the round report reads them back, so
    the two cannot drift apart (the report once keyed its look-up on the model section without its identity and
    found no shard)."""

    parts: dict[str, Any]
    shard_size: int
    shards: list[ShardParams]


def plan_pool_scoring(cfg: ProjectConfig, *, prepared: StageRef | Mapping[str, Any], adapter: dict[str, Any] | None,
                      pool_ids: Sequence[str]) -> PoolScoring:
    """The score shards of the pool `pool_ids` for the adapter `adapter` ({dir, digest}, None for the base model) on
    the prepared data `prepared` (its stage ref), keyed as the score stage keys them. A round's planning function:
    it reads the model, select, data, paths and seed sections and hands each shard its parameters."""
    from pipeline.model.identity import keyed_model

    scoring = score_config(cfg.select, cfg.model, answers=cfg.data.scored_answers, seed=cfg.seed)
    parts = dict(model=keyed_model(cfg.model, cfg.artifacts), scoring=scoring, adapter=adapter,
                 prepared=StageRef.of(prepared).as_dict())  # JSON: the score-pool subflow's parameters
    size = pool_shard_size(len(pool_ids), cfg.select.shard_size, cfg.select.max_tasks)
    return PoolScoring(parts, size, shard_params(cfg.artifacts, **parts, pool_ids=sorted(pool_ids), shard_size=size))


POOL_FILE = "pool.jsonl"


def write_pool_file(round_dir: str | Path, pool_ids: Sequence[str]) -> str:
    """The pool's IDs as a file in the round's folder: a 100k-sample pool would bloat a run's parameters."""
    from pipeline.store import atomic_write_jsonl

    return str(atomic_write_jsonl(Path(round_dir) / POOL_FILE, [{"sample_id": s} for s in sorted(pool_ids)]))


def read_pool_file(path: str | Path) -> list[str]:
    from pipeline.store import read_jsonl

    return [r["sample_id"] for r in read_jsonl(path)]


def scored_on_disk(params: Sequence[ShardParams]) -> list[dict[str, Any]] | None:
    """The shard refs when every shard has verified scores on disk, else None."""
    refs = []
    for p in params:
        if (m := find_valid_manifest(p.out_dir, shard_manifest_key(p.inputs(), p.model, p.scoring))) is None:
            return None
        refs.append({"dir": p.out_dir, "digest": m.key})
    return refs


@functools.lru_cache(maxsize=1)
def _loaded(model_json: str, adapter_dir: str | None, adapter_digest: str | None) -> Any:
    """One model per worker process, reused across its shards (the digest makes a retrained adapter a new entry)."""
    from pipeline.model.loading import load_model

    return load_model(ModelConfig.model_validate_json(model_json), adapter=adapter_dir)


@functools.lru_cache(maxsize=2)
def _index(prepared_dir: str) -> tuple[Any, IdIndex]:
    from pipeline.preprocess import load_prepared

    ds = load_prepared(prepared_dir)
    return ds, IdIndex.of_dataset(ds)


def score_shard(params: ShardParams) -> dict[str, Any]:
    """The score-shard stage: one shard of the pool scored into `params.out_dir` (or its verified scores reused).

    The manifest records stage "score": a "score_shard" key never matched, so a shard whose result Prefect had not
    recorded (killed just after its manifest, or a new PREFECT_HOME) was scored again despite verified outputs.
    """
    model, adapter, prepared, scoring = params.model, params.adapter, params.prepared, params.scoring
    shard_ids, out_dir, inputs = params.shard_ids, params.out_dir, params.inputs()

    def compute() -> Manifest:
        ds, index = _index(prepared.dir)
        # Only the columns a shard reads (a sample's later pictures and turns where the project has them): the
        # original images' pages are never touched.
        at = index.rows(shard_ids)
        if (at < 0).any():
            raise DataError(f"score shard {out_dir}: {int((at < 0).sum())} of {len(shard_ids)} samples (first: "
                            f"{shard_ids[int(np.flatnonzero(at < 0)[0])]}) are not in the prepared dataset "
                            f"{prepared.dir}; run the round again to re-plan its shards")
        more = [c for c in ("more_prepared", "context") if c in ds.column_names]
        rows = list(ds.select_columns(["sample_id", "prepared", "question", *more]).select(at.tolist()))
        loaded = _loaded(json.dumps(model, sort_keys=True), adapter and adapter.dir, adapter and adapter.digest)
        scorer = make_scorer(loaded, scoring["answers"], length_normalize=scoring["length_normalize"],
                             max_new_tokens=scoring["max_new_tokens"])
        result = scorer.score(rows, batch_size=scoring["score_batch_size"], mc_passes=scoring["mc_dropout_passes"],
                              seed=scoring["seed"])
        return save_scores(result, out_dir, version=SCORE_VERSION, inputs=inputs,
                           config={"model": model, "scoring": scoring})

    m = reuse_or_compute(out_dir, shard_manifest_key(inputs, model, scoring), compute)
    return {"dir": out_dir, "digest": m.key}
