"""CSV files tamis writes for people (predictions.csv, the annotators' annotate.csv) as spreadsheets open them safely.

A cell that starts with `=`, `+`, `-`, `@`, a tab or a carriage return is run as a formula by Excel, LibreOffice and
Google Sheets: a file name or a model answer like `=HYPERLINK("http://…","click")` becomes a live link or worse
(CSV / formula injection). OWASP's fix: such a cell gets a leading `'`, which spreadsheets show as text and hide.
A plain number (`-0.52`, `+3`) is data, not a formula, and stays a number. A cell that already starts with `'` gets
one more, so `unescape_cell` undoes exactly what `escape_cell` did and a file read back (the label import reads
annotate.csv) is lossless.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
QUOTE = "'"
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def escape_cell(value: Any) -> str:
    """`value` as a CSV cell a spreadsheet shows as text: None → "", a formula-like start prefixed with `'`."""
    text = "" if value is None else str(value)
    if text.startswith(QUOTE) or (text.startswith(FORMULA_START) and not _NUMBER.fullmatch(text)):
        return QUOTE + text
    return text


def unescape_cell(text: str) -> str:
    """The value `escape_cell` was given, from a cell read back (a cell a person typed without the `'` is kept)."""
    if text.startswith(QUOTE) and text[1:2] and text[1:].startswith((QUOTE, *FORMULA_START)):
        return text[1:]
    return text


def csv_text(columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> str:
    """A CSV document (header, then one line per row, `\\n` line ends) with every cell through `escape_cell`."""
    buf = io.StringIO(newline="")
    writer = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: escape_cell(v) for k, v in row.items()} for row in rows)
    return buf.getvalue()
