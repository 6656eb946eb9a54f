"""`tamis predict`'s inputs: new images (or samples of several) read by the ingest readers (pipeline/data/readers.py)
and prepared by the preprocess stage's ImagePreparer, each with its question, or with the reason it has no answer.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import DataConfig, ModelConfig, PreprocessConfig
from pipeline.errors import DataError
from pipeline.schema import MAX_QUESTION_CHARS

QUESTION_SHOWN = 200  # characters of a refused question kept in the output


CONVERSATIONS = ("trl", "sharegpt", "swift")  # source kinds whose samples hold several images and turns


def source_for(path: str | os.PathLike[str], question: str | None, data: DataConfig | None = None) -> Any:
    """The ingest source that reads `path`: a saved dataset (a folder with dataset_info.json or dataset_dict.json),
    an image folder, a .jsonl or .csv manifest; in a project whose samples are conversations (a trl / sharegpt /
    swift source in `data`), a .jsonl or .json file of that format, each record one sample of its images."""
    from pipeline.config import SourceConfig

    p = Path(path)
    kind = next((s.kind for s in (data.sources if data is not None else ()) if s.kind in CONVERSATIONS), None)
    if kind is not None and p.suffix.lower() in (".jsonl", ".json") and p.is_file():
        return SourceConfig(kind=kind, path=p, question=question)
    if p.is_dir():
        saved = any((p / n).is_file() for n in ("dataset_info.json", "dataset_dict.json", "state.json"))
        return SourceConfig(kind="hf" if saved else "folder", path=p, question=question)
    if p.suffix.lower() in (".jsonl", ".csv") and p.is_file():
        return SourceConfig(kind=p.suffix.lower().lstrip("."), path=p, question=question)
    what = "does not exist" if not p.exists() else "is neither a folder nor a .jsonl / .csv manifest"
    also = f", or a {kind} .jsonl / .json file (one sample of several images per record)" if kind else ""
    raise DataError(f"{p} {what}; give a folder of images, a JSONL or CSV manifest (an `image` path per row, "
                    f"optionally a `question`){also} or a dataset saved with save_to_disk")


@dataclass
class NewImage:
    """One input row: its name in the output, its question, the prepared PNG, or why it has none."""

    file: str
    question: str
    prepared: bytes | None = None
    label: str | None = None  # the input's own answer (a class sub-folder, a manifest's answer), if it has one
    error: str | None = None
    geometry: dict[str, Any] | None = None  # a box project's: width, height, prep_box, prep_width, prep_height
    # A sample of several images (a conversation source): its 2nd..Nth images prepared as the first, their names,
    # and the turns before its question, as the scorer reads them (pipeline.schema.sample_chat)
    more_prepared: list[bytes] = field(default_factory=list)
    more_files: list[str] = field(default_factory=list)
    context: list[dict[str, str]] = field(default_factory=list)

    def scored_row(self) -> dict[str, Any]:
        row: dict[str, Any] = {"sample_id": self.file, "prepared": self.prepared, "question": self.question}
        return {**row, "more_prepared": self.more_prepared, "context": self.context} if (
            self.more_prepared or self.context) else row


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
    source = source_for(path, default_q, data)
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
        out.more_files = [_name(m, base) for m in item.more]
        out.context = [{"role": r, "text": t} for r, t in item.context]
        try:
            canvas, content = prepare(item.image)
            out.prepared = encode_png(canvas)
            if data.task == "boxes":
                out.geometry = _geometry(item.image, canvas, content, data.max_image_pixels)
            out.more_prepared = [encode_png(prepare(m.image)[0]) for m in item.more]
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
