"""Import labels from annotators: Label Studio JSON / JSON_MIN exports, CSV and JSONL files.

A file is read whole and validated before anything is written. A malformed file (bad JSON/CSV, wrong structure, an
export from another project) raises LabelImportError naming the line and appends nothing. Bad rows (unknown sample,
label outside the answer set, empty label, duplicate, a tie between annotators) are rejected with file:line and a
reason, written to a rejection report, and the rest is appended to the ledger in one write (or, with strict=True,
any rejection aborts the whole file). A file whose digest the ledger already knows is a no-op.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar
from urllib.parse import parse_qs, unquote, urlparse

from pipeline.annotation.export import FROM_NAME
from pipeline.annotation.ledger import Ledger, make_entry
from pipeline.errors import LabelImportError
from pipeline.store import atomic_write_jsonl, digest_bytes

log = logging.getLogger(__name__)

INBOX_SUFFIXES = (".json", ".csv", ".jsonl")


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


@dataclass
class Rejection:
    file: str
    line: int
    where: str
    sample_id: str | None
    label: str | None
    annotator: str
    reason: str


@dataclass
class Conflict:
    sample_id: str
    votes: dict[str, int]
    outcome: str  # "majority" (accepted) or "tie" (rejected)
    label: str | None


@dataclass
class ImportReport:
    file: str
    digest: str
    format: str = ""
    rows_read: int = 0
    accepted_rows: int = 0  # votes behind accepted labels, outvoted ones included (see conflicts)
    accepted: list[dict[str, Any]] = field(default_factory=list)  # ledger entries appended
    unchanged: list[str] = field(default_factory=list)  # samples whose current label the file repeats
    rejected: list[Rejection] = field(default_factory=list)
    conflicts: list[Conflict] = field(default_factory=list)
    skipped_cancelled: int = 0
    unlabeled_tasks: int = 0
    already_imported: bool = False
    rejections_file: str | None = None

    @property
    def accounted(self) -> bool:
        return self.accepted_rows + len(self.rejected) + self.skipped_cancelled == self.rows_read

    @property
    def corrections(self) -> int:
        return sum(e["kind"] == "correction" for e in self.accepted)

    def summary(self) -> str:
        if self.already_imported:
            return f"{self.file}: already imported (digest {self.digest[:12]}), nothing to do"
        return (
            f"{self.file}: {self.rows_read} label rows → {len(self.accepted)} labels appended "
            f"({self.corrections} corrections), {len(self.unchanged)} unchanged, {len(self.rejected)} rejected, "
            f"{self.skipped_cancelled} skipped/cancelled, {len(self.conflicts)} annotator conflicts"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------------------- readers
def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _json_error(name: str, exc: json.JSONDecodeError) -> LabelImportError:
    return LabelImportError(
        f"{name}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg}); fix that line or export the file again"
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


def _annotator(value: Any, fallback: str) -> str:
    if isinstance(value, dict):
        value = value.get("email") or value.get("id")
    return fallback if value in (None, "") else str(value)


def _sid(value: Any) -> str | None:
    """A sample_id cell as text: a number or list an annotator typed in becomes an unknown ID, not a crash."""
    return None if value in (None, "") else value.strip() if isinstance(value, str) else str(value)


def _sid_from_image(url: Any) -> str | None:
    """Exported images are named <sample_id>.<ext>; recover the ID from a task's image URL or path."""
    if not isinstance(url, str) or not url:
        return None
    parsed = urlparse(url)
    path = parse_qs(parsed.query).get("d", [parsed.path])[0]
    stem = PurePosixPath(unquote(path)).stem
    return stem or None


def _result_label(result: list[Any]) -> tuple[str | None, str | None]:
    """(label, problem) from an annotation's result list: the choices or text of the answer control."""
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


class LabelReader:
    """One file format → label rows. `read` raises LabelImportError for a malformed file."""

    name: ClassVar[str]

    def read(self, text: str, name: str) -> tuple[list[LabelRow], int]:
        """(label rows, count of tasks that carried no annotation)."""
        raise NotImplementedError


class LabelStudioReader(LabelReader):
    name = "label_studio"

    def read(self, text: str, name: str) -> tuple[list[LabelRow], int]:
        rows, unlabeled = [], 0
        for t, (line, task) in enumerate(json_array_items(text, name)):
            if not isinstance(task, dict):
                raise LabelImportError(f"{name}:{line}: task {t} is a {type(task).__name__}, not an object")
            data = task.get("data") if isinstance(task.get("data"), dict) else {}
            meta = task.get("meta") if isinstance(task.get("meta"), dict) else {}
            sid = _sid(data.get("sample_id") or meta.get("sample_id")) or _sid_from_image(data.get("image"))
            anns = task.get("annotations") or []
            if not isinstance(anns, list):
                raise LabelImportError(f"{name}:{line}: task {t}: 'annotations' must be a list")
            if not anns:
                unlabeled += 1
            for j, ann in enumerate(anns):
                if not isinstance(ann, dict):
                    raise LabelImportError(f"{name}:{line}: task {t} annotation {j} is not an object")
                who = _annotator(ann.get("completed_by"), f"annotation-{ann.get('id', f'{t}.{j}')}")
                where = f"{name}:{line} (task {t}, annotation {j})"
                result = ann.get("result") or []
                if ann.get("was_cancelled") or not result:
                    rows.append(LabelRow(sid, None, who, line, where, cancelled=True))
                    continue
                if not isinstance(result, list):
                    raise LabelImportError(f"{where}: 'result' must be a list")
                label, problem = _result_label(result)
                rows.append(LabelRow(sid, label, who, line, where, problem=problem))
        return rows, unlabeled


class LabelStudioMinReader(LabelReader):
    """JSON_MIN: one flat object per task; the answer sits under the control's name."""

    name = "label_studio_min"
    label_keys = (FROM_NAME, "label")

    def read(self, text: str, name: str) -> tuple[list[LabelRow], int]:
        rows, unlabeled = [], 0
        for t, (line, task) in enumerate(json_array_items(text, name)):
            if not isinstance(task, dict):
                raise LabelImportError(f"{name}:{line}: task {t} is a {type(task).__name__}, not an object")
            key = next((k for k in self.label_keys if k in task), None)
            if key is None:
                unlabeled += 1
                continue
            value, problem = task[key], None
            if isinstance(value, dict) and "choices" in value:
                value = value["choices"]
            if isinstance(value, list):
                if len(value) != 1:
                    problem = f"{len(value)} values ({', '.join(map(str, value))}); give exactly one"
                value = value[0] if len(value) == 1 else None
            sid = _sid(task.get("sample_id")) or _sid_from_image(task.get("image"))
            who = _annotator(task.get("annotator"), f"annotation-{task.get('annotation_id', t)}")
            rows.append(LabelRow(sid, None if value is None else str(value), who, line, f"{name}:{line}",
                                 problem=problem))
        return rows, unlabeled


def _table_row(d: dict[str, Any], line: int, name: str) -> LabelRow:
    sid, label = d.get("sample_id"), d.get("label")
    return LabelRow(
        None if sid in (None, "") else str(sid).strip(),
        None if label is None else str(label),
        _annotator(d.get("annotator"), "unknown"),
        line,
        f"{name}:{line}",
    )


class CsvReader(LabelReader):
    name = "csv"

    def read(self, text: str, name: str) -> tuple[list[LabelRow], int]:
        reader = csv.reader(io.StringIO(text, newline=""), strict=True)
        rows: list[LabelRow] = []
        header: list[str] | None = None
        start = 1
        try:
            for record in reader:
                line, start = start, reader.line_num + 1
                if not record or all(not c.strip() for c in record):
                    continue
                if header is None:
                    header = [c.strip().lower() for c in record]
                    missing = [c for c in ("sample_id", "label") if c not in header]
                    if missing:
                        raise LabelImportError(
                            f"{name}:{line}: the header lacks column(s) {', '.join(missing)} (found: "
                            f"{', '.join(header)}); the first line must name sample_id and label"
                        )
                    continue
                if len(record) != len(header):
                    raise LabelImportError(
                        f"{name}:{line}: {len(record)} fields, but the header has {len(header)}; quote values that "
                        "contain commas"
                    )
                rows.append(_table_row(dict(zip(header, record, strict=True)), line, name))
        except csv.Error as exc:
            raise LabelImportError(f"{name}:{reader.line_num}: not valid CSV ({exc}); fix that line") from None
        if header is None:
            raise LabelImportError(f"{name}: the file is empty; expected a header with sample_id,label")
        return rows, 0


class JsonlReader(LabelReader):
    name = "jsonl"

    def read(self, text: str, name: str) -> tuple[list[LabelRow], int]:
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as exc:
                raise LabelImportError(
                    f"{name}:{n}:{exc.colno}: not valid JSON ({exc.msg}); each line must be one JSON object"
                ) from None
            if not isinstance(d, dict):
                raise LabelImportError(f"{name}:{n}: a {type(d).__name__}, not a JSON object with sample_id and label")
            rows.append(_table_row(d, n, name))
        return rows, 0


READERS: dict[str, type[LabelReader]] = {
    c.name: c for c in (LabelStudioReader, LabelStudioMinReader, CsvReader, JsonlReader)
}


def detect_format(path: Path, text: str) -> str:
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return "csv"
    if suffix == ".jsonl":
        return "jsonl"
    if suffix == ".json":
        items = json_array_items(text, str(path))
        full = any(isinstance(t, dict) and ("annotations" in t or "data" in t) for _, t in items)
        return "label_studio" if full else "label_studio_min"
    raise LabelImportError(
        f"{path}: unknown label file type {suffix!r}; use a Label Studio .json export, .csv or .jsonl"
    )


@dataclass
class LabelFile:
    path: Path
    digest: str
    format: str
    rows: list[LabelRow]
    unlabeled_tasks: int


def read_label_file(path: str | os.PathLike[str]) -> LabelFile:
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
    rows, unlabeled = READERS[fmt]().read(text, str(path))
    if not rows:
        hint = f" (answers are read from keys {', '.join(LabelStudioMinReader.label_keys)})" if fmt.endswith("min") else ""
        raise LabelImportError(f"{path}: no label rows in {unlabeled} task(s){hint}; is this the annotated export?")
    return LabelFile(path, digest_bytes(raw), fmt, rows, unlabeled)


# -------------------------------------------------------------------------------------------------- import
def _check_project(lf: LabelFile, known_ids: set[str]) -> None:
    ids = {r.sample_id for r in lf.rows if r.sample_id}
    if not ids:
        raise LabelImportError(
            f"{lf.path}: no row carries a sample_id (data.sample_id, meta.sample_id, an image named <sample_id>.png or "
            "a sample_id column); import files exported by tamis"
        )
    if not ids & known_ids:
        raise LabelImportError(
            f"{lf.path}: none of its {len(ids)} sample IDs (e.g. {sorted(ids)[0]!r}) is among this project's "
            f"{len(known_ids)} samples; is it an export from another project?"
        )


def _apply(
    lf: LabelFile,
    *,
    known_ids: set[str],
    answers: Sequence[str] | None,
    ledger: Ledger,
    round_index: int,
    rejections_dir: Path,
    strict: bool,
) -> ImportReport:
    name = str(lf.path)
    rep = ImportReport(file=name, digest=lf.digest, format=lf.format, rows_read=len(lf.rows),
                       unlabeled_tasks=lf.unlabeled_tasks)

    def reject(r: LabelRow, reason: str) -> None:
        rep.rejected.append(Rejection(name, r.line, r.where, r.sample_id, r.label, r.annotator, reason))

    allowed = set(answers) if answers else None
    votes: dict[str, list[LabelRow]] = {}
    seen: dict[tuple[str, str], str] = {}
    for r in lf.rows:
        label = (r.label or "").strip()
        if r.cancelled:
            rep.skipped_cancelled += 1
        elif r.problem:
            reject(r, r.problem)
        elif not r.sample_id:
            reject(r, "no sample_id; every row must name the sample it labels")
        elif r.sample_id not in known_ids:
            reject(r, f"unknown sample_id {r.sample_id!r}: not among this project's {len(known_ids)} samples")
        elif not label:
            reject(r, "empty label; fill it in or delete the row")
        elif allowed is not None and label not in allowed:
            reject(r, f"label {label!r} is not in the answer set [{', '.join(answers or [])}]; use one of these")
        elif (r.sample_id, r.annotator) in seen:
            reject(r, f"duplicate row: {r.sample_id} by {r.annotator} already given at {seen[r.sample_id, r.annotator]}")
        else:
            seen[r.sample_id, r.annotator] = r.where
            r.label = label
            votes.setdefault(r.sample_id, []).append(r)

    current = ledger.current()
    now = None
    for sid, rows in votes.items():
        counts = Counter(r.label for r in rows)
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        if len(ranked) > 1:
            tie = ranked[0][1] == ranked[1][1]
            rep.conflicts.append(Conflict(sid, dict(ranked), "tie" if tie else "majority", None if tie else ranked[0][0]))
            if tie:
                for r in rows:
                    reject(r, f"annotators tie on {sid}: {dict(ranked)}; add a deciding annotation")
                continue
        winner = ranked[0][0]
        rep.accepted_rows += len(rows)
        prev = current.get(sid)
        if prev is not None and prev["label"] == winner:
            rep.unchanged.append(sid)
            continue
        who = sorted({r.annotator for r in rows if r.label == winner})
        entry = make_entry(
            sid, winner,
            annotator=",".join(who),
            round_index=round_index,
            source_file=name,
            source_digest=lf.digest,
            supersedes=prev,
            votes=[{"annotator": r.annotator, "label": r.label} for r in rows] if len(rows) > 1 else None,
            now=now,
        )
        now = entry["time"]  # one timestamp per import
        rep.accepted.append(entry)
    if not rep.accounted:  # a bug, not bad input: never write a ledger batch that lost rows
        raise AssertionError(f"{name}: row accounting broken: {rep.summary()}")

    if rep.rejected:
        out = Path(rejections_dir) / f"{lf.digest[:16]}.jsonl"
        atomic_write_jsonl(out, [asdict(x) for x in rep.rejected])
        rep.rejections_file = str(out)
        if strict:
            first = "\n".join(f"  {x.where}: {x.reason}" for x in rep.rejected[:5])
            more = f"\n  … and {len(rep.rejected) - 5} more" if len(rep.rejected) > 5 else ""
            raise LabelImportError(
                f"{name}: {len(rep.rejected)} of {rep.rows_read} label rows rejected, nothing imported (strict):\n"
                f"{first}{more}\nfull list: {out}"
            )
    ledger.append(rep.accepted)
    log.info("%s", rep.summary())
    return rep


def import_labels(
    path: str | os.PathLike[str],
    *,
    known_ids: set[str],
    answers: Sequence[str] | None,
    ledger: Ledger,
    round_index: int,
    rejections_dir: str | os.PathLike[str],
    strict: bool = False,
) -> ImportReport:
    """Validate one label file and append its accepted labels to the ledger in one write."""
    path = Path(path)
    if path.is_file():
        digest = digest_bytes(path.read_bytes())
        if digest in ledger.imported_digests():
            return ImportReport(file=str(path), digest=digest, already_imported=True)
    lf = read_label_file(path)
    _check_project(lf, known_ids)
    return _apply(lf, known_ids=known_ids, answers=answers, ledger=ledger, round_index=round_index,
                  rejections_dir=Path(rejections_dir), strict=strict)


def inbox_files(inbox_dir: str | os.PathLike[str]) -> list[Path]:
    d = Path(inbox_dir)
    if not d.is_dir():
        return []
    # Hidden names are temp files of an atomic write still in progress.
    return sorted(p for p in d.iterdir() if p.is_file() and p.suffix.lower() in INBOX_SUFFIXES
                  and not p.name.startswith("."))


def import_inbox(
    inbox_dir: str | os.PathLike[str],
    *,
    known_ids: set[str],
    answers: Sequence[str] | None,
    ledger: Ledger,
    round_index: int,
    rejections_dir: str | os.PathLike[str],
    strict: bool = False,
) -> list[ImportReport]:
    """Import every new label file in the inbox (sorted by name). Files stay where they are: digests make it idempotent.

    All new files are read and checked first, so one malformed file stops the import before anything is appended.
    """
    done = ledger.imported_digests()
    reports: list[ImportReport] = []
    pending: list[LabelFile] = []
    for p in inbox_files(inbox_dir):
        digest = digest_bytes(p.read_bytes())
        if digest in done:
            reports.append(ImportReport(file=str(p), digest=digest, already_imported=True))
            continue
        lf = read_label_file(p)
        _check_project(lf, known_ids)
        pending.append(lf)
        done.add(digest)  # a second copy under another name is the same file
    for lf in pending:
        reports.append(_apply(lf, known_ids=known_ids, answers=answers, ledger=ledger, round_index=round_index,
                              rejections_dir=Path(rejections_dir), strict=strict))
    order = {str(p): i for i, p in enumerate(inbox_files(inbox_dir))}
    return sorted(reports, key=lambda r: order.get(r.file, len(order)))

