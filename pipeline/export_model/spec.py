"""What an export reads (ExportSpec: the config sections) and what it wrote (ExportResult)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.config import (
    AnnotateConfig,
    DataConfig,
    ModelConfig,
    PreprocessConfig,
    SelectConfig,
    TrainConfig,
)

if TYPE_CHECKING:
    from pipeline.serving.gguf import GgufExport
    from pipeline.serving.vllm import VllmExport


@dataclass(frozen=True)
class ExportSpec:
    """The config sections an export reads: the question and answers (data), the image preparation (preprocess), the
    base model and how it trained (model, train, seed: lineage.json), the consensus method (annotate, the card) and
    the scoring batch (select: predict_config.json and serve.sh)."""

    data: DataConfig
    preprocess: PreprocessConfig
    model: ModelConfig
    train: TrainConfig
    annotate: AnnotateConfig
    select: SelectConfig
    seed: int


@dataclass(frozen=True)
class ExportResult:
    dir: Path
    round: int
    adapter: Path
    card: Path
    lineage: Path
    labels: int
    merged: Path | None
    merged_dtype: str | None
    vllm: VllmExport | None = None  # with format vllm: serve.sh, the adapter it serves, what leaving LoRA out cost
    gguf: GgufExport | None = None  # with format gguf: the GGUF files, the Modelfile, the LM Studio folder
