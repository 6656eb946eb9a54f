"""The prepare flow: ingest → preprocess → quality, each a cached stage task; augmentation is a task the round flow
calls on its labeled set. Tasks take references (dataset folder + content digest) and config sections, never data.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.stages import run_stage, stage_task
from pipeline import augment as aug
from pipeline import preprocess as prep
from pipeline import quality as qual
from pipeline.config import ProjectConfig, load_config
from pipeline.stage_ref import PreparedRefs, StageRef

preprocess_task = stage_task(prep.STAGE, prep.PREPROCESS_VERSION)(prep.preprocess_stage)
quality_task = stage_task(qual.STAGE, qual.QUALITY_VERSION)(qual.quality_stage)
augment_task = stage_task(aug.STAGE, aug.AUGMENT_VERSION)(aug.augment_stage)


def prepare_refs(cfg: ProjectConfig, ingest_ref: dict[str, Any]) -> PreparedRefs:
    """Preprocess + quality for an ingested dataset; call it inside a flow. Each ref's info holds the stage's counts;
    load with pipeline.preprocess.load_prepared / pipeline.quality.load_quality."""
    prepared = run_stage(preprocess_task, params=prep.preprocess_params(cfg.artifacts, ingest_ref, cfg.preprocess,
                                                                       cfg.model, cfg.data.max_image_pixels))
    quality = run_stage(quality_task, params=qual.quality_params(cfg.artifacts, prepared, cfg.quality))
    refs = PreparedRefs(StageRef.of(prepared), StageRef.of(quality))
    prep.record_latest(cfg.artifacts, refs.as_dict())
    return refs


def augment_ref(cfg: ProjectConfig, labeled_ref: dict[str, Any], *, seed: int | None = None) -> dict[str, Any]:
    """Augment a labeled prepared set (a stage folder ref or {"dataset", "digest"}); call it inside a flow.

    Returns {"dir", "digest", "info"}; load with pipeline.augment.load_augmented. `seed` defaults to cfg.seed.
    """
    return run_stage(augment_task, params=aug.augment_params(cfg.artifacts, labeled_ref, cfg.augment,
                                                             cfg.seed if seed is None else seed))


@flow(name="prepare")
def prepare_flow(
    config_path: str | None = None, ingest_dir: str | None = None, source_digest: str | None = None
) -> dict[str, Any]:
    """Ingest (or take an already ingested stage folder) → preprocess → quality. Returns prepare_refs' dict plus
    "ingest". `source_digest` is the ingest cache input when the caller computed it already."""
    cfg = load_config(config_path)
    if ingest_dir is not None:
        ingest = {"dir": ingest_dir}
    else:
        from flows.ingest import ingest_ref

        ingest = ingest_ref(cfg, source_digest)
    return {"ingest": ingest, **prepare_refs(cfg, ingest).as_dict()}
