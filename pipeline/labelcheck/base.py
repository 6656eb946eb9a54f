"""What every part of the label check shares: its stage version, its error, the probability tolerance and the
`CheckSpec` every step reads.

LABELCHECK_VERSION versions the code of this whole package: the labelcheck and relabel stages (their Prefect keys
and manifests) and the fold scores (their score manifests) are all computed here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.codeversion import stage_version
from pipeline.config import EmbeddingsConfig, LabelCheckConfig, ModelConfig, SelectConfig, TrainConfig
from pipeline.errors import DataError

LABELCHECK_VERSION = stage_version("1", "pipeline.labelcheck")
# Softmax outputs of fp16/bf16 models sum to 1 only to about 1e-3.
PROB_TOL = 1e-3


class LabelCheckError(DataError):
    pass


@dataclass(frozen=True)
class CheckScoring:
    """The scoring settings of the select section the label check reads, and nothing else: the labelcheck stage is
    keyed on exactly these (pipeline/labelcheck/stage.py), so a read of any other select field cannot happen."""

    length_normalize: bool
    score_batch_size: int
    mc_dropout_passes: int | None  # open answers only (None: a closed-set check, which does not read it)
    embeddings: EmbeddingsConfig  # select.embeddings: which space the kNN signal reads

    @classmethod
    def of(cls, select: SelectConfig) -> CheckScoring:
        return cls(select.length_normalize, select.score_batch_size, select.mc_dropout_passes, select.embeddings)


@dataclass(frozen=True)
class HeldOut:
    """The heldout method's adapter and the sample IDs it trained on (those are not scored)."""

    adapter: str | os.PathLike[str]
    trained_ids: frozenset[str] = frozenset()


@dataclass(frozen=True)
class CheckSpec:
    """What every step of one label check reads: the model, training and labelcheck sections, the select section's
    scoring settings, the answer set (None: open answers), the seed, the heldout adapter (None: k-fold, or a heldout
    check without one, which is an error) and the hardware the fold adapters train and score on (None: detect)."""

    model: ModelConfig
    train: TrainConfig
    scoring: CheckScoring
    labelcheck: LabelCheckConfig
    answers: tuple[str, ...] | None
    seed: int
    held_out: HeldOut | None = None
    hw: Any = None
    box_labels: tuple[str, ...] | None = None  # a box project's class list: its labels are boxes (answers is None)

    @classmethod
    def of(cls, *, model: ModelConfig, train: TrainConfig, select: SelectConfig, labelcheck: LabelCheckConfig,
           answers: Sequence[str] | None, seed: int, held_out: HeldOut | None = None, hw: Any = None,
           box_labels: Sequence[str] | None = None) -> CheckSpec:
        return cls(model, train, CheckScoring.of(select), labelcheck, None if answers is None else tuple(answers),
                   seed, held_out, hw, None if box_labels is None else tuple(box_labels))
