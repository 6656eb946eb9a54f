"""Manifests as `tamis init` reads them: a CSV or JSONL file's rows, and which of their columns names the images
(checked on disk) and which the answers (pipeline.schema's rule)."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

from pipeline.errors import DataError
from pipeline.schema import answer_column  # label files read their answers by the same rule

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"})
IMAGE_NAMES = ("image", "file", "filename", "file_name", "path", "image_path", "img", "filepath")
# Rows spread over a manifest whose cells are checked on disk to find its image column; the column found is then
# checked on every row (one stat each). A 100,000-row JSONL is read and checked in about a second.
COLUMN_SAMPLE = 2_000


def _by_name(columns: list[str], names: tuple[str, ...]) -> str | None:
    low = {c.lower(): c for c in columns}
    return next((low[n] for n in names if n in low), None)


def _cell(v: Any) -> str:
    """A cell as text; a JSON object (a structured answer) as its JSON text."""
    if isinstance(v, (dict, list)):
        return json.dumps(v, ensure_ascii=False)
    return "" if v is None else str(v).strip()


def read_table(path: Path) -> list[dict[str, Any]]:
    """The rows of a CSV (header row) or JSONL file, as dicts; a clear DataError when it cannot be read."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror}); check the path and its permissions") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text (byte {exc.start}); re-save it as UTF-8") from None
    if path.suffix.lower() == ".jsonl":
        rows = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                except ValueError as exc:
                    raise DataError(f"{path}:{i}: not valid JSON ({exc.msg}); one JSON object per line") from None
                if not isinstance(rec, dict):
                    raise DataError(f"{path}:{i}: a JSON line must be an object with an image and an answer field")
                rows.append(rec)
    else:
        try:
            rows = list(csv.DictReader(io.StringIO(text, newline=""), strict=True))
        except csv.Error as exc:
            raise DataError(f"{path}: not valid CSV ({exc}); save it with a header row and quote cells that hold "
                            "commas") from None
    if not rows:
        raise DataError(f"{path}: no rows; a manifest needs a header (CSV) and one row per image")
    return rows


def _spread(rows: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """Up to `limit` rows spread evenly over the file (first and last included), not the first `limit`."""
    if len(rows) <= limit:
        return rows
    step = (len(rows) - 1) / (limit - 1)
    return [rows[round(i * step)] for i in range(limit)]


def _image_files(base: Path, rows: list[dict[str, Any]], col: str) -> list[Path]:
    paths = [(base / _cell(r.get(col))) for r in rows if _cell(r.get(col))]
    return [p for p in paths if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()]


def manifest_columns(path: Path, rows: list[dict[str, Any]]) -> tuple[str, str | None, list[Path]]:
    """(image column, answer column or None, the image files found) of a manifest's rows: the image column is the one
    whose cells name existing images relative to the manifest's folder (a name like `image` breaks ties), judged on
    a sample spread over the file; the columns are every row's keys (JSONL rows may leave some out)."""
    base = path.resolve().parent
    columns = list(dict.fromkeys(k for r in rows for k in r))
    sample = _spread(rows, COLUMN_SAMPLE)
    hits = {c: len(_image_files(base, sample, c)) for c in columns}
    best = max(columns, key=lambda c: (hits[c], c.lower() in IMAGE_NAMES))
    if not hits[best]:
        named = [c for c in columns if any(os.path.splitext(_cell(r.get(c)))[1].lower() in IMAGE_SUFFIXES
                                           for r in sample[:50])]
        example = next((_cell(r.get(named[0])) for r in sample if _cell(r.get(named[0]))), "") if named else ""
        raise DataError(f"{path}: none of its columns ({', '.join(columns)}) names an image file found relative to "
                        f"{base}" + (f" (column {named[0]!r}, e.g. {example!r}, is not there)" if named else "")
                        + "; put the manifest beside its images or write the image paths relative to its folder")
    others = [c for c in columns if c != best]
    answer = answer_column(others)
    return best, answer, _image_files(base, rows, best)
