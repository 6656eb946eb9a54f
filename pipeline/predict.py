"""`tamis predict`: a round's adapter on new images, batched through the scorer pool scoring and evaluation use.

New images come from a folder, a JSONL / CSV manifest, a saved dataset or (a project of several images) a file in
its conversation format, read and prepared by pipeline/predict_inputs.py, so the model sees what it saw in training
and evaluation: the same preparation, the same prompt (the family's chat template around the question). A file that
cannot be read or decoded, or a row whose question is too long to ask, becomes a row with its reason and no answer
(and a line of `<out>.rejected.csv`), never an exception.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.boxes.codecs import BoxCodec
from pipeline.boxes.rows import Frame
from pipeline.config import DataConfig, ModelConfig, PreprocessConfig, SelectConfig
from pipeline.errors import ConfigError, DataError
from pipeline.predict_inputs import NewImage, read_new_images

CSV_COLUMNS = ("file", "question", "answer", "probability", "mean_logprob", "label", "adapter", "error")
CHUNK = 256  # images decoded and scored at a time: a 10⁵-image folder is never held in memory at once
REJECTED_COLUMNS = ("file", "reason")
BOX_CSV_COLUMNS = ("image", "class", "x", "y", "w", "h", "score")  # a box project's CSV: one row per box


@dataclass(frozen=True)
class AdapterChoice:
    """The adapter a prediction uses and why that one."""

    dir: Path
    round: int | None
    digest: str | None
    why: str


def find_adapter(artifacts: str | os.PathLike[str], *, round_index: int | None = None,
                 adapter: str | os.PathLike[str] | None = None) -> AdapterChoice:
    """`adapter` when given; else round `round_index`'s adapter; else the latest finished round's that trained one.

    A round records its adapter in round.json (`adapter`: the train stage's reference, whose `dir` holds the train
    manifest and `adapter_dir` the PEFT folder); the manifest is verified, so a deleted or edited adapter is refused."""
    from pipeline.round_state import trained_round
    from pipeline.store import read_manifest

    if adapter is not None:
        path = Path(adapter)
        if not (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
            raise ConfigError(f"--adapter {path}: not an adapter folder (no adapter_config.json) nor a saved model "
                              "(no config.json); give a round's artifacts/train/<key>/adapter folder")
        return AdapterChoice(path, None, None, f"--adapter {path}")
    state = trained_round(artifacts, round_index)
    why = (f"round {round_index} (--round)" if round_index is not None
           else f"the latest round that trained one, round {state.round}")
    ref = state.adapter
    read_manifest(ref["dir"])  # verifies the adapter's files against the train stage's digests
    return AdapterChoice(Path(ref["adapter_dir"]), state.round, ref.get("adapter_digest"), why)



@dataclass
class Prediction:
    file: str
    question: str
    answer: str | None
    probability: float | None
    adapter: str
    label: str | None = None
    mean_logprob: float | None = None
    distribution: dict[str, float] | None = None  # closed answers: every answer's probability
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    boxes: list[Any] | None = None  # a box project's answer read into the image's own pixels (pipeline.boxes.Box)
    size: tuple[int, int] | None = None  # a box project's image size (width, height), the boxes' bounds
    files: list[str] | None = None  # a sample of several images: every image's name (`file` is the first's)

    def csv_row(self) -> dict[str, Any]:
        row = {c: getattr(self, c) for c in CSV_COLUMNS}
        return {k: "" if v is None else (f"{v:.6f}" if isinstance(v, float) else v) for k, v in row.items()}

    def box_rows(self) -> list[dict[str, Any]]:
        """One CSV row per box, in the image's own pixels (0.1 px)."""
        return [{"image": self.file, "class": b.label, "x": f"{b.x:.1f}", "y": f"{b.y:.1f}", "w": f"{b.w:.1f}",
                 "h": f"{b.h:.1f}", "score": f"{b.score:.6f}"} for b in self.boxes or ()]

    def json_row(self) -> dict[str, Any]:
        row = {c: getattr(self, c) for c in CSV_COLUMNS}
        if self.distribution is not None:
            row["distribution"] = self.distribution
        if self.size is not None:
            row["width"], row["height"] = self.size
        if self.files is not None:
            row["files"] = self.files
        if self.boxes is not None:
            row["boxes"] = [{"class": b.label, "box": [round(v, 1) for v in (b.x, b.y, b.w, b.h)],
                             "score": round(b.score, 6)} for b in self.boxes]
        return {k: v for k, v in row.items() if v is not None}


def score_images(loaded: Any, images: Sequence[NewImage], answers: Sequence[str] | None, *, adapter: str,
                 batch_size: int, length_normalize: bool, max_new_tokens: int) -> list[Prediction]:
    """Predictions for decodable images through the scorer of pool scoring (pipeline.scoring.make_scorer); closed
    answers: the most likely answer, its probability and the whole distribution; open answers: the greedy answer,
    its mean token log-probability and `probability` = exp(mean log-prob), the per-token geometric mean."""
    from pipeline.scoring import make_scorer

    good = [im for im in images if im.error is None]
    out = {id(im): Prediction(im.file, im.question, None, None, adapter, im.label, error=im.error,
                              files=[im.file, *im.more_files] if im.more_files else None) for im in images}
    if good:
        scorer = make_scorer(loaded, answers, length_normalize=length_normalize, max_new_tokens=max_new_tokens)
        rows = [im.scored_row() for im in good]
        res = scorer.score(rows, batch_size=batch_size)
        for i, im in enumerate(good):
            p = out[id(im)]
            if answers:
                probs = res.probs[i]
                best = int(np.argmax(probs))
                p.answer, p.probability = answers[best], float(probs[best])
                p.distribution = {a: round(float(x), 6) for a, x in zip(answers, probs, strict=True)}
            else:
                lp = res.token_logprobs[i]
                mean = float(np.nanmean(lp)) if np.isfinite(lp).any() else float("nan")
                p.answer, p.mean_logprob = res.answers[i], mean
                p.probability = math.exp(mean) if math.isfinite(mean) else None
    return [out[id(im)] for im in images]


def read_boxes(preds: Sequence[Prediction], images: Sequence[NewImage], codec: BoxCodec, frame: Frame | None
               ) -> None:
    """A box project's answers read by the family's codec through each image's preparation geometry into boxes in
    its own pixels, clamped inside it (pipeline/boxes/rows.py, as evaluation reads them); each box is scored with
    its answer's probability (the geometric mean of its tokens')."""
    from pipeline.boxes.rows import predicted_boxes

    done = [(p, im) for p, im in zip(preds, images, strict=True) if p.answer is not None and im.geometry]
    if not done:
        return
    rows = [{"sample_id": str(i), **im.geometry} for i, (_, im) in enumerate(done)]  # type: ignore[dict-item]
    found, _ = predicted_boxes([p.answer or "" for p, _ in done], rows, codec, frame,
                               [p.probability for p, _ in done])
    for i, (p, im) in enumerate(done):
        p.boxes, p.size = found[str(i)], (im.geometry["width"], im.geometry["height"])  # type: ignore[index]


def predict_path(path: str | os.PathLike[str], loaded: Any, *, choice: AdapterChoice, data: DataConfig,
                 preprocess: PreprocessConfig, model: ModelConfig, select: SelectConfig,
                 question: str | None = None) -> list[Prediction]:
    """Every row of `path` predicted with `loaded` (the model with `choice`'s adapter), in the input's order."""
    from pipeline.model.box_frames import codec_and_frame

    name = str(choice.dir) if choice.round is None else f"round {choice.round}: {choice.dir}"
    codec, frame = codec_and_frame(loaded.family, loaded.processor) if data.task == "boxes" else (None, None)
    out: list[Prediction] = []
    chunk: list[NewImage] = []
    images = read_new_images(path, data=data, preprocess=preprocess, model=model, question=question)
    for im in itertools.chain(images, [None]):  # None: the end, which scores the last chunk
        if im is not None:
            chunk.append(im)
        if chunk and (im is None or len(chunk) >= CHUNK):
            preds = score_images(loaded, chunk, data.scored_answers, adapter=name, batch_size=select.score_batch_size,
                                 length_normalize=select.length_normalize, max_new_tokens=model.max_new_tokens)
            if codec is not None:
                read_boxes(preds, chunk, codec, frame)
            out += preds
            chunk = []
    if not out:
        raise DataError(f"{path}: no images found; put image files in the folder or rows in the manifest")
    return out


@dataclass(frozen=True)
class PredictionFiles:
    csv: Path
    jsonl: Path
    rejected: Path  # `<out>.rejected.csv`: the rows predicted nothing and why (header only when none)


def write_predictions(preds: Sequence[Prediction], out_csv: str | os.PathLike[str], *, boxes: bool = False
                      ) -> PredictionFiles:
    """The CSV (one row per input), the JSONL beside it (same rows, plus the closed answers' distributions) and the
    rejections list (file, reason) of the rows that got no answer, so a skipped row is found without a filter.

    `boxes` (a box project): the CSV has one row per box (image, class, x, y, w, h in the image's pixels, score)
    and each JSONL row its image's `boxes` list (empty: the model found none), `width` and `height`."""
    from pipeline.csvcells import csv_text
    from pipeline.store import atomic_write_jsonl, atomic_write_text

    out_csv = Path(out_csv)
    # csv_text: a file name or answer like =HYPERLINK(…) must not run as a formula when the CSV is opened.
    if boxes:
        atomic_write_text(out_csv, csv_text(BOX_CSV_COLUMNS, (r for p in preds for r in p.box_rows())))
    else:
        atomic_write_text(out_csv, csv_text(CSV_COLUMNS, (p.csv_row() for p in preds)))
    jsonl = out_csv.with_suffix(".jsonl")
    atomic_write_jsonl(jsonl, [p.json_row() for p in preds])
    rejected = out_csv.with_suffix(".rejected.csv")
    atomic_write_text(rejected, csv_text(REJECTED_COLUMNS, ({"file": p.file, "reason": p.error} for p in preds
                                                            if p.error)))
    return PredictionFiles(out_csv, jsonl, rejected)
