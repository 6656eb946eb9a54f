"""`tamis predict`: a round's adapter on new images, batched through the scorer pool scoring and evaluation use.

New images come from a folder, a JSONL / CSV manifest or a saved dataset, read by the ingest readers
(pipeline/data/readers.py) and prepared by the preprocess stage's ImagePreparer, so the model sees what it saw in
training and evaluation: the same preparation, the same prompt (the family's chat template around the question).
A file that cannot be read or decoded, or a row whose question is too long to ask, becomes a row with its reason and
no answer (and a line of `<out>.rejected.csv`), never an exception.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.boxes.codecs import BoxCodec
from pipeline.boxes.rows import Frame
from pipeline.config import DataConfig, ModelConfig, PreprocessConfig, SelectConfig
from pipeline.errors import ConfigError, DataError
from pipeline.schema import MAX_QUESTION_CHARS

CSV_COLUMNS = ("file", "question", "answer", "probability", "mean_logprob", "label", "adapter", "error")
CHUNK = 256  # images decoded and scored at a time: a 10⁵-image folder is never held in memory at once
QUESTION_SHOWN = 200  # characters of a refused question kept in the output
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


def source_for(path: str | os.PathLike[str], question: str | None) -> Any:
    """The ingest source that reads `path`: a saved dataset (a folder with dataset_info.json or dataset_dict.json),
    an image folder, a .jsonl or .csv manifest."""
    from pipeline.config import SourceConfig

    p = Path(path)
    if p.is_dir():
        saved = any((p / n).is_file() for n in ("dataset_info.json", "dataset_dict.json", "state.json"))
        return SourceConfig(kind="hf" if saved else "folder", path=p, question=question)
    if p.suffix.lower() in (".jsonl", ".csv") and p.is_file():
        return SourceConfig(kind=p.suffix.lower().lstrip("."), path=p, question=question)
    what = "does not exist" if not p.exists() else "is neither a folder nor a .jsonl / .csv manifest"
    raise DataError(f"{p} {what}; give a folder of images, a JSONL or CSV manifest (an `image` path per row, "
                    "optionally a `question`) or a dataset saved with save_to_disk")


@dataclass
class NewImage:
    """One input row: its name in the output, its question, the prepared PNG, or why it has none."""

    file: str
    question: str
    prepared: bytes | None = None
    label: str | None = None  # the input's own answer (a class sub-folder, a manifest's answer), if it has one
    error: str | None = None
    geometry: dict[str, Any] | None = None  # a box project's: width, height, prep_box, prep_width, prep_height


def _name(row: Any, base: Path) -> str:
    """The input's own name for a row: its path relative to the input folder (or manifest's folder), else where the
    reader found it (a saved dataset's row)."""
    path = getattr(row, "image_path", "") or getattr(row, "path", "")
    if path:
        p = Path(path)
        return str(p.relative_to(base)) if p.is_relative_to(base) else str(p)
    return row.source


def read_new_images(path: str | os.PathLike[str], *, data: DataConfig, preprocess: PreprocessConfig, model: ModelConfig,
                    question: str | None = None) -> Iterator[NewImage]:
    """Every input row of `path`, prepared as the preprocess stage prepares training images (or with its error)."""
    import cv2

    from pipeline.data.images import ImageRejected
    from pipeline.data.readers import READERS, Rejected
    from pipeline.preprocess import ImagePreparer, encode_png, resolve_size

    default_q = question or next((s.question for s in data.sources if s.question), None)
    source = source_for(path, default_q)
    base = (source.path if source.kind in ("folder", "hf") else source.path.parent).resolve()
    prepare = ImagePreparer(preprocess, size=resolve_size(preprocess, model), max_pixels=data.max_image_pixels)
    for item in READERS[source.kind]().rows(source, data):
        if isinstance(item, Rejected):
            yield NewImage(_name(item, base), default_q or data.question, error=item.reason)
            continue
        out = NewImage(_name(item, base), question or item.question, label=item.answer)
        if len(out.question) > MAX_QUESTION_CHARS:
            out.error = (f"question is {len(out.question):,} characters, over the {MAX_QUESTION_CHARS:,} predict "
                         "asks; shorten it in the manifest or give --question")
            out.question = out.question[:QUESTION_SHOWN] + "…"
            yield out
            continue
        try:
            canvas, content = prepare(item.image)
            out.prepared = encode_png(canvas)
            if data.task == "boxes":
                out.geometry = _geometry(item.image, canvas, content, data.max_image_pixels)
        except (DataError, ValueError, OSError, cv2.error) as exc:
            out.error = exc.reason if isinstance(exc, ImageRejected) else f"cannot decode: {exc.__class__.__name__}: {exc}"
        yield out


def _geometry(image: bytes, canvas: np.ndarray, content: tuple[int, int, int, int], max_pixels: int
              ) -> dict[str, Any]:
    """Where the original image sits in its prepared canvas, as a prepared row says it (pipeline/boxes/rows.py):
    the size is the EXIF-oriented one ingest records, so boxes come back in the pixels a viewer shows."""
    from pipeline.data.images import open_image

    with open_image(image, max_pixels=max_pixels) as img:
        width, height = img.size
    return {"width": width, "height": height, "prep_box": list(content), "prep_width": int(canvas.shape[1]),
            "prep_height": int(canvas.shape[0])}


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
    out = {id(im): Prediction(im.file, im.question, None, None, adapter, im.label, error=im.error) for im in images}
    if good:
        scorer = make_scorer(loaded, answers, length_normalize=length_normalize, max_new_tokens=max_new_tokens)
        rows = [{"sample_id": im.file, "prepared": im.prepared, "question": im.question} for im in good]
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
