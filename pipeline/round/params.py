"""The round's stage parameters: its labeled training set and the labeled test split on disk, keyed by their rows
and how they were prepared (never the whole pool's digest), and the train and evaluate stages' parameters.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config import ModelConfig, SelectConfig, TrainConfig
from pipeline.errors import DataError
from pipeline.fields.schema import AnswerSchema
from pipeline.idindex import IdIndex
from pipeline.round.plan import PoolData, RoundPlan
from pipeline.stage_ref import StageRef
from pipeline.store import atomic_dir, atomic_write_text, digest_json, save_dataset

if TYPE_CHECKING:  # the stages' modules import torch: a round's plan is read without it
    from pipeline.evaluate import EvalParams
    from pipeline.model.train_stage import TrainParams


def save_labeled_set(prepared: Any, labels: Mapping[str, str], out_dir: str | os.PathLike[str], *,
                     digest: str) -> dict[str, str]:
    """The labeled training set: prepared rows of the labeled samples with their current label as the answer.

    Saved as a dataset (what augmentation and training read); returns {"dataset": path, "digest": digest}. The
    folder is rebuilt only when its recorded digest differs, so a re-run leaves it alone.
    """
    return save_rows(prepared, sorted(labels), out_dir, digest=digest,
                     update=lambda sid: {"answer": labels[sid], "split": "train"})


def save_rows(prepared: Any, ids: Sequence[str], out_dir: str | os.PathLike[str], *, digest: str,
              update: Any = None) -> dict[str, str]:
    """Prepared rows of `ids` (each changed by `update(sample_id)` when given) saved as a dataset in
    out_dir/dataset, rebuilt only when out_dir/digest.txt differs from `digest`: {"dataset": path, "digest"}."""
    out_dir = Path(out_dir)
    stamp = out_dir / "digest.txt"
    if stamp.is_file() and stamp.read_text(encoding="utf-8") == digest:
        return {"dataset": str(out_dir / "dataset"), "digest": digest}
    wanted = sorted(ids)
    at = IdIndex.of_dataset(prepared).rows(wanted)
    missing = [s for s, i in zip(wanted, at, strict=True) if i < 0]
    if missing:
        raise DataError(f"{len(missing)} labeled samples are not in the prepared dataset (first: {missing[0]}); "
                        "were they labeled for another dataset?")
    sub = prepared.select(sorted(at.tolist()))
    if update is not None:
        # keep_in_memory: a cache file would land inside the prepare stage's folder and break its digest.
        sub = sub.map(update, input_columns=["sample_id"], keep_in_memory=True)
    with atomic_dir(out_dir / "dataset") as tmp:
        save_dataset(sub, tmp)
    atomic_write_text(stamp, digest)
    return {"dataset": str(out_dir / "dataset"), "digest": digest}


def labeled_set(pool: PoolData, plan: RoundPlan) -> dict[str, str]:
    """The round's labeled training set on disk (round_dir/labeled/), keyed by its content: the labels (sample IDs,
    which are content digests, and answers) and how the rows were prepared (the prepare stage's code version and
    config), not the whole prepared pool's digest, so new pool images leave the training set and its adapter alone."""
    assert pool.recipe is not None, "a round's pool is loaded with its prepare stage's manifest: PoolData.load"
    return save_labeled_set(pool.dataset, plan.labels, plan.dir / "labeled",
                            digest=digest_json([*pool.recipe, plan.labeled_digest]))


def train_params(plan: RoundPlan, *, artifacts: str | os.PathLike[str], model: ModelConfig, train: TrainConfig,
                 seed: int, labeled: dict[str, str], augmented: Mapping[str, Any] | None,
                 box_labels: Sequence[str] | None = None) -> TrainParams:
    """The train stage's parameters (its cache key) and output folder for this round: the labeled set's content,
    never the pool's (labeled_set); `augmented` is the augment stage's result; `box_labels`: a box project's class
    list (data.box_labels)."""
    from pipeline.model.identity import keyed_model
    from pipeline.model.train_stage import TrainParams

    init, aug = plan.warm_start(train.init), StageRef.of(augmented) if augmented is not None else None
    # The model's content and library versions too: new weights at the same path retrain (pipeline/model/identity.py).
    sections = {"model": keyed_model(model, artifacts), "train": train.model_dump(mode="json")}
    boxes = {} if box_labels is None else {"box_labels": list(box_labels)}  # one-answer folders keep their names
    key = digest_json({"labeled": labeled["digest"], **sections, "aug": aug and aug.digest,
                       "init": init and init["adapter_digest"], "seed": seed, **boxes})
    return TrainParams(artifacts=str(artifacts), labeled=labeled, augmented=aug, seed=seed,
                       init_adapter=init, out_dir=str(Path(artifacts) / "train" / key[:16]), **sections, **boxes)


def test_set(artifacts: str | os.PathLike[str], pool: PoolData) -> dict[str, str]:
    """The labeled test split on disk (artifacts/eval/test/<digest>/), keyed like the labeled set by its rows (IDs
    and answers) and how they were prepared, so new pool images leave the evaluation of an adapter alone."""
    assert pool.recipe is not None, "a round's pool is loaded with its prepare stage's manifest: PoolData.load"
    rows = pool.test_rows()
    digest = digest_json([*pool.recipe, rows])
    return save_rows(pool.dataset, [s for s, _ in rows], Path(artifacts) / "eval" / "test" / digest[:16],
                     digest=digest)


def evaluate_params(*, artifacts: str | os.PathLike[str], model: ModelConfig, answers: Sequence[str] | None,
                    batch_size: int, test: dict[str, str], adapter: Mapping[str, Any],
                    box_labels: Sequence[str] | None = None, schema: AnswerSchema | None = None) -> EvalParams:
    """The evaluate stage's parameters (its cache key) and output folder for a trained adapter (the train stage's
    result) on the test set (`batch_size`: select.score_batch_size, the scoring batch; `box_labels`: a box
    project's class list; `schema`: data.answer_schema's, for per-field metrics)."""
    from pipeline.evaluate import EvalParams
    from pipeline.model.identity import keyed_model

    key = digest_json({"test": test["digest"], "adapter": adapter["adapter_digest"]})
    return EvalParams(artifacts=str(artifacts), test=test, adapter=StageRef.of(adapter),
                      model=keyed_model(model, artifacts), answers=None if answers is None else list(answers),
                      batch_size=batch_size, out_dir=str(Path(artifacts) / "eval" / key[:16]),
                      box_labels=None if box_labels is None else list(box_labels),
                      answer_schema=None if schema is None else schema.raw)


def round_strategy(select: SelectConfig, *, cold: bool, phase: Mapping[str, str] | None = None) -> str:
    """How the round's batch is chosen (pipeline.strategies.schedule.strategy_label), from the select section and
    the round's phase (selection.round_phase_of)."""
    from pipeline.strategies.schedule import strategy_label

    return strategy_label(select.cold_start, select.strategy, select.diversity, cold=cold, phase=phase)
