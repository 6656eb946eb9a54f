"""The round's train stage: its labeled (and augmented) rows → `train_adapter` → the adapter's reference.

Separate from train.py, which trains any rows: this module knows what a round hands on; TRAIN_VERSION stays beside
the training code it versions. The rows come from the caller (pipeline.augment.training_rows reads the labeled set
and the augment stage's copies), so the model floor never reads the augment stage above it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.config import StageConfig
from pipeline.model.train import TRAIN_VERSION
from pipeline.store import read_manifest

__all__ = ["TRAIN_VERSION", "train_stage", "trains_in_process"]


def trains_in_process(train: Any) -> bool:
    """Training hooks run in this process only when it trains alone (spawned ranks cannot reach the caller)."""
    from pipeline.model.hardware import detect_hardware, resolve_num_processes

    return resolve_num_processes(train.num_processes, detect_hardware()) == 1


def train_stage(artifacts: str, rows: list[dict[str, Any]], model: dict, train: dict, seed: int,
                init_adapter: dict | None, out_dir: str, *,
                progress: Callable[[int], Callable[..., None] | None] | None = None) -> dict[str, Any]:
    """Train the round's adapter on `rows` (the labeled and augmented rows: pipeline.augment.training_rows) into
    `out_dir`, resuming from its last checkpoint. The caller's task is keyed on the rows' stage refs, not on the
    rows. `progress(total_steps)` may return an `on_step` hook; it is used only when this process trains alone."""
    from pipeline.model.train import planned_train_steps, train_adapter

    cfg = StageConfig({"model": model, "train": train, "seed": seed}, artifacts=artifacts)
    total = planned_train_steps(cfg.train.max_steps, cfg.train.epochs, len(rows), cfg.train.effective_batch_size)
    on_step = progress(total) if progress is not None and trains_in_process(cfg.train) else None
    result = train_adapter(cfg, rows, Path(out_dir), init_adapter=init_adapter and init_adapter["adapter_dir"],
                           on_step=on_step)
    m = read_manifest(out_dir)
    return {"dir": out_dir, "digest": m.key, "adapter_dir": str(result.adapter_dir),
            "adapter_digest": m.outputs["adapter"].digest}
