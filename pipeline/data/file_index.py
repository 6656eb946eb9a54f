"""A persisted file index, like git's: (path, size, mtime_ns, inode) → content digest of the file.

The ingest cache key is built from the content digest of every image a source references. Reading every image to
learn that nothing changed made an unchanged re-run cost a full read of the pool; with this index it costs one
`stat` per file. A file whose stat changed is read and digested again, so a rewrite with identical bytes keeps its
digest (and the key), and an edit is seen even when the size stays the same.

`data.verify: content` re-reads every file (for filesystems whose mtimes cannot be trusted: some network mounts,
archives unpacked with their timestamps kept); both modes give the same digests, so the same key.

Racy entries (git's "racily clean" problem): a file written within the timestamp granularity of the moment it was
digested could change again without its mtime moving. An entry whose mtime is that close to the digest time is kept
but not trusted: the next run reads that file once more.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Literal

from pipeline.store import atomic_write_text

log = logging.getLogger(__name__)

INDEX_NAME = "file_index.json"  # under artifacts/ingest/
_FORMAT = 1
# Coarsest mtime granularity in common use (FAT: 2 s; ext4/xfs/APFS: ns; NFS may round to s).
_RACY_NS = 2_000_000_000
_CHUNK = 1 << 20

Verify = Literal["stat", "content"]


def _digest_file(path: str) -> str:
    # The same sha256 as pipeline.store.digest_bytes of the whole file, so both verify modes give equal keys.
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class FileIndex:
    """Content digests of files, trusted while a file's (size, mtime_ns, inode) is what it was when digested.

    `verify="content"` never trusts an entry (every call reads), but still records what it read. Entries of files
    not looked up during a run are dropped on `save`, so a deleted file leaves the index with it.
    """

    def __init__(self, path: str | os.PathLike[str] | None, verify: Verify = "stat"):
        if verify not in ("stat", "content"):
            raise ValueError(f"data.verify must be 'stat' or 'content', got {verify!r}")
        self.path = None if path is None else Path(path)
        self.verify = verify
        self._old: dict[str, list] = self._load()
        self._new: dict[str, list] = {}
        self.reads = 0  # files read and digested in this run (the rest were answered from the index)
        self.hits = 0

    def _load(self) -> dict[str, list]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if data.get("format") != _FORMAT or not isinstance(data.get("entries"), dict):
                raise ValueError(f"format {data.get('format')!r}")
            return data["entries"]
        except (ValueError, AttributeError, UnicodeDecodeError) as exc:
            # The index is only a cache of digests: a damaged one costs one full read, never a wrong key.
            log.warning("%s: unreadable file index (%s); every file is read once and the index rebuilt", self.path,
                        exc)
            return {}

    def digest(self, path: str | os.PathLike[str], st: os.stat_result | None = None) -> str:
        """sha256 of the file at `path` (absolute, resolved); `st` is its os.stat result when the caller has it."""
        key = os.fspath(path)
        st = st if st is not None else os.stat(key)
        sig = [st.st_size, st.st_mtime_ns, st.st_ino]
        old = self._old.get(key) or self._new.get(key)
        if self.verify == "stat" and old is not None and old[:3] == sig and not old[4]:
            self.hits += 1
            self._new[key] = old
            return old[3]
        digest = _digest_file(key)
        self.reads += 1
        after = os.stat(key)
        # Changed while being read, or written too recently for its mtime to prove the next change: re-read next time.
        racy = [after.st_size, after.st_mtime_ns, after.st_ino] != sig or time.time_ns() - st.st_mtime_ns < _RACY_NS
        self._new[key] = [*sig, digest, int(racy)]
        return digest

    def save(self) -> None:
        """Write the entries looked up in this run (atomically); nothing is written when nothing changed."""
        if self.path is None or self._new == self._old:
            return
        body = json.dumps({"format": _FORMAT, "entries": self._new}, separators=(",", ":"))
        atomic_write_text(self.path, body)
        self._old = dict(self._new)


def open_index(artifacts: str | os.PathLike[str] | None, verify: Verify) -> FileIndex:
    """The project's file index (artifacts/ingest/file_index.json); without artifacts, an in-memory one."""
    return FileIndex(None if artifacts is None else Path(artifacts) / "ingest" / INDEX_NAME, verify)
