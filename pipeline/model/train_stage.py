"""The round's train stage: its labeled (and augmented) rows → `train_adapter` → the adapter's reference.

Separate from train.py, which trains any rows: this module knows what a round hands on; TRAIN_VERSION stays beside
the training code it versions. The rows come from the caller (pipeline.augment.training_rows reads the labeled set
and the augment stage's copies), so the model floor never reads the augment stage above it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config import ModelConfig, TrainConfig
from pipeline.model.train import TRAIN_VERSION, StepHook, TrainSpec, train_adapter
from pipeline.store import read_manifest

if TYPE_CHECKING:
    from pipeline.round_state import AdapterRecord
    from pipeline.stage_ref import StageRef

__all__ = ["TRAIN_VERSION", "TrainParams", "train_stage", "trains_in_process"]


def trains_in_process(train: Any) -> bool:
    """Training hooks run in this process only when it trains alone (spawned ranks cannot reach the caller)."""
    from pipeline.model.hardware import detect_hardware, resolve_num_processes

    return resolve_num_processes(train.num_processes, detect_hardware()) == 1


@dataclass(frozen=True)
class TrainParams:
    """The train stage's parameters, built by pipeline.round.params.train_params; its cache key is their
    `key_fields()`. The rows are keyed by their refs (the labeled set, the augment stage's copies), never listed."""

    artifacts: str
    labeled: dict[str, str]  # the labeled set on disk, {dataset, digest} (pipeline.round.params.labeled_set): no stage's
    augmented: StageRef | None  # the augment stage's output; None without augmentation
    model: dict[str, Any]  # the model section with its identity (pipeline.model.identity.keyed_model)
    train: dict[str, Any]
    seed: int
    init_adapter: AdapterRecord | None  # the previous round's adapter (round.json) when train.init is warm
    out_dir: str
    # A box project's class list (data.task: boxes): its labels become the family codec's answer text
    box_labels: list[str] | None = None


def train_stage(params: TrainParams, rows: list[dict[str, Any]], *, on_step: StepHook | None = None) -> dict[str, Any]:
    """Train the round's adapter on `rows` (the labeled and augmented rows of `params`:
    pipeline.augment.training_rows) into `params.out_dir`, resuming from its last checkpoint. `on_step` (steps done,
    the run's total, loss) is called only when this process trains alone: spawned ranks cannot reach the caller."""
    spec = TrainSpec(ModelConfig.model_validate(params.model), TrainConfig.model_validate(params.train), params.seed)
    if params.box_labels is not None:
        from pipeline.boxes.rows import training_rows as box_training_rows
        from pipeline.model.box_frames import training_codec

        rows = box_training_rows(rows, *training_codec(spec.model))
    init = params.init_adapter
    result = train_adapter(spec, rows, Path(params.out_dir), init_adapter=init and init["adapter_dir"],
                           on_step=on_step if trains_in_process(spec.train) else None)
    m = read_manifest(params.out_dir)
    return {"dir": params.out_dir, "digest": m.key, "adapter_dir": str(result.adapter_dir),
            "adapter_digest": m.outputs["adapter"].digest}
