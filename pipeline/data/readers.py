"""Source readers: one small class per source kind, all yielding the same raw rows (or rejections with reasons).

A reader only locates and reads bytes; decoding, IDs, splits and de-duplication happen once, in `ingest`.
Image paths in a manifest are relative to the manifest's folder and must stay inside it (or inside
`data.allowed_roots`): a path that escapes is rejected before anything is read from it.

Given a `FileIndex` (`files=`), a reader locates image files without reading them: each row carries the file's
content digest from the index (one `stat` per unchanged file) and empty `image` bytes. Manifests, sidecars and saved
datasets are still read: they are small, or hold the bytes themselves. A reader also notes in `files.folders` every
folder whose listing its rows depend on, for the listing check (pipeline/data/listing.py).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from pipeline.config import DataConfig, SourceConfig
from pipeline.data.conversations import Conversation, ShareGptColumns, parse, sharegpt_columns
from pipeline.data.file_index import FileIndex
from pipeline.errors import DataError
from pipeline.store import digest_bytes


@dataclass(frozen=True)
class RawRow:
    image: bytes
    image_path: str  # absolute path of the file read; "" when the source held the bytes (HF datasets)
    question: str
    answer: str | None
    split: str | None  # as written in the source; validated by ingest
    source: str  # "<file>:<line>" (manifests), "<file>:<row>" (datasets, exports) or the image file (folders)
    external_id: str | None = None  # the source's own ID of the row (its `id_column`), kept for importing labels
    note: str | None = None  # something a person should know about the row that did not stop it (a warning)
    # sha256 of the image file, from a FileIndex, when the bytes were not read (`image` is then b""); see image_digest
    digest: str | None = None
    # A sample of several images or turns (conversation sources, pipeline/data/conversations.py): its 2nd..Nth images
    # (RawRows holding only image, image_path and digest) and the turns before its question, (role, text) each.
    more: tuple[RawRow, ...] = ()
    context: tuple[tuple[str, str], ...] = ()

    @property
    def image_digest(self) -> str:
        return self.digest if self.digest is not None else digest_bytes(self.image)


@dataclass(frozen=True)
class Rejected:
    source: str
    reason: str
    path: str = ""


Item = RawRow | Rejected


def _text(value: Any) -> str | None:
    """Text cell → stripped str; missing / empty → None (numbers in JSON answers become their text, a JSON object its
    JSON text: a structured answer, data.answer_schema)."""
    if value is None:
        return None
    s = (json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list)) else str(value)).strip()
    return s or None


def _question(value: Any, source: SourceConfig, cfg: DataConfig) -> str:
    return _text(value) or source.question or cfg.question


def _question_note(rec: dict[str, Any], source: SourceConfig, cfg: DataConfig, *, has_column: bool) -> str | None:
    """A warning when a row that should carry its own question does not and the default is used instead."""
    if _text(rec.get(source.question_column)) is not None:
        return None
    explicit = source.question_column != SourceConfig.model_fields["question_column"].default
    if not (has_column or source.question_column in rec or explicit):
        return None  # a manifest without questions at all: the default question is the intended one
    used = "the source's question" if source.question else "data.question"
    return f"no question (field {source.question_column!r} missing or empty); {used} {_question(None, source, cfg)!r} used"


def _roots(base: Path, cfg: DataConfig) -> list[Path]:
    return [base.resolve(), *(Path(r).resolve() for r in cfg.allowed_roots)]


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path.is_relative_to(r) for r in roots)


def read_image_file(ref: str, base: Path, cfg: DataConfig, source: str,
                    files: FileIndex | None = None) -> RawRow | Rejected:
    """Resolve `ref` against `base`, refuse escapes, read the bytes; every failure is a Rejected a person can act on.

    The returned RawRow carries only image, image_path and source (and digest); callers fill in the text fields.
    With `files`, the bytes are not read: the row carries the file's digest from the index instead.
    """
    if "\x00" in ref:  # the OS refuses such a path with ValueError, which is no reason a person can act on
        return Rejected(source, f"image path {ref!r} contains a NUL byte; fix the path in the source")
    raw = Path(ref)
    candidate = raw if raw.is_absolute() else base / raw
    roots = _roots(base, cfg)
    # resolve() follows symlinks, so a link pointing out of the root is caught like a literal "../".
    resolved = candidate.resolve()
    if not _inside(resolved, roots):
        allowed = ", ".join(str(r) for r in roots)
        how = "a symlink resolving to " if candidate.is_symlink() else ""
        return Rejected(
            source,
            f"image path {ref!r} escapes the dataset root ({how}{resolved}); allowed roots: {allowed}; "
            "move the image under the root or add its folder to data.allowed_roots",
            str(candidate),
        )
    if files is not None:
        # Where the file is, and where its name (or the link to it) is listed: a file appearing, leaving or being
        # replaced there changes that folder's mtime, which is what the listing check compares.
        files.folders.add(os.path.dirname(resolved))
        files.folders.add(os.path.dirname(candidate))
    try:
        st = os.stat(resolved)
    except FileNotFoundError:
        what = "broken symlink (its target is missing)" if candidate.is_symlink() else "file not found"
        return Rejected(source, f"{what}: {candidate}; fix the path or restore the file", str(candidate))
    except OSError as exc:
        return Rejected(source, f"cannot access {candidate}: {exc.strerror}", str(candidate))
    if stat.S_ISDIR(st.st_mode):
        return Rejected(source, f"{candidate} is a directory, not an image file; point to the image inside it",
                        str(candidate))
    if not stat.S_ISREG(st.st_mode):
        return Rejected(source, f"{candidate} is not a regular file (device, pipe or socket)", str(candidate))
    if files is not None:
        try:
            return RawRow(b"", str(resolved), "", None, None, source, digest=files.digest(resolved, st))
        except OSError as exc:
            return Rejected(source, f"cannot read {candidate}: {exc.strerror}; check its permissions",
                            str(candidate))
    try:
        data = resolved.read_bytes()
    except OSError as exc:
        return Rejected(source, f"cannot read {candidate}: {exc.strerror}; check its permissions", str(candidate))
    return RawRow(data, str(resolved), "", None, None, source)


def _with_text(row: RawRow | Rejected, question: str, answer: str | None, split: str | None,
               external_id: str | None = None, note: str | None = None) -> Item:
    if isinstance(row, Rejected):
        return row
    return RawRow(row.image, row.image_path, question, answer, split, row.source, external_id, note, row.digest)


def _require_source(source: SourceConfig, *, folder: bool) -> Path:
    p = Path(source.path)
    if folder and not p.is_dir():
        raise DataError(f"data.sources ({source.kind}): {p} is not an existing folder; fix the source path")
    if not folder and not p.exists():
        raise DataError(f"data.sources ({source.kind}): {p} does not exist; fix the source path")
    if not folder and p.is_dir():
        raise DataError(f"data.sources ({source.kind}): {p} is a folder, not a {source.kind} file; point to the file "
                        "inside it, or use kind: folder")
    return p


def _check_columns(source: SourceConfig, found: list[str], where: str) -> None:
    """The image column must exist; the text columns may be absent only when the user left their default names."""
    missing = [source.image_column] if source.image_column not in found else []
    for field in ("question_column", "answer_column", "split_column", "id_column"):
        name = getattr(source, field)
        # Compared with the default, not `model_fields_set`: flows rebuild the config from its JSON dump, which
        # marks every field as set.
        if name != SourceConfig.model_fields[field].default and name not in found:
            missing.append(name)
    if missing:
        raise DataError(
            f"{where}: column(s) {missing} not found; columns found: {found}; "
            "rename the columns or set image_column / question_column / answer_column / split_column / id_column in "
            "the source"
        )


class Reader:
    """Yields one RawRow or Rejected per sample of a source; raises DataError when the whole source is unusable."""

    def rows(self, source: SourceConfig, cfg: DataConfig, files: FileIndex | None = None) -> Iterator[Item]:
        """`files`: locate image files through this index instead of reading them (see the module docstring)."""
        raise NotImplementedError


class FolderReader(Reader):
    """One sub-folder per class (answer = folder name); images directly in the root are unlabeled.

    `<stem><sidecar_ext>` beside an image overrides the question. Hidden files are not samples.
    Symlinked folders are not followed (loops, escapes); each is reported as one rejected row.
    """

    def rows(self, source: SourceConfig, cfg: DataConfig, files: FileIndex | None = None) -> Iterator[Item]:
        root = _require_source(source, folder=True)
        real_root = root.resolve()
        ext = source.sidecar_ext.lower()
        question = source.question or cfg.question
        for here, rel_dir, dirs, entries in _scan(root, ()):
            for d in dirs:
                if d.is_symlink():
                    yield Rejected(str(here / d.name), "symlinked folder is not followed; copy its images into "
                                   f"{root} instead", str(here / d.name))
            names = set(entries) if ext else set()
            # Plain strings joined by hand: os.path.join and Path.__fspath__ were a fifth of an unchanged walk.
            real_here, here_s = _dir_prefix(real_root.joinpath(*rel_dir)), _dir_prefix(here)
            if files is not None:  # every folder walked, empty ones too: an image added to one changes its mtime
                files.folders.add(os.path.normpath(real_here))
            answer = rel_dir[0] if rel_dir else None
            for name in entries:
                stem, suffix = os.path.splitext(name)
                if ext and suffix.lower() == ext:
                    continue
                where = here_s + name
                row = _folder_file(name, real_here, cfg, where, files)
                if row is None:  # a symlink or no regular file: the full checks and their messages
                    row = read_image_file(os.path.join(*rel_dir, name), root, cfg, where, files)
                q = question
                # Path objects only where a sidecar may exist: building them per file is a good part of a walk's cost.
                sidecar = here / name if ext and (stem + source.sidecar_ext in names or
                                                  name + source.sidecar_ext in names) else None
                sidecar = sidecar.with_suffix(source.sidecar_ext) if sidecar is not None else None
                if isinstance(row, RawRow) and sidecar is not None and sidecar.name in names and sidecar.is_file():
                    try:
                        q = _text(sidecar.read_text(encoding="utf-8-sig")) or question
                    except (UnicodeDecodeError, OSError) as exc:
                        yield Rejected(where, f"sidecar {sidecar} unreadable ({exc}); save it as UTF-8 text", where)
                        continue
                yield _with_text(row, q, answer, source.default_split)


def _scan(here: Path, rel: tuple[str, ...]) -> Iterator[tuple[Path, tuple[str, ...], list[os.DirEntry], list[str]]]:
    """os.walk's top-down order (a folder's files, then its sub-folders, names sorted, hidden ones skipped): the
    sub-folders as DirEntry objects, the files by name only. A folder of 10⁶ images held as DirEntry objects with their
    cached stats was ~500 MB for the length of a walk (and left the heap that much bigger: a round then walked twice);
    names are ~60 bytes each, and each file is stat'ed once as it is read (_folder_file). Symlinked folders are
    listed, never entered."""
    dirs, files = [], []
    with os.scandir(here) as it:
        for e in it:
            if e.name.startswith("."):
                continue
            try:
                is_dir = e.is_dir()
            except OSError:
                is_dir = False
            if is_dir:
                dirs.append(e)
            else:
                files.append(e.name)
    dirs.sort(key=lambda e: e.name)
    files.sort()
    yield here, rel, dirs, files
    for d in dirs:
        if not d.is_symlink():
            yield from _scan(here / d.name, (*rel, d.name))


def _dir_prefix(folder: Path) -> str:
    """The folder as a string ending in one separator, to which a file name is appended (as os.path.join would)."""
    s = str(folder)
    return s if s.endswith(os.sep) else s + os.sep


def _folder_file(name: str, real_here: str, cfg: DataConfig, source: str,
                 files: FileIndex | None) -> RawRow | Rejected | None:
    """A plain regular file met by the folder walk: inside the root by construction (no symlink on the way), so it
    needs no resolution; None for anything else, a symlink included (read_image_file then checks it)."""
    resolved = real_here + name  # real_here ends with a separator
    try:
        st = os.lstat(resolved)  # one system call: the type and the stat the file index compares
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    try:
        if files is not None:
            return RawRow(b"", resolved, "", None, None, source, digest=files.digest(resolved, st))
        with open(resolved, "rb") as f:
            return RawRow(f.read(), resolved, "", None, None, source)
    except OSError as exc:
        return Rejected(source, f"cannot read {source}: {exc.strerror}; check its permissions", source)


def _json_lines(path: Path) -> Iterator[tuple[str, Any] | Rejected]:
    """(`file:line`, the parsed value) per non-blank line of a JSONL file, or the line's problem."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            if not raw.strip():
                continue
            try:
                yield where, json.loads(raw.decode("utf-8-sig" if lineno == 1 else "utf-8"))
            except UnicodeDecodeError as exc:
                yield Rejected(where, f"line is not UTF-8 ({exc.reason} at byte {exc.start}); save the file as UTF-8")
            except json.JSONDecodeError as exc:
                yield Rejected(where, f"line is not valid JSON at column {exc.colno}: {json_problem(exc)}")


class JsonlReader(Reader):
    def rows(self, source: SourceConfig, cfg: DataConfig, files: FileIndex | None = None) -> Iterator[Item]:
        path = _require_source(source, folder=False)
        base = path.resolve().parent
        for item in _json_lines(path):
            if isinstance(item, Rejected):
                yield item
                continue
            where, rec = item
            if not isinstance(rec, dict):
                yield Rejected(where, f"line is a JSON {type(rec).__name__}, expected an object with "
                               f"{source.image_column!r}")
                continue
            yield _manifest_row(rec, where, base, source, cfg, files=files)


def json_problem(exc: json.JSONDecodeError) -> str:
    """json's message without its dangling "at" ("Invalid control character at"): the caller gives the position."""
    return re.sub(r"\s+(starting )?at$", "", exc.msg)


def _manifest_row(rec: dict[str, Any], where: str, base: Path, source: SourceConfig, cfg: DataConfig, *,
                  has_question_column: bool = False, files: FileIndex | None = None) -> Item:
    key = source.image_column
    value = rec.get(key)
    if key not in rec:
        return Rejected(where, f"no image: field {key!r} is missing (fields present: {sorted(rec)}); set "
                        "image_column in the source if it has another name")
    if value is None or (isinstance(value, str) and not value.strip()):
        return Rejected(where, f"no image: field {key!r} is {'null' if value is None else 'empty'}; give the "
                        "image's path (relative to the manifest's folder)")
    if not isinstance(value, str):
        # A number or list is no path a person wrote: reading it as a file name only hides the mistake.
        return Rejected(where, f"field {key!r} holds a {type(value).__name__} ({value!r}), not an image path; give "
                        "the image's path as a string")
    row = read_image_file(value.strip(), base, cfg, where, files)
    return _with_text(
        row,
        _question(rec.get(source.question_column), source, cfg),
        _text(rec.get(source.answer_column)),
        _text(rec.get(source.split_column)) or source.default_split,
        _text(rec.get(source.id_column)),
        _question_note(rec, source, cfg, has_column=has_question_column),
    )


class CsvReader(Reader):
    """CSV with a header row; a BOM and quoted multi-line cells are fine. Locations give the record's first line."""

    def rows(self, source: SourceConfig, cfg: DataConfig, files: FileIndex | None = None) -> Iterator[Item]:
        path = _require_source(source, folder=False)
        data = path.read_bytes()
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            line = data[: exc.start].count(b"\n") + 1
            raise DataError(
                f"{path}:{line}: not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}); "
                "re-save the CSV as UTF-8"
            ) from None
        # The file is in memory already, so a long cell costs nothing more: it is its row's problem (a reason on that
        # row, e.g. a question too long to ask), not a "not valid CSV" for the whole file at csv's 128 kB default.
        csv.field_size_limit(max(csv.field_size_limit(), len(text) + 1))
        # strict: an unclosed quote must be an error, not a cell that silently swallows every row after it.
        reader = csv.DictReader(io.StringIO(text, newline=""), strict=True)
        start = 1
        try:
            found = list(reader.fieldnames or [])
            _check_columns(source, found, str(path))
            base = path.resolve().parent
            start = reader.line_num + 1
            for rec in reader:
                where = f"{path}:{start}"
                start = reader.line_num + 1
                if None in rec:
                    yield Rejected(where, f"row has {len(found) + len(rec[None])} cells but the header has "
                                   f"{len(found)}; quote cells that contain commas")
                    continue
                short = [k for k, v in rec.items() if v is None]
                if short:
                    # DictReader fills missing cells with None: the row would pass as an unlabeled pool row.
                    yield Rejected(where, f"row has {len(found) - len(short)} cells but the header has {len(found)} "
                                   f"(no {', '.join(map(repr, short))}); complete the row or leave the cells empty "
                                   "with commas")
                    continue
                yield _manifest_row(rec, where, base, source, cfg,
                                    has_question_column=source.question_column in found, files=files)
        except csv.Error as exc:
            # The reader cannot resync after a malformed record, so the rest of the file is unreadable.
            raise DataError(f"{path}:{start}: not valid CSV ({exc}); fix the record that starts on that line (an "
                            "unclosed quote turns the rest of the file into one cell)") from None


class HFReader(Reader):
    """A dataset saved with `save_to_disk`; the image column holds bytes, an Image feature or file paths."""

    def rows(self, source: SourceConfig, cfg: DataConfig, files: FileIndex | None = None) -> Iterator[Item]:
        import datasets

        path = _require_source(source, folder=True)
        try:
            ds = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as exc:
            raise DataError(f"{path}: not a dataset saved with save_to_disk ({exc})") from None
        if isinstance(ds, datasets.DatasetDict):
            names = list(ds)
            if source.hf_split is None and len(names) == 1:
                ds = ds[names[0]]
            elif source.hf_split in ds:
                ds = ds[source.hf_split]
            else:
                raise DataError(f"{path}: hf_split {source.hf_split!r} not found; the dataset has splits {names}; "
                                "set hf_split in the source")
        _check_columns(source, list(ds.column_names), str(path))
        if isinstance(ds.features[source.image_column], datasets.Image):
            # Keep the original encoded bytes: no decode/re-encode round trip, which would change IDs.
            ds = ds.cast_column(source.image_column, datasets.Image(decode=False))
        base = path.resolve()
        for i, rec in enumerate(ds):
            where = f"{path}:{i}"
            value = rec[source.image_column]
            text = (
                _question(rec.get(source.question_column), source, cfg),
                _text(rec.get(source.answer_column)),
                _text(rec.get(source.split_column)) or source.default_split,
                _text(rec.get(source.id_column)),
                _question_note(rec, source, cfg, has_column=source.question_column in ds.column_names),
            )
            if isinstance(value, dict):
                data, ref = value.get("bytes"), value.get("path")
            elif isinstance(value, (bytes, bytearray)):
                data, ref = bytes(value), None
            elif isinstance(value, str):
                data, ref = None, value
            else:
                yield Rejected(where, f"column {source.image_column!r} holds {type(value).__name__}; "
                               "expected image bytes, an Image feature or a file path")
                continue
            if data:
                yield RawRow(bytes(data), "", *text[:3], where, *text[3:])
            elif ref:
                yield _with_text(read_image_file(ref, base, cfg, where, files), *text)
            else:
                yield Rejected(where, f"column {source.image_column!r} is empty (no bytes and no path)")


class LabelStudioReader(Reader):
    """A Label Studio JSON export: tasks with data.<image key> and data.<text key>, annotations when present."""

    def rows(self, source: SourceConfig, cfg: DataConfig, files: FileIndex | None = None) -> Iterator[Item]:
        path = _require_source(source, folder=False)
        try:
            tasks = json.loads(path.read_text(encoding="utf-8-sig"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"{path}: not a Label Studio JSON export ({exc}); export the project as JSON") from None
        if isinstance(tasks, dict):
            tasks = [tasks]
        if not isinstance(tasks, list):
            raise DataError(f"{path}: expected a JSON list of tasks, found {type(tasks).__name__}")
        base = path.resolve().parent
        for i, task in enumerate(tasks, start=1):
            where = f"{path}:task {task.get('id', i) if isinstance(task, dict) else i}"
            if not isinstance(task, dict):
                yield Rejected(where, f"task is a JSON {type(task).__name__}, expected an object")
                continue
            data = task.get("data", task)
            ref = _text(data.get(source.data_image_key)) if isinstance(data, dict) else None
            if ref is None:
                yield Rejected(where, f"task has no data.{source.data_image_key}; set data_image_key in the source")
                continue
            local = _local_path(ref)
            if local is None:
                yield Rejected(where, f"image {ref!r} is not a local file (remote URLs and Label Studio uploads are "
                               "not fetched offline); export with local files or copy the image next to the export")
                continue
            yield _with_text(
                read_image_file(local, base, cfg, where, files),
                _question(data.get(source.data_text_key), source, cfg),
                _annotation_answer(task.get("annotations") or []),
                _text(data.get(source.split_column)) or source.default_split,
                _text(data.get(source.id_column)),
            )


def _local_path(ref: str) -> str | None:
    url = urlparse(ref)
    if url.path.startswith("/data/local-files"):
        d = parse_qs(url.query).get("d")
        return d[0] if d else None
    if url.scheme in ("", "file") and not url.path.startswith("/data/upload"):
        return unquote(url.path) if url.scheme == "file" else ref
    return None


def _annotation_answer(annotations: list[Any]) -> str | None:
    """The answer of the ground-truth (else latest) non-cancelled annotation: its choices, else its text area."""
    usable = [a for a in annotations if isinstance(a, dict) and not a.get("was_cancelled") and a.get("result")]
    usable.sort(key=lambda a: bool(a.get("ground_truth")))  # stable: ground truth last, then list order
    for ann in reversed(usable):
        for kind, key in (("choices", "choices"), ("textarea", "text")):
            for res in ann["result"]:
                if isinstance(res, dict) and res.get("type") == kind and isinstance(res.get("value"), dict):
                    values = [_text(v) for v in res["value"].get(key) or []]
                    values = [v for v in values if v]
                    if values:
                        return ", ".join(values) if kind == "choices" else "\n".join(values)
    return None


def _records(path: Path) -> Iterator[tuple[str, Any] | Rejected]:
    """(location, record) per record of a JSONL file (`file:line`) or a JSON list (`file:record N`, from 1)."""
    with open(path, "rb") as f:
        head = f.read(4096).decode("utf-8-sig", errors="replace").lstrip()
    if path.suffix.lower() == ".json" or head.startswith("["):
        try:
            recs = json.loads(path.read_text(encoding="utf-8-sig"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"{path}: not valid JSON ({exc}); save it as one JSON list of records, or as JSONL (one "
                            "record per line)") from None
        if not isinstance(recs, list):
            raise DataError(f"{path}: a JSON {type(recs).__name__}, expected a list of records")
        yield from ((f"{path}:record {i}", r) for i, r in enumerate(recs, 1))
        return
    yield from _json_lines(path)


class ConversationReader(Reader):
    """TRL, LLaMA-Factory (sharegpt, with the column names of a dataset_info.json beside the file) and ms-swift
    records, JSONL or a JSON list (pipeline/data/conversations.py): the last assistant turn is the answer, earlier
    turns the context; a row whose image placeholders and image list disagree is rejected with both counts. Image
    paths are relative to the file's folder, as a manifest's are."""

    kind = "trl"

    def rows(self, source: SourceConfig, cfg: DataConfig, files: FileIndex | None = None) -> Iterator[Item]:
        path = _require_source(source, folder=False)
        cols = ShareGptColumns()
        if self.kind == "sharegpt":
            try:
                cols = sharegpt_columns(path)[0]
            except ValueError as exc:
                raise DataError(str(exc)) from None
        base = path.resolve().parent
        for item in _records(path):
            if isinstance(item, Rejected):
                yield item
                continue
            where, rec = item
            parsed = parse(rec, self.kind, cols) if isinstance(rec, dict) else (
                f"record is a JSON {type(rec).__name__}, expected an object")
            if isinstance(parsed, str):
                yield Rejected(where, parsed)
                continue
            yield _conversation_row(parsed, rec, where, base, source, cfg, files)


def _conversation_row(conv: Conversation, rec: dict[str, Any], where: str, base: Path, source: SourceConfig,
                      cfg: DataConfig, files: FileIndex | None) -> Item:
    found = [read_image_file(ref, base, cfg, where, files) for ref in conv.images]
    for i, img in enumerate(found, 1):
        if isinstance(img, Rejected):
            return Rejected(where, f"image {i} of {len(found)}: {img.reason}", img.path)
    first = found[0]
    assert isinstance(first, RawRow)
    return RawRow(first.image, first.image_path, _question(conv.question, source, cfg), _text(conv.answer),
                  _text(rec.get(source.split_column)) or source.default_split, where, _text(rec.get(source.id_column)),
                  None, first.digest, more=tuple(r for r in found[1:] if isinstance(r, RawRow)), context=conv.context)


class TrlReader(ConversationReader):
    kind = "trl"


class ShareGptReader(ConversationReader):
    kind = "sharegpt"


class SwiftReader(ConversationReader):
    kind = "swift"


class CocoReader(Reader):
    """A COCO detection file (data.task: boxes): one row per image, its answer the image's boxes as the ledger's box
    label (pipeline/boxes/answer.py; an image without annotations is the empty label "[]"). An image's file_name is
    relative to the file's folder, or to an `images/` folder beside it. An image with an entry the box reader set
    aside is rejected whole: a label missing a box would be a wrong label."""

    def rows(self, source: SourceConfig, cfg: DataConfig, files: FileIndex | None = None) -> Iterator[Item]:
        from pipeline.boxes.answer import box_label
        from pipeline.boxes.readers import read_coco

        path = _require_source(source, folder=False)
        base = path.resolve().parent
        boxes = read_coco(path)
        aside = {q.image: q.reason for q in boxes.quarantine if q.image}
        for q in boxes.quarantine:
            if not q.image:
                yield Rejected(q.source, q.reason)
        for name, image_boxes in sorted(boxes.images.items()):
            where = f"{path}: image {name!r}"
            if name in aside:
                yield Rejected(where, f"{aside[name]}; fix the entry in the COCO file")
                continue
            ref = name if (base / name).exists() or not (base / "images" / name).exists() else f"images/{name}"
            row = read_image_file(ref, base, cfg, where, files)
            yield _with_text(row, source.question or cfg.question, box_label(image_boxes),
                             source.default_split or "train")


YOLO_SPLITS = {"train": "train", "val": "test", "valid": "test", "test": "test"}  # Ultralytics' images/<split>/


class YoloReader(Reader):
    """A YOLO folder (data.task: boxes; pipeline/boxes/readers.py read_yolo): images/ and labels/ side by side, the
    classes in data.yaml or classes.txt. An image with a label file is labeled with its boxes (an empty file: no
    boxes, "[]"); outside a test split an image without one is not labeled yet (a pool image: YOLO trainers read it
    as background, but an active-learning pool is mostly such images; write an empty .txt for an image with nothing
    in it). The split is source.default_split, else Ultralytics' layout names it (images/train/…: train;
    images/val/… or test/…: test), else train. An image with an entry the reader set aside is rejected whole, as in
    a COCO file."""

    def rows(self, source: SourceConfig, cfg: DataConfig, files: FileIndex | None = None) -> Iterator[Item]:
        from pipeline.boxes.answer import box_label
        from pipeline.boxes.readers import read_yolo

        root = _require_source(source, folder=True)
        boxes = read_yolo(root)
        labeled = {p.relative_to(root / "labels").with_suffix("").as_posix() for p in (root / "labels").rglob("*.txt")}
        aside = {q.image: q.reason for q in boxes.quarantine if q.image}
        for q in boxes.quarantine:
            if not q.image or q.image not in boxes.images:
                yield Rejected(q.source, q.reason)
        for name, image_boxes in sorted(boxes.images.items()):
            where = f"{root}: images/{name}"
            if name in aside:
                yield Rejected(where, f"{aside[name]}; fix the label file")
                continue
            row = read_image_file(f"images/{name}", root, cfg, where, files)
            split = source.default_split or YOLO_SPLITS.get(Path(name).parts[0] if "/" in name else "", "train")
            # A test set is wholly labeled: there a missing label file is YOLO's background image.
            if Path(name).with_suffix("").as_posix() in labeled or split == "test":
                yield _with_text(row, source.question or cfg.question, box_label(image_boxes), split)
            else:
                yield _with_text(row, source.question or cfg.question, None, source.default_split)


READERS: dict[str, type[Reader]] = {
    "coco": CocoReader,
    "yolo": YoloReader,
    "folder": FolderReader,
    "jsonl": JsonlReader,
    "csv": CsvReader,
    "hf": HFReader,
    "label_studio": LabelStudioReader,
    "trl": TrlReader,
    "sharegpt": ShareGptReader,
    "swift": SwiftReader,
}
