"""The export stage: a round's selection written for annotators, and pushed to a live Label Studio project."""

from __future__ import annotations

from typing import Any

from flows.stages import run_stage, stage_task
from pipeline.annotation.export import EXPORT_VERSION, export_params, export_stage
from pipeline.annotation.label_studio import push_batch
from pipeline.config import ProjectConfig
from pipeline.stage_ref import StageRef

export_task = stage_task("export", EXPORT_VERSION)(export_stage)


def export_ref(cfg: ProjectConfig, *, selection: dict[str, Any], prepared: StageRef | dict[str, Any],
               round_index: int) -> dict[str, Any]:
    """Run (or reuse) the export of a round's selection; with annotate.label_studio the batch is pushed too (its
    result under "label_studio"). Call it inside a flow."""
    ref = run_stage(export_task, params=export_params(cfg.annotate, cfg.data.scored_answers, artifacts=cfg.artifacts,
                                                      selection=selection, prepared=prepared,
                                                      round_index=round_index, box_labels=cfg.data.box_labels,
                                                      model=cfg.model, schema=cfg.data.schema))
    if cfg.annotate.label_studio is not None:
        ref = {**ref, "label_studio": push_batch(cfg.annotate, cfg.artifacts, ref["dir"])}
    return ref
