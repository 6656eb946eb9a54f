"""Label checks of a round as cached stages: out-of-sample probabilities (+ kNN label consistency) → likely label
errors → relabel queue. The library (pipeline/labelcheck/stage.py) plans each task's parameters and runs its body;
this module only wraps them as Prefect tasks and orders them. A task's parameters are its cache key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flows.select import embeddings_ref
from flows.stages import run_stage, stage_task
from pipeline.annotation.label_studio import push_batch
from pipeline.config import ProjectConfig
from pipeline.labelcheck import (
    LABELCHECK_VERSION,
    CheckSpec,
    plan_label_check,
    plan_relabel,
    run_label_check,
    run_relabel,
)
from pipeline.model.identity import with_identity
from pipeline.round_state import RoundState
from pipeline.stage_ref import StageRef

# Each task takes its stage's one parameters dataclass (pipeline/labelcheck/stage.py), keyed on its fields.
labelcheck_task = stage_task("labelcheck", LABELCHECK_VERSION)(run_label_check)
relabel_task = stage_task("relabel", LABELCHECK_VERSION)(run_relabel)


def label_check_ref(cfg: ProjectConfig, *, labeled: dict[str, Any], previous: RoundState | None,
                    round_dir: Path, prepared: StageRef | dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Run (or reuse) the label check of the labeled set; None when labelcheck.method is off or the heldout method
    has no earlier adapter to score with (the first trained round). `prepared` (the prepare stage's ref) gives the
    kNN signal the selection embeddings when select.embeddings is not `model` (the same cached stage selection
    reads); without it the check runs on the model signal alone and says so."""
    def selection_space() -> dict[str, Any] | None:
        return embeddings_ref(cfg, prepared)

    spec = CheckSpec.of(model=with_identity(cfg.model, cfg.artifacts), train=cfg.train, select=cfg.select,
                        labelcheck=cfg.labelcheck, answers=cfg.data.scored_answers, seed=cfg.seed,
                        box_labels=cfg.data.box_labels)
    params = plan_label_check(spec, artifacts=cfg.artifacts, labeled=labeled, previous=previous, round_dir=round_dir,
                              selection_space=None if prepared is None else selection_space)
    return None if params is None else run_stage(labelcheck_task, params=params)


def relabel_ref(cfg: ProjectConfig, *, check: dict[str, Any], prepared: StageRef | dict[str, Any],
                round_index: int, cap: int | None = None) -> dict[str, Any]:
    """Export the likely errors at least `labelcheck.min_confidence` likely wrong that no earlier round sent back,
    at most `labelcheck.relabel_top_n` (and `cap`), to rounds/NNN/relabel/; {"count": 0} when there are none (an
    abstaining check reports none). With annotate.label_studio the queue is pushed beside the batch (its result under
    "label_studio", as export_ref's)."""
    ref = run_stage(relabel_task, params=plan_relabel(artifacts=cfg.artifacts, annotate=cfg.annotate,
                                                      labelcheck=cfg.labelcheck, answers=cfg.data.answers,
                                                      check=check, prepared=prepared, round_index=round_index,
                                                      cap=cap, box_labels=cfg.data.box_labels))
    if cfg.annotate.label_studio is not None and ref.get("count"):
        ref = {**ref, "label_studio": push_batch(cfg.annotate, cfg.artifacts, ref["dir"])}
    return ref
