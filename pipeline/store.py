"""Content digests, atomic writes and stage manifests: the artifact store every stage writes through.

A stage writes its big outputs beside a small manifest (stage, version, input digests, config, output digests). A
reader verifies the digests before it trusts a file, so a half-written or tampered artifact is reported, never used.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from pipeline import __version__
from pipeline.errors import ArtifactError

log = logging.getLogger(__name__)
_CHUNK = 1 << 20
MANIFEST_NAME = "manifest.json"


# ---------------------------------------------------------------------------------------------------- digests
def digest_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace, so equal objects give equal digests."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def digest_json(obj: Any) -> str:
    return digest_bytes(canonical_json(obj).encode("utf-8"))


def digest_dir(path: str | os.PathLike[str], file_digest: Callable[[Path], str] = digest_file) -> str:
    """Digest of a folder's files: their relative paths and contents (names matter, timestamps do not)."""
    root = Path(path)
    entries = sorted(
        (p.relative_to(root).as_posix(), file_digest(p)) for p in root.rglob("*")
        if p.is_file() and p.name != VERIFIED_NAME
    )
    return digest_json(entries)


def digest_path(path: str | os.PathLike[str], file_digest: Callable[[Path], str] = digest_file) -> str:
    p = Path(path)
    if p.is_dir():
        return digest_dir(p, file_digest)
    if p.is_file():
        return file_digest(p)
    raise ArtifactError(f"{p}: does not exist, so it has no digest")


# Coarsest mtime granularity in common use, as the file index (pipeline/data/file_index.py) counts it.
_RACY_NS = 2_000_000_000
VERIFIED_NAME = ".verified.json"


class _Verified:
    """The digests of a stage folder's files as its last verification found them, trusted while a file's (size,
    mtime_ns, inode) is unchanged, as git's index and the source file index do. Verifying a manifest re-hashed every
    output each time a stage was read: ~3 GB of prepared dataset at 10⁶ images, several times a round. A file
    changed since (even with its size kept) is hashed again; one written within the mtime granularity of its
    verification is not trusted until it is verified once more."""

    def __init__(self, folder: Path):
        self.path = folder / VERIFIED_NAME
        try:
            self.old: dict[str, list[Any]] = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(self.old, dict):
                self.old = {}
        except (OSError, ValueError, UnicodeDecodeError):
            self.old = {}
        self.new: dict[str, list[Any]] = {}

    def digest(self, p: Path) -> str:
        key = os.fspath(p)
        st = os.stat(key)
        sig = [st.st_size, st.st_mtime_ns, st.st_ino]
        old = self.old.get(key)
        if isinstance(old, list) and len(old) == 5 and old[:3] == sig and not old[4]:
            self.new[key] = old
            return old[3]
        digest = digest_file(p)
        self.new[key] = [*sig, digest, int(time.time_ns() - st.st_mtime_ns < _RACY_NS)]
        return digest

    def save(self) -> None:
        if self.new != self.old:
            # Only a cache: a folder the reader may not write to is verified in full next time too.
            with contextlib.suppress(OSError):
                atomic_write_json(self.path, self.new, indent=None)


# ---------------------------------------------------------------------------------------------- atomic writes
def _fsync_dir(path: Path) -> None:
    # Persist the rename itself; not every platform lets a directory be opened.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux: /proc/self/status)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # elsewhere: the only portable read is a set-and-restore
    os.umask(mask)
    return mask


def _disk_full(exc: BaseException, path: Path, what: str) -> ArtifactError | None:
    """A full disk (or quota) as a clear error naming the artifact; None for any other failure."""
    if not isinstance(exc, OSError) or exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    try:
        free = f"{shutil.disk_usage(path.parent).free:,} bytes free there"
    except OSError:
        free = "free space unknown"
    return ArtifactError(
        f"{path}: disk full while writing {what} ({free}); the previous version, if any, is unchanged. Free some "
        "space (or set paths.artifacts to a bigger disk) and run again"
    )


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write via a temp file in the same folder, fsync, rename: readers see the old file or the new one, never half."""
    return atomic_write_stream(path, lambda f: f.write(data), f"{len(data):,} bytes")


def atomic_write_stream(path: str | os.PathLike[str], write: Callable[[Any], Any], what: str) -> Path:
    """atomic_write_bytes for outputs too big to hold in memory at once: `write(f)` writes them to the temp file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        # mkstemp creates 0600; outputs get the usual umask-derived mode (a Label Studio running as another user
        # must be able to read exported tasks and images).
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        if (err := _disk_full(exc, path, what)) is not None:
            raise err from exc
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, indent: int | None = 2) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent, ensure_ascii=False, default=str) + "\n")


def atomic_write_jsonl(path: str | os.PathLike[str], rows: list[Mapping[str, Any]]) -> Path:
    return atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows))


def _usual_modes(folder: Path) -> None:
    """Give what other libraries wrote into `folder` the modes a plain open() would: safetensors writes its weights
    through a 0600 temp file, a copy keeps its source's mode, and an export or a Label Studio running as another user
    must read them. Executable bits stay where they were set."""
    mask = current_umask()
    for p in folder.rglob("*"):
        if p.is_symlink():
            continue
        if p.is_dir():
            os.chmod(p, 0o777 & ~mask)
        elif p.is_file():
            os.chmod(p, (0o777 if os.stat(p).st_mode & 0o111 else 0o666) & ~mask)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Build a folder under a temp name and swap it in only when the block succeeds.

    For outputs written by other libraries (`save_pretrained`, `Dataset.save_to_disk`) that cannot write one file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp creates 0700
    except OSError as exc:
        if (err := _disk_full(exc, path, "a folder")) is not None:
            raise err from exc
        raise
    try:
        yield tmp
        _usual_modes(tmp)
        for p in tmp.rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        olds = []
        while True:
            if path.exists() or path.is_symlink():
                olds.append(path.with_name(f".{path.name}.old-{os.getpid()}-{time.monotonic_ns()}"))
                os.replace(path, olds[-1])
            try:
                os.replace(tmp, path)
                break
            except OSError as exc:
                # Another process swapped its folder in between (two runs building the same content-keyed output,
                # e.g. benchmark processes sharing a cache): the rename cannot replace a non-empty folder. Last
                # writer wins, as if the two had run one after the other.
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or len(olds) > 8:
                    raise
        _fsync_dir(path.parent)
        for old in olds:
            if old.is_symlink():  # a link planted where the folder belongs: drop the link, never what it points to
                old.unlink()
            else:
                shutil.rmtree(old, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if (err := _disk_full(exc, path, "a folder")) is not None:
            raise err from exc
        raise


# A saved dataset's record batches: about this many bytes each, and never more rows than _BATCH_ROWS. `datasets`
# writes any table with a binary column 100 rows a batch (far from Arrow's 2 GB per binary array), and a round reads
# its pools through memory maps: a 10⁶-row prepared pool is 10⁴ batches of ~320 KB, opening it reads a header in
# each, and reading a few small columns (IDs, splits, answers) touches a page of each column in each batch, around
# which the kernel maps up to 64 KB more (fault-around). Opening that pool mapped 0.45 GB of its 3.2 GB into the
# round's RSS and reading PoolData's columns 1.0 GB more, for ~30 MB of IDs; in ~32 MB batches a few percent of it.
_BATCH_BYTES = 32 << 20
_BATCH_ROWS = 100_000


def save_dataset(ds: Any, dest: str | os.PathLike[str], **save_kwargs: Any) -> None:
    """`ds.save_to_disk(dest)`, its Arrow files then rewritten in record batches of ~_BATCH_BYTES (the same rows,
    schema and metadata: `datasets.load_from_disk` reads them as before). For a folder atomic_dir is building."""
    import pyarrow as pa

    dest = Path(dest)
    ds.save_to_disk(str(dest), **save_kwargs)
    for entry in json.loads((dest / "state.json").read_text(encoding="utf-8"))["_data_files"]:
        path = dest / entry["filename"]
        with pa.memory_map(str(path)) as src:
            table = pa.ipc.open_stream(src).read_all()
            if table.num_rows == 0 or table.column(0).num_chunks <= 1:
                continue  # already one batch
            rows = max(1, min(_BATCH_ROWS, _BATCH_BYTES * table.num_rows // max(table.nbytes, 1)))
            tmp = path.with_name(f".{path.name}.tmp")
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
                start = 0
                while start < table.num_rows:
                    part = table.slice(start, rows)
                    try:
                        writer.write_table(part.combine_chunks())
                    except pa.ArrowInvalid:  # a slice of unusually large rows past a binary array's 2 GB
                        writer.write_table(part)
                    start += rows
        os.replace(tmp, path)


# ------------------------------------------------------------------------------------- append-only JSONL logs
# A batch of rows (one label file's import, one metric, one stage run) is written as a begin record, the rows and a
# commit record carrying the batch's id, its row count and the SHA-256 of the rows' bytes, in one write and one fsync.
# Readers count a batch only once its commit record is there and matches, so a crash mid-append (a SIGKILL cuts a
# 15 MB write at any page) leaves the whole batch or none of it; the next append sets the cut tail aside in a file
# beside the log and truncates it. Rows outside any batch are a log written before commit records (read as
# committed, as they always were).
BEGIN, COMMIT = "_batch", "_commit"
_REPORTED: set[tuple[str, int, str]] = set()  # problems already logged by this process: each is reported once


@dataclass(frozen=True)
class LogProblem:
    """Something in a log that is not a committed row, by its lines (1-based) and byte offset."""

    path: str
    line: int
    last_line: int
    offset: int
    kind: str  # "torn" (a last line without its end), "corrupt", "uncommitted", "mismatch"
    detail: str

    def __str__(self) -> str:
        lines = f"{self.line}" if self.last_line == self.line else f"{self.line}-{self.last_line}"
        return f"{self.path}:{lines}: {self.detail}"


@dataclass
class LogRead:
    rows: list[dict[str, Any]]
    problems: list[LogProblem]
    committed_end: int  # the bytes before this offset end with a committed batch or a row outside any batch
    size: int
    unterminated: bool = False  # a row outside any batch lacks its line end (kept: the next append starts a new line)


@dataclass
class _Batch:
    line: int
    offset: int
    id: Any
    rows: list[dict[str, Any]] = field(default_factory=list)
    body_start: int = 0


def _parse_log(data: bytes, path: str) -> LogRead:
    """Read a log's bytes line by line: bad UTF-8 or JSON on a line is that line's problem, never the file's."""
    out = LogRead([], [], 0, len(data))
    batch: _Batch | None = None
    pos, n = 0, 0

    def problem(line: int, last: int, offset: int, kind: str, detail: str) -> None:
        out.problems.append(LogProblem(path, line, last, offset, kind, detail))

    while pos < len(data):
        n += 1
        nl = data.find(b"\n", pos)
        end = len(data) if nl < 0 else nl + 1
        raw = data[pos:end]
        try:
            obj = json.loads(raw.decode("utf-8")) if raw.strip() else None
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError alike
            obj = exc
        row = isinstance(obj, dict) and BEGIN not in obj and COMMIT not in obj
        if nl < 0:  # the last line lacks its end: a write cut short, unless it is a whole row outside a batch
            if row and batch is None:
                out.rows.append(obj)
                out.committed_end, out.unterminated = end, True
            else:
                problem(n, n, pos, "torn", f"the last line is cut off ({len(raw):,} bytes without a line end, e.g. "
                        "a write killed midway); it is not counted and the next write sets it aside")
            break
        if obj is None:
            pass  # a blank line
        elif not isinstance(obj, dict):
            what = f"{type(obj).__name__}" if not isinstance(obj, ValueError) else str(obj).split(":")[0]
            problem(n, n, pos, "corrupt", f"not a JSON object ({what}); the line is not counted")
        elif BEGIN in obj:
            if batch is not None:
                problem(batch.line, n - 1, batch.offset, "uncommitted", f"batch {batch.id} was never committed "
                        f"({len(batch.rows)} rows not counted)")
            batch = _Batch(n, pos, obj[BEGIN], body_start=end)
        elif COMMIT in obj:
            if batch is None or obj[COMMIT] != batch.id:
                problem(n, n, pos, "corrupt", f"a commit record of batch {obj[COMMIT]} without its begin record")
            elif obj.get("rows") != len(batch.rows) or obj.get("sha256") != digest_bytes(data[batch.body_start:pos]):
                problem(batch.line, n, batch.offset, "mismatch", f"batch {batch.id} does not match its commit record "
                        f"({len(batch.rows)} rows read, {obj.get('rows')} committed): damaged after it was written, "
                        "not counted; restore the file from a backup")
            else:
                out.rows += batch.rows
                out.committed_end = end
            batch = None
        elif batch is not None:
            batch.rows.append(obj)
        else:
            out.rows.append(obj)
            out.committed_end = end
        pos = end
    if batch is not None:
        problem(batch.line, n, batch.offset, "uncommitted", f"batch {batch.id} was cut off before its commit record "
                f"(a write killed midway): its {len(batch.rows)} whole rows are not counted and the next write sets "
                "them aside")
    return out


def read_log(path: str | os.PathLike[str]) -> LogRead:
    """Every committed row of an append-only JSONL log, and what else the file holds (reported once per process)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return LogRead([], [], 0, 0)
    try:
        with contextlib.suppress(OSError):  # a shared lock waits out an append in progress (not every FS has flock)
            fcntl.flock(fd, fcntl.LOCK_SH)
        chunks = []
        while chunk := os.read(fd, _CHUNK * 16):
            chunks.append(chunk)
        read = _parse_log(b"".join(chunks), str(path))
    finally:
        os.close(fd)
    for p in read.problems:
        if (p.path, p.offset, p.kind) not in _REPORTED:
            _REPORTED.add((p.path, p.offset, p.kind))
            log.warning("%s", p)
    return read


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The committed rows of an append-only JSONL log (read_log reports anything else)."""
    return read_log(path).rows


def _set_aside(fd: int, path: Path) -> tuple[int, bool]:
    """Cut an uncommitted tail off the log open (and flocked) as `fd`, keeping a copy of it beside the log.

    Returns (where the next batch starts, whether a line end must come first)."""
    size = os.fstat(fd).st_size
    tail = os.pread(fd, min(size, 4096), size - min(size, 4096))
    last = tail[:-1].rpartition(b"\n")[2]
    with contextlib.suppress(ValueError):  # the usual case: the log ends with a commit record, nothing to read
        if tail.endswith(b"\n") and (b"\n" in tail[:-1] or size <= 4096):
            record = json.loads(last)
            if isinstance(record, dict) and COMMIT in record:
                return size, False
    read = _parse_log(os.pread(fd, size, 0), str(path))
    if read.committed_end < size:
        aside = path.with_name(f"{path.name}.cut-{read.committed_end}-{time.time_ns()}")
        cut = os.pread(fd, size - read.committed_end, read.committed_end)
        with open(aside, "xb") as f:
            f.write(cut)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(path.parent)
        os.ftruncate(fd, read.committed_end)
        os.fsync(fd)
        log.warning("%s: set aside its last %s bytes (%s) in %s", path, f"{len(cut):,}",
                    "; ".join(p.detail for p in read.problems if p.offset >= read.committed_end) or "not a whole row",
                    aside)
    return read.committed_end, read.unterminated


def append_jsonl(path: str | os.PathLike[str], rows: list[Mapping[str, Any]], *, fsync: bool = True) -> None:
    """Append rows to a log as one committed batch: readers see all of them or none (see BEGIN, COMMIT).

    `fsync=False` is for measuring what durability costs (benchmarks/ledger_fsync.py): the batch is still whole or
    absent after a killed process, but a power cut may lose it."""
    if not rows:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = b"".join(json.dumps(r, ensure_ascii=False, default=str).encode("utf-8") + b"\n" for r in rows)
    if any(BEGIN in r or COMMIT in r for r in rows):
        raise ValueError(f"{path}: rows may not use the keys {BEGIN!r} and {COMMIT!r} (the log's own records)")
    batch = os.urandom(8).hex()
    payload = (json.dumps({BEGIN: batch, "rows": len(rows)}).encode() + b"\n" + body
               + json.dumps({COMMIT: batch, "rows": len(rows), "sha256": digest_bytes(body)}).encode() + b"\n")
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)  # the umask applies
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # one writer at a time: another's batch in progress is not a torn tail
        start = None
        try:
            start, unterminated = _set_aside(fd, path)
            payload = b"\n" + payload if unterminated else payload
            view, written = memoryview(payload), 0
            # os.write may write only part (a nearly full disk): the rest must follow or the batch is cut back.
            while written < len(payload):
                written += os.write(fd, view[written:])
            if fsync:
                os.fsync(fd)
        except OSError as exc:
            if start is not None:  # cut back to where the batch began: no part of it may count
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, start)
            if (err := _disk_full(exc, path, f"{len(rows)} lines ({len(payload):,} bytes)")) is not None:
                raise err from exc
            raise
    finally:
        os.close(fd)
    if created and fsync:
        _fsync_dir(path.parent)  # the new file's name, not only its bytes


# ------------------------------------------------------------------------------------------------- manifests
class OutputRef(BaseModel):
    path: str  # relative to the manifest's folder
    digest: str


class Manifest(BaseModel):
    stage: str
    stage_version: str
    key: str
    inputs: dict[str, str] = Field(default_factory=dict)
    config_digest: str
    config: dict[str, Any] = Field(default_factory=dict)
    outputs: dict[str, OutputRef] = Field(default_factory=dict)
    info: dict[str, Any] = Field(default_factory=dict)
    created_at: str
    tamis_version: str = __version__

    def path_of(self, name: str, root: Path) -> Path:
        return root / self.outputs[name].path


def stage_key(stage: str, version: str, inputs: Mapping[str, str], config: Any) -> str:
    """Cache key of a stage run: its name, version, its inputs' content digests and its config section."""
    return digest_json({"stage": stage, "version": version, "inputs": dict(inputs), "config": config})


def write_manifest(
    folder: str | os.PathLike[str],
    *,
    stage: str,
    stage_version: str,
    inputs: Mapping[str, str],
    config: Any,
    outputs: Mapping[str, str | os.PathLike[str]],
    info: Mapping[str, Any] | None = None,
) -> Manifest:
    """Record a finished stage: digests every output (a file or folder under `folder`), then writes the manifest last.

    Writing the manifest last is what makes a stage's outputs count as complete.
    """
    folder = Path(folder)
    refs = {}
    for name, p in outputs.items():
        p = Path(p)
        p = p if p.is_absolute() else folder / p
        refs[name] = OutputRef(path=os.path.relpath(p, folder), digest=digest_path(p))
    m = Manifest(
        stage=stage,
        stage_version=stage_version,
        key=stage_key(stage, stage_version, inputs, config),
        inputs=dict(inputs),
        config_digest=digest_json(config),
        config=config if isinstance(config, dict) else {"value": config},
        outputs=refs,
        info=dict(info or {}),
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    atomic_write_json(folder / "config.json", m.config)
    atomic_write_json(folder / MANIFEST_NAME, m.model_dump(mode="json"))
    return m


def read_manifest(folder: str | os.PathLike[str], *, verify: bool = True) -> Manifest:
    """Load a stage manifest and (by default) check every output against its recorded digest."""
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(f"{path}: no manifest; the stage that writes {folder.name!r} has not finished here")
    try:
        m = Manifest.model_validate_json(path.read_text(encoding="utf-8"))
    except Exception as exc:  # noqa: BLE001 - any parse problem is the same user-facing fault
        raise ArtifactError(f"{path}: unreadable manifest ({exc.__class__.__name__}); delete {folder} to rebuild it") from None
    if verify:
        verify_manifest(m, folder)
    return m


def verify_manifest(m: Manifest, folder: Path) -> None:
    seen = _Verified(folder)
    for name, ref in m.outputs.items():
        p = folder / ref.path
        if not p.exists():
            raise ArtifactError(f"{p}: output {name!r} of stage {m.stage!r} is missing; delete {folder} to rebuild it")
        actual = digest_path(p, seen.digest)
        if actual != ref.digest:
            raise ArtifactError(
                f"{p}: output {name!r} of stage {m.stage!r} is corrupt (digest {actual[:12]}…, manifest says "
                f"{ref.digest[:12]}…); delete {folder} to rebuild it"
            )
    seen.save()


def find_valid_manifest(folder: str | os.PathLike[str], key: str) -> Manifest | None:
    """The manifest in `folder` if it was written for this cache key and its outputs verify; else None."""
    folder = Path(folder)
    if not (folder / MANIFEST_NAME).is_file():
        return None
    try:
        m = read_manifest(folder, verify=False)
        if m.key != key:
            return None
        verify_manifest(m, folder)
    except ArtifactError:
        return None
    return m


def reuse_or_compute(folder: str | os.PathLike[str], key: str, compute: Callable[[], Manifest]) -> Manifest:
    """The verified manifest in `folder` for `key`, or what `compute()` writes there.

    Every stage body starts this way: Prefect's cache may be gone (a new PREFECT_HOME, a cleared result store)
    while the verified outputs are still on disk, and those are reused instead of recomputed.
    """
    return find_valid_manifest(folder, key) or compute()


def load_stage_dataset(folder: str | os.PathLike[str], stage: str, output: str = "dataset") -> Any:
    """The dataset a stage wrote in `folder`, after checking the folder is that stage's and its digests verify."""
    import datasets

    folder = Path(folder)
    m = read_manifest(folder)
    if m.stage != stage:
        raise ArtifactError(f"{folder}: holds the output of stage {m.stage!r}, not {stage!r}; pass a {stage} folder")
    return datasets.load_from_disk(str(m.path_of(output, folder)))


def column(ds: Any, name: str) -> list[Any]:
    """A dataset column as a list, read in one batch. Iterating `ds[name]` formats one row at a time (~20 µs a row:
    20 s per pass over 10⁶ rows, and the rows' pages of every column touched), slicing it reads only that column."""
    return ds[name][:]


def arrow_column(ds: Any, name: str) -> Any:
    """A dataset column as one pyarrow Array, with no Python object per row (a 10⁶-row pool's IDs as Python strings
    are ~80 MB); a dataset seen through an indices mapping (the result of `select`) is read through it."""
    import pyarrow.compute as pc

    col = ds.data.column(name)
    indices = getattr(ds, "_indices", None)
    return (col if indices is None else pc.take(col, indices.column(0))).combine_chunks()


def stage_ref(folder: str | os.PathLike[str], m: Manifest, output: str) -> dict[str, Any]:
    """What a stage hands on: its folder, the digest of its main output, and its manifest's info."""
    return {"dir": str(folder), "digest": m.outputs[output].digest, "info": m.info}


def stage_dataset(ref: Mapping[str, Any]) -> tuple[str, str]:
    """(dataset folder, content digest) of a reference: a stage folder ({"dir"}) whose manifest has a "dataset"
    output, or a plain saved dataset ({"dataset", optional "digest"})."""
    if "dataset" in ref:
        return str(ref["dataset"]), ref.get("digest") or digest_dir(ref["dataset"])
    folder = Path(ref["dir"])
    m = read_manifest(folder, verify=False)  # the producing stage's outputs were verified when it was (re)used
    if "dataset" not in m.outputs:
        raise ArtifactError(f"{folder}: stage {m.stage!r} has no 'dataset' output; pass an ingest or prepare folder")
    return str(m.path_of("dataset", folder)), m.outputs["dataset"].digest


# ----------------------------------------------------------------------------------------- execution log
EXECUTIONS = "executions.jsonl"


def record_execution(artifacts: str | os.PathLike[str], stage: str, key: str, **extra: Any) -> None:
    """Append one line per stage body that actually ran: how tests and benchmarks see what a re-run redid."""
    append_jsonl(
        Path(artifacts) / EXECUTIONS,
        [{"stage": stage, "key": key, "pid": os.getpid(), "time": time.time(), **extra}],
    )


def executions(artifacts: str | os.PathLike[str]) -> list[dict[str, Any]]:
    return read_jsonl(Path(artifacts) / EXECUTIONS)
