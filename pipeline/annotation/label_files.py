"""Label files as annotators hand them back: Label Studio JSON / JSON_MIN exports, CSV, JSONL and, for a box project
(data.task: boxes), COCO JSON and Label Studio RectangleLabels.

One small reader per format and a name → class dict (LABEL_READERS); `read_label_file` reads and validates a whole
file before anything is matched or written (pipeline/annotation/labels.py does that). The sources' readers, which
ingest samples, are a different set: pipeline/data/readers.py.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import unquote

from pipeline.annotation.export import FROM_NAME, TABLE_COLUMNS
from pipeline.config import DataConfig
from pipeline.csvcells import unescape_cell
from pipeline.errors import LabelImportError
from pipeline.fields.schema import AnswerSchema
from pipeline.schema import answer_column
from pipeline.store import digest_bytes

# LabelKeys.answer_column's answer for a table with one column per field of the answer schema (no `label` column).
FIELD_COLUMNS = "\0fields"
# A table's columns about an annotation, not its answer (a `seconds` / `lead_time` cell: read_seconds).
META_COLUMNS = ("annotator", "seconds", "lead_time")


@dataclass
class LabelRow:
    """One annotator's answer for one sample, as read from a file (not yet validated)."""

    sample_id: str | None
    label: str | None
    annotator: str
    line: int
    where: str
    cancelled: bool = False
    problem: str | None = None  # a defect the reader already saw (e.g. two choices selected)
    external_id: str | None = None  # the user's own ID of the sample (an `id` / id_column cell)
    image: str | None = None  # an image path or Label Studio image URL
    seconds: float | None = None  # the annotator's time on it (Label Studio's lead_time, a `seconds` column)
    # Label Studio's IDs: its task, and the annotation as imported (ID + content digest, so an edited one is new).
    task: str | None = None
    annotation: str | None = None
    updated: str | None = None  # the annotation's updated_at: its newest version's time and vote count (counted.py)
    # The re-label task set the row answers ("001/relabel"), "" for a round's task: its answer corrects the label.
    relabel: str = ""
    # Filled in by SampleIndex.resolve: the tamis sample, which key matched it and the key's value.
    resolved: str | None = None
    matched_by: str | None = None
    matched_key: str | None = None

    def count_key(self, sample_id: str) -> str:
        """The identity of the annotation this row reads: what its time and vote are counted once by
        (pipeline/annotation/counted.py)."""
        if self.task and self.annotation:
            # annotation is "ID:content digest" (_taken_key): the ID names the annotation, the content is its
            # version, which a newer export of the same annotation replaces.
            return json.dumps(["ls", sample_id, self.task, self.annotation.split(":", 1)[0], self.annotator])
        return json.dumps(["row", sample_id, self.relabel, self.annotator, self.label, self.seconds])

    def keys(self) -> list[tuple[str, str]]:
        """The keys this row offers, as (kind, value)."""
        out = [("sample_id", self.sample_id)] if self.sample_id else []
        out += [("id", self.external_id)] if self.external_id else []
        return out + ([("image", self.image)] if self.image else [])


def read_seconds(value: Any) -> tuple[float | None, str | None]:
    """(seconds, problem) of an annotation time cell: empty is unknown, anything else must be a number >= 0."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None, None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None, f"annotation time {value!r} is not a number of seconds; fix it or leave the cell empty"
    if not seconds >= 0 or seconds == float("inf"):
        return None, f"annotation time {value!r} must be a finite number of seconds >= 0; fix it or leave it empty"
    return seconds, None


def _timed(row: LabelRow, value: Any) -> LabelRow:
    row.seconds, problem = read_seconds(value)
    row.problem = row.problem or problem
    return row


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _json_msg(exc: json.JSONDecodeError) -> str:
    return re.sub(r"\s+(starting )?at$", "", exc.msg)  # "Invalid control character at": the position follows


def _json_error(name: str, exc: json.JSONDecodeError) -> LabelImportError:
    return LabelImportError(
        f"{name}:{exc.lineno}:{exc.colno}: not valid JSON ({_json_msg(exc)}); fix that line or export the file again"
    )


_WS = re.compile(r"[ \t\n\r]*")


def json_array_items(text: str, name: str) -> list[tuple[int, Any]]:
    """Parse a top-level JSON array, keeping the line each element starts on (for row-level messages)."""
    dec = json.JSONDecoder()
    pos = _WS.match(text, 0).end()
    if pos >= len(text):
        raise LabelImportError(f"{name}: the file is empty; expected a JSON list of tasks")
    if text[pos] != "[":
        try:
            first = dec.raw_decode(text, pos)[0]
        except json.JSONDecodeError as exc:
            raise _json_error(name, exc) from None
        raise LabelImportError(
            f"{name}:{_line_of(text, pos)}: expected a JSON list of tasks, found a {type(first).__name__}; "
            "export from Label Studio as JSON or JSON_MIN"
        )
    items: list[tuple[int, Any]] = []
    # Lines are counted incrementally: counting from the start for every task would be quadratic.
    seen_pos, seen_line = 0, 1
    pos = _WS.match(text, pos + 1).end()
    if text.startswith("]", pos):
        pos += 1
    else:
        while True:
            try:
                obj, end = dec.raw_decode(text, pos)
            except json.JSONDecodeError as exc:
                raise _json_error(name, exc) from None
            seen_line += text.count("\n", seen_pos, pos)
            seen_pos = pos
            items.append((seen_line, obj))
            pos = _WS.match(text, end).end()
            if text.startswith(",", pos):
                pos = _WS.match(text, pos + 1).end()
            elif text.startswith("]", pos):
                pos += 1
                break
            else:
                line, col = _line_of(text, pos), pos - text.rfind("\n", 0, pos)
                raise LabelImportError(
                    f"{name}:{line}:{col}: not valid JSON (expected ',' or ']' after a task); fix that line or "
                    "export the file again"
                )
    if _WS.match(text, pos).end() != len(text):
        p = _WS.match(text, pos).end()
        raise LabelImportError(f"{name}:{_line_of(text, p)}: not valid JSON (extra data after the list)")
    return items


def relabel_set(data: dict[str, Any], image: str | None) -> str:
    """The re-label task set a task belongs to ("001/relabel"), "" otherwise: data.tamis_set, as tamis pushes its
    tasks, else the export folder in its image path (rounds/001/relabel/images/…, a task set imported by hand)."""
    named = data.get("tamis_set")
    if isinstance(named, str) and named:
        return named if named.endswith("/relabel") else ""
    m = _RELABEL_IMAGE.search(unquote(image or ""))
    return f"{m[1]}/relabel" if m else ""


_RELABEL_IMAGE = re.compile(r"(?:^|[/=])rounds/(\d{3})/relabel/images/")


def _taken_key(task: Any, annotation: Any, row: LabelRow) -> tuple[str | None, str | None]:
    """(task ID, annotation key) of a Label Studio row, or Nones when the export lacks the IDs. The key holds the
    annotation's content (an edited annotation is new) and its annotator (files numbered by hand reuse IDs)."""
    if task is None or annotation is None:
        return (None if task is None else str(task)), None
    content = json.dumps([row.label, row.cancelled, row.annotator])
    return str(task), f"{annotation}:{digest_bytes(content.encode())[:12]}"


def _annotator(value: Any, fallback: str) -> str:
    if isinstance(value, dict):
        value = value.get("email") or value.get("id")
    return fallback if value in (None, "") else str(value)


def _cell(value: Any) -> str | None:
    """A key cell as text (a number an annotator typed stays a key, not a crash); empty → None."""
    return None if value in (None, "") else value.strip() or None if isinstance(value, str) else str(value)


def _box_result_label(result: list[Any], labels: Sequence[str]) -> tuple[str | None, str | None]:
    """(box label, problem) from a result list of RectangleLabels regions (pipeline/boxes/labelstudio.py)."""
    from pipeline.boxes.labelstudio import label_from_annotation
    from pipeline.errors import DataError

    try:
        return label_from_annotation({"result": result}, labels, where="result"), None
    except DataError as exc:
        return None, str(exc)


def _fields_result_label(result: list[Any], schema: AnswerSchema) -> tuple[str | None, str | None]:
    """(canonical answer, problem) from the results of one control per field (pipeline/fields/labelstudio.py)."""
    from pipeline.fields.labelstudio import answer_from_results

    try:
        return answer_from_results([r for r in result if isinstance(r, dict)], schema), None
    except ValueError as exc:
        return None, f"{exc} ({schema.path})"


def _result_label(result: list[Any], box_labels: Sequence[str] = (),
                  schema: AnswerSchema | None = None) -> tuple[str | None, str | None]:
    """(label, problem) from an annotation's result list: the choices or text of the answer control, the boxes
    of RectangleLabels regions in a box project (`box_labels`: its class list), or the answer rebuilt from one
    control per field under an answer schema (when the result holds any of its fields)."""
    if box_labels:
        return _box_result_label(result, box_labels)
    if schema is not None and any(isinstance(r, dict) and r.get("from_name") in schema.names for r in result):
        return _fields_result_label(result, schema)
    items = [r for r in result if isinstance(r, dict) and isinstance(r.get("value"), dict)]
    items.sort(key=lambda r: r.get("from_name") != FROM_NAME)  # our control first, then any other
    for r in items:
        v = r["value"]
        if "choices" in v:
            ch = [str(c) for c in v["choices"] or []]
            if len(ch) != 1:
                return None, f"{len(ch)} choices selected ({', '.join(ch)}); select exactly one"
            return ch[0], None
        if "text" in v:
            texts = v["text"] if isinstance(v["text"], list) else [v["text"]]
            return "\n".join(str(t).strip() for t in texts if str(t).strip()), None
    return None, "the result holds no choices or text; label with the project's label_config.xml"


@dataclass(frozen=True)
class LabelKeys:
    """Where label files carry their keys besides sample_id (the user's ID columns and the image columns) and, in
    a table without a `label` column, their answers (answer_column)."""

    id_columns: tuple[str, ...] = ("id",)
    image_columns: tuple[str, ...] = ("image", "image_path")
    answer_columns: tuple[str, ...] = ()  # the sources' answer columns: a tie-break among candidate answer columns
    box_labels: tuple[str, ...] = ()  # a box project's class list (data.box_labels): what a box label may name
    schema: AnswerSchema | None = None  # data.answer_schema: labels checked and written canonically, or per field

    @classmethod
    def from_config(cls, data: DataConfig) -> LabelKeys:
        """From the data section: every source's id_column, image column / Label Studio image key, answer column,
        and a box project's class list."""
        ids, images = list(cls.id_columns), list(cls.image_columns)
        for src in data.sources:
            ids.append(src.id_column)
            images += [src.image_column, src.data_image_key]
        answers = tuple(dict.fromkeys(src.answer_column for src in data.sources))
        return cls(tuple(dict.fromkeys(ids)), tuple(dict.fromkeys(images)), answers, tuple(data.box_labels or ()),
                   data.schema)

    def answer_candidates(self, header: Sequence[str]) -> list[str]:
        """A table's columns that may hold the answers: not a key, an annotation's metadata or a column tamis's own
        export (annotate.csv) fills in."""
        skip = {c.lower() for c in ("sample_id", *self.id_columns, *self.image_columns, *TABLE_COLUMNS,
                                    *META_COLUMNS) if c != "label"}
        return [c for c in header if c.lower() not in skip]

    def answer_column(self, header: Sequence[str]) -> str | None:
        """The column a table's answers are in: `label`; else the one `tamis init` reads as a manifest's answer
        column (pipeline.schema.answer_column) among answer_candidates; else the only candidate a source names as
        its answer_column. None when that leaves none or several."""
        if "label" in header:
            return "label"
        if self.schema is not None and {f.name for f in self.schema.fields if f.required} <= set(header):
            return FIELD_COLUMNS  # one column per field (pipeline/fields/answers.py label_columns)
        candidates = self.answer_candidates(header)
        named = [c for c in candidates if c.lower() in {a.lower() for a in self.answer_columns}]
        return answer_column(candidates) or (named[0] if len(named) == 1 else None)

    def answer_problem(self, header: Sequence[str], where: str) -> LabelImportError:
        """Why a table has no answer column, with its candidates and the fix."""
        cands = self.answer_candidates(header)
        if len(cands) < 2:
            return LabelImportError(f"{where}: the header lacks a label column (found: {', '.join(header)}); name the "
                                    "column that holds the answers `label`")
        return LabelImportError(
            f"{where}: no `label` column, and {len(cands)} columns could each hold the answers: {', '.join(cands)}; "
            "rename the answer column to `label` (or remove the other columns)")

    def first(self, d: dict[str, Any], names: Sequence[str], *, skip: Sequence[str] = ()) -> str | None:
        return next((v for k in names if k not in skip and (v := _cell(d.get(k))) is not None), None)


class LabelReader:
    """One file format → label rows. `read` raises LabelImportError for a malformed file."""

    name: ClassVar[str]
    # One row a line: a last row without its line end is a file still being copied (or cut off), never a whole row.
    rows_end_lines: ClassVar[bool] = False

    def __init__(self, keys: LabelKeys | None = None):
        self.keys = keys or LabelKeys()
        self.answer = "label"  # the column (a table's) answers were read from: LabelKeys.answer_column

    def check_complete(self, text: str, name: str) -> None:
        if not self.rows_end_lines or not text.strip() or text.endswith(("\n", "\r")):
            return
        last = text.rsplit("\n", 1)[-1]
        raise LabelImportError(
            f"{name}:{text.count(chr(10)) + 1}: the last row has no line end ({len(last):,} characters: "
            f"{last[:40]!r}{'…' if len(last) > 40 else ''}), so the file may still be being copied or was cut off; "
            "nothing is imported from it now and it is read again next time (each round retries inbox files). If "
            "the file is complete, end its last row with a newline"
        )

    def read(self, text: str, name: str) -> tuple[list[LabelRow], int]:
        """(label rows, count of tasks that carried no annotation)."""
        raise NotImplementedError


class LabelStudioReader(LabelReader):
    name = "label_studio"

    def read(self, text: str, name: str) -> tuple[list[LabelRow], int]:
        rows, unlabeled = [], 0
        for t, (line, task) in enumerate(json_array_items(text, name)):
            # Label Studio's own task / annotation IDs name a row the way its UI does; the position is the fallback.
            task_name = f"task {task['id']}" if isinstance(task, dict) and "id" in task else f"task #{t + 1} of the file"
            if not isinstance(task, dict):
                raise LabelImportError(f"{name}:{line}: {task_name} is a {type(task).__name__}, not an object")
            data = task.get("data") if isinstance(task.get("data"), dict) else {}
            meta = task.get("meta") if isinstance(task.get("meta"), dict) else {}
            sid = _cell(data.get("sample_id")) or _cell(meta.get("sample_id"))
            ext = self.keys.first(data, self.keys.id_columns)
            image = self.keys.first(data, self.keys.image_columns)
            anns = task.get("annotations") or []
            if not isinstance(anns, list):
                raise LabelImportError(f"{name}:{line}: {task_name}: 'annotations' must be a list")
            if not anns:
                unlabeled += 1
            for j, ann in enumerate(anns):
                if not isinstance(ann, dict):
                    raise LabelImportError(f"{name}:{line}: {task_name} annotation #{j + 1} is not an object")
                ann_name = f"annotation {ann['id']}" if "id" in ann else f"annotation #{j + 1}"
                who = _annotator(ann.get("completed_by"), f"annotation-{ann.get('id', f'{t}.{j}')}")
                where = f"{name}:{line} ({task_name}, {ann_name})"
                result = ann.get("result") or []
                row = LabelRow(sid, None, who, line, where, external_id=ext, image=image,
                               relabel=relabel_set(data, image))
                if ann.get("was_cancelled") or not result:
                    row.cancelled = True
                elif not isinstance(result, list):
                    raise LabelImportError(f"{where}: 'result' must be a list")
                else:
                    row.label, row.problem = _result_label(result, self.keys.box_labels, self.keys.schema)
                    _timed(row, ann.get("lead_time"))
                row.task, row.annotation = _taken_key(task.get("id"), ann.get("id"), row)
                row.updated = _cell(ann.get("updated_at"))
                rows.append(row)
        return rows, unlabeled


def _min_fields(task: dict[str, Any], keys: LabelKeys) -> tuple[str | None, str | None]:
    """(answer, problem) of a JSON_MIN task labeled with one control per field: each field's value under its name
    (a choice as a string or {"choices": [...]}, a text area's text, a number)."""
    cells: dict[str, Any] = {}
    for n in keys.schema.names if keys.schema is not None else ():
        v = task.get(n)
        v = v.get("choices") if isinstance(v, dict) else v
        v = v[0] if isinstance(v, list) and len(v) == 1 else v
        cells[n] = None if v is None else str(v)
    return _table_label(cells, keys, FIELD_COLUMNS)


class LabelStudioMinReader(LabelReader):
    """JSON_MIN: one flat object per task; the answer sits under the control's name."""

    name = "label_studio_min"
    label_keys = (FROM_NAME, "label")

    def read(self, text: str, name: str) -> tuple[list[LabelRow], int]:
        rows, unlabeled = [], 0
        for t, (line, task) in enumerate(json_array_items(text, name)):
            if not isinstance(task, dict):
                raise LabelImportError(f"{name}:{line}: task #{t + 1} is a {type(task).__name__}, not an object")
            key = next((k for k in self.label_keys if k in task), None)
            fields = self.keys.schema is not None and any(n in task for n in self.keys.schema.names)
            if key is None and not fields:
                unlabeled += 1
                continue
            value, problem = _min_fields(task, self.keys) if fields and key is None else (task[key], None)
            if isinstance(value, dict) and "choices" in value:
                value = value["choices"]
            if isinstance(value, list):
                if len(value) != 1:
                    problem = f"{len(value)} values ({', '.join(map(str, value))}); give exactly one"
                value = value[0] if len(value) == 1 else None
            who = _annotator(task.get("annotator"), f"annotation-{task.get('annotation_id', t)}")
            where = f"{name}:{line}" + (f" (task {task['id']})" if "id" in task else "")
            image = self.keys.first(task, self.keys.image_columns)
            row = _timed(LabelRow(
                _cell(task.get("sample_id")), None if value is None else str(value), who, line, where,
                problem=problem,
                # JSON_MIN's own "id" is Label Studio's task ID, never the user's: only other ID columns count.
                external_id=self.keys.first(task, self.keys.id_columns, skip=("id",)),
                image=image, relabel=relabel_set(task, image),
            ), task.get("lead_time"))
            row.task, row.annotation = _taken_key(task.get("id"), task.get("annotation_id"), row)
            row.updated = _cell(task.get("updated_at"))
            rows.append(row)
        return rows, unlabeled


def _table_label(d: dict[str, Any], keys: LabelKeys, answer: str) -> tuple[str | None, str | None]:
    """(label, problem) of a table row: its answer cell (a JSON object as its JSON text), or under an answer schema
    the answer its field columns give."""
    if answer == FIELD_COLUMNS and keys.schema is not None:
        from pipeline.fields.answers import answer_from_cells

        cells = {n: None if d.get(n) is None else str(d[n]) for n in keys.schema.names}
        if not any((c or "").strip() for c in cells.values()):
            return None, None
        try:
            return answer_from_cells(cells, keys.schema), None
        except ValueError as exc:
            return None, f"{exc} ({keys.schema.path})"
    label = d.get(answer)
    if isinstance(label, (dict, list)):
        return json.dumps(label, ensure_ascii=False), None
    return None if label is None else str(label), None


def _table_row(d: dict[str, Any], line: int, name: str, keys: LabelKeys, answer: str = "label") -> LabelRow:
    label, problem = _table_label(d, keys, answer)
    return _timed(LabelRow(
        _cell(d.get("sample_id")),
        label,
        _annotator(d.get("annotator"), "unknown"),
        line,
        f"{name}:{line}",
        problem=problem,
        external_id=keys.first(d, keys.id_columns),
        image=keys.first(d, keys.image_columns),
    ), d.get("seconds", d.get("lead_time")))


class LabelCsvReader(LabelReader):
    name = "csv"
    rows_end_lines = True

    def read(self, text: str, name: str) -> tuple[list[LabelRow], int]:
        reader = csv.reader(io.StringIO(text, newline=""), strict=True)
        rows: list[LabelRow] = []
        header: list[str] | None = None
        start = 1
        key_columns = ("sample_id", *self.keys.id_columns, *self.keys.image_columns)
        try:
            for record in reader:
                line, start = start, reader.line_num + 1
                if not record or all(not c.strip() for c in record):
                    continue
                if header is None:
                    header = [c.strip().lower() for c in record]
                    self.answer = self.keys.answer_column(header) or ""
                    missing = [] if self.answer or len(self.keys.answer_candidates(header)) > 1 else ["label"]
                    if not any(k.lower() in header for k in key_columns):
                        missing.append("sample_id (or " + " / ".join(key_columns[1:]) + ")")
                    if missing:
                        raise LabelImportError(
                            f"{name}:{line}: the header lacks column(s) {', '.join(missing)} (found: "
                            f"{', '.join(header)}); the first line must name the label column and a key column: "
                            "sample_id, your own id, or the image path"
                        )
                    if not self.answer:
                        raise self.keys.answer_problem(header, f"{name}:{line}")
                    continue
                if len(record) != len(header):
                    raise LabelImportError(
                        f"{name}:{line}: {len(record)} fields, but the header has {len(header)}; quote values that "
                        "contain commas"
                    )
                # annotate.csv's formula-like cells carry a leading ' (pipeline/csvcells.py): read the values back.
                cells = [unescape_cell(c) for c in record]
                rows.append(_table_row(dict(zip(header, cells, strict=True)), line, name, self.keys, self.answer))
        except csv.Error as exc:
            raise LabelImportError(f"{name}:{reader.line_num}: not valid CSV ({exc}); fix that line") from None
        if header is None:
            raise LabelImportError(f"{name}: the file is empty; expected a header with sample_id,label")
        return rows, 0


class LabelJsonlReader(LabelReader):
    name = "jsonl"
    rows_end_lines = True

    def read(self, text: str, name: str) -> tuple[list[LabelRow], int]:
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as exc:
                raise LabelImportError(
                    f"{name}:{n}:{exc.colno}: not valid JSON ({_json_msg(exc)}); each line must be one JSON object"
                ) from None
            if not isinstance(d, dict):
                raise LabelImportError(f"{name}:{n}: a {type(d).__name__}, not a JSON object with sample_id and label")
            if not rows and "label" not in d:  # the first object names the answer key of the file, as a header
                self.answer = self.keys.answer_column(list(d)) or ""
                if not self.answer:
                    raise self.keys.answer_problem(list(d), f"{name}:{n}")
            rows.append(_table_row(d, n, name, self.keys, self.answer))
        return rows, 0


class CocoLabelReader(LabelReader):
    """A COCO detection file (pipeline/boxes/readers.py read_coco) → one row per image, named by its file name
    (matched to the sample whose original file it is), labeled with the image's boxes as the ledger's box label.
    An image with an entry set aside, or a class outside the project's class list, is a problem of its row: a
    label missing a box would be a wrong label."""

    name = "coco"

    def read(self, text: str, name: str) -> tuple[list[LabelRow], int]:
        from pipeline.boxes.answer import box_label
        from pipeline.boxes.readers import read_coco
        from pipeline.errors import DataError

        try:
            boxes = read_coco(name)
        except DataError as exc:
            raise LabelImportError(str(exc)) from None
        aside = {q.image: q.reason for q in boxes.quarantine if q.image}
        rows = []
        for line, (image, image_boxes) in enumerate(sorted(boxes.images.items()), 1):
            row = LabelRow(None, None, "coco", line, f"{name} (image {image!r})", image=image)
            unknown = sorted({b.label for b in image_boxes} - set(self.keys.box_labels))
            if image in aside:
                row.problem = f"one of its boxes was set aside ({aside[image]}); fix it and import again"
            elif unknown:
                row.problem = (f"classes {unknown} are not in the class list {list(self.keys.box_labels)}; rename "
                               "them or add them to data.answers")
            else:
                row.label = box_label(image_boxes)
            rows.append(row)
        return rows, 0


LABEL_READERS: dict[str, type[LabelReader]] = {
    c.name: c for c in (LabelStudioReader, LabelStudioMinReader, LabelCsvReader, LabelJsonlReader, CocoLabelReader)
}


def _is_coco(text: str) -> bool:
    """Whether a JSON object reads as a COCO detection file (images, annotations and categories lists)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(data, dict) and all(isinstance(data.get(k), list) for k in ("images", "annotations", "categories"))


def detect_format(path: Path, text: str) -> str:
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return "csv"
    if suffix == ".jsonl":
        return "jsonl"
    if suffix == ".json":
        if text.lstrip().startswith("{") and _is_coco(text):
            return "coco"
        items = json_array_items(text, str(path))
        full = any(isinstance(t, dict) and ("annotations" in t or "data" in t) for _, t in items)
        return "label_studio" if full else "label_studio_min"
    raise LabelImportError(
        f"{path}: unknown label file type {suffix!r}; use a Label Studio .json export, .csv or .jsonl"
    )


def _check_schema(rows: list[LabelRow], schema: AnswerSchema) -> None:
    """Each label as its canonical answer under the schema, or a problem of its row (rejected with its file:line,
    the fields at fault and the fix)."""
    from pipeline.fields.answers import check_label

    for r in rows:
        if r.problem or r.cancelled or not (r.label or "").strip():
            continue
        checked = check_label(r.label, schema)
        r.label, r.problem = (checked.canonical, None) if checked.canonical is not None else (r.label, checked.problem)


@dataclass
class LabelFile:
    path: Path
    digest: str
    format: str
    rows: list[LabelRow]
    unlabeled_tasks: int
    answer_column: str = "label"  # a table's column the answers came from (LabelKeys.answer_column)


def read_label_file(path: str | os.PathLike[str], keys: LabelKeys | None = None) -> LabelFile:
    path = Path(path)
    if not path.is_file():
        raise LabelImportError(f"{path}: no such file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise LabelImportError(f"{path}:{line}: not UTF-8 text (byte {exc.start}); save the file as UTF-8") from None
    fmt = detect_format(path, text)
    reader = LABEL_READERS[fmt](keys)
    reader.check_complete(text, str(path))
    rows, unlabeled = reader.read(text, str(path))
    if keys is not None and keys.schema is not None:
        _check_schema(rows, keys.schema)
    # No tasks at all (Label Studio exports `[]` for an empty project, a CSV may hold only its header) is zero labels,
    # nothing to do; tasks without a single label row is more likely the wrong export.
    if not rows and unlabeled:
        hint = f" (answers are read from keys {', '.join(LabelStudioMinReader.label_keys)})" if fmt.endswith("min") else ""
        raise LabelImportError(f"{path}: no label rows in {unlabeled} task(s){hint}; is this the annotated export?")
    return LabelFile(path, digest_bytes(raw), fmt, rows, unlabeled, reader.answer)
