"""A persisted file index, like git's: (path, size, mtime_ns, inode) → content digest of the file.

The ingest cache key is built from the content digest of every image a source references. Reading every image to
learn that nothing changed made an unchanged re-run cost a full read of the pool; with this index it costs one
`stat` per file. A file whose stat changed is read and digested again, so a rewrite with identical bytes keeps its
digest (and the key), and an edit is seen even when the size stays the same.

`data.verify: content` re-reads every file (for filesystems whose mtimes cannot be trusted: some network mounts,
archives unpacked with their timestamps kept); both modes give the same digests, so the same key. Under the default
`data.verify: listing` most runs look up no file at all (pipeline/data/listing.py); a run that does uses this index
as `stat` does.

Racy entries (git's "racily clean" problem): a file written within the timestamp granularity of the moment it was
digested could change again without its mtime moving. An entry whose mtime is that close to the digest time is kept
but not trusted: the next run reads that file once more.

The index is columns of fixed-width numbers (file_index.npz, ~65 bytes a file), not a dict of paths: a pool of 10⁶
files held as Python strings and lists cost ~600 MB in every process that walks the sources (three times a round, then).
A path is looked up by a 64-bit hash of it; two paths sharing a hash cost a re-read, never a wrong digest, because
an entry is only trusted when the file's size, mtime and inode match it too.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time
import zipfile
from array import array
from pathlib import Path
from typing import Literal

import numpy as np

from pipeline.store import atomic_write_stream

log = logging.getLogger(__name__)

INDEX_NAME = "file_index.npz"  # under artifacts/ingest/
_LEGACY_NAME = "file_index.json"  # tamis ≤ 0.x kept {path: [size, mtime_ns, ino, digest, racy]} as JSON
_FORMAT = 2
# Coarsest mtime granularity in common use (FAT: 2 s; ext4/xfs/APFS: ns; NFS may round to s).
RACY_NS = 2_000_000_000
_CHUNK = 1 << 20

Verify = Literal["stat", "content"]


def _digest_file(path: str) -> str:
    # The same sha256 as pipeline.store.digest_bytes of the whole file, so both verify modes give equal keys.
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def path_hash(path: str) -> int:
    """64 bits of blake2b of the path: its key in the index."""
    return int.from_bytes(hashlib.blake2b(os.fsencode(path), digest_size=8).digest(), "little")


class _Columns:
    """The index's entries as parallel arrays, sorted by path hash (each hash once)."""

    def __init__(self, keys: np.ndarray, sig: np.ndarray, digest: np.ndarray, racy: np.ndarray):
        self.keys, self.sig, self.digest, self.racy = keys, sig, digest, racy

    @classmethod
    def empty(cls) -> _Columns:
        return cls(np.zeros(0, np.uint64), np.zeros((0, 3), np.int64), np.zeros((0, 32), np.uint8),
                   np.zeros(0, bool))

    @classmethod
    def build(cls, keys: np.ndarray, sig: np.ndarray, digest: np.ndarray, racy: np.ndarray) -> _Columns:
        """Sorted by key; of entries sharing a key, the last one given wins (the newest lookup)."""
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        last = np.ones(len(keys), bool)
        last[:-1] = keys[1:] != keys[:-1]
        pick = order[last]
        return cls(keys[last], sig[pick], digest[pick], racy[pick])

    def find(self, key: int) -> int:
        i = int(np.searchsorted(self.keys, np.uint64(key)))
        return i if i < len(self.keys) and int(self.keys[i]) == key else -1

    def __len__(self) -> int:
        return len(self.keys)


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
        self._old = self._load()
        self._seen = np.zeros(len(self._old), bool)  # old entries looked up in this run (kept by save)
        # Entries digested in this run, as compact columns (a first ingest of 10⁶ files adds 10⁶ of them).
        self._new_keys, self._new_sig, self._new_racy = array("Q"), array("q"), array("B")
        self._new_digest = bytearray()
        self.reads = 0  # files read and digested in this run (the rest were answered from the index)
        self.hits = 0
        self.racy = 0  # entries recorded in this run as racy (their next lookup reads the file again)
        # Folders whose listing the rows located so far depend on, noted by the readers: what the listing check
        # (pipeline/data/listing.py) stats instead of every file.
        self.folders: set[str] = set()

    def _load(self) -> _Columns:
        if self.path is None:
            return _Columns.empty()
        if not self.path.is_file():
            return self._load_legacy()
        try:
            with np.load(self.path, allow_pickle=False) as z:
                if int(z["format"]) != _FORMAT:
                    raise ValueError(f"format {int(z['format'])}")
                cols = _Columns(z["keys"], z["sig"], z["digest"], z["racy"])
            if not (cols.sig.shape == (len(cols), 3) and cols.digest.shape == (len(cols), 32)
                    and cols.racy.shape == (len(cols),)):
                raise ValueError("columns of unequal length")
            return cols
        except (ValueError, KeyError, OSError, EOFError, zipfile.BadZipFile) as exc:
            # The index is only a cache of digests: a damaged one costs one full read, never a wrong key.
            log.warning("%s: unreadable file index (%s); every file is read once and the index rebuilt", self.path,
                        exc)
            return _Columns.empty()

    def _load_legacy(self) -> _Columns:
        """The JSON index of earlier versions, converted once (the next save writes the new file)."""
        legacy = self.path.with_name(_LEGACY_NAME) if self.path is not None else None
        if legacy is None or not legacy.is_file():
            return _Columns.empty()
        try:
            entries = json.loads(legacy.read_text(encoding="utf-8"))["entries"]
            keys = np.array([path_hash(p) for p in entries], np.uint64)
            sig = np.array([e[:3] for e in entries.values()], np.int64).reshape(-1, 3)
            digest = np.array([list(bytes.fromhex(e[3])) for e in entries.values()], np.uint8).reshape(-1, 32)
            racy = np.array([bool(e[4]) for e in entries.values()], bool)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, UnicodeDecodeError) as exc:
            log.warning("%s: unreadable file index (%s); every file is read once and the index rebuilt", legacy, exc)
            return _Columns.empty()
        return _Columns.build(keys, sig, digest, racy)

    def __len__(self) -> int:
        return len(self._old)

    def entry(self, path: str | os.PathLike[str]) -> tuple[list[int], str, bool] | None:
        """What the saved index holds for `path`: ([size, mtime_ns, inode], digest, racy), or None."""
        i = self._old.find(path_hash(os.fspath(path)))
        if i < 0:
            return None
        return self._old.sig[i].tolist(), self._old.digest[i].tobytes().hex(), bool(self._old.racy[i])

    def digest(self, path: str | os.PathLike[str], st: os.stat_result | None = None) -> str:
        """sha256 of the file at `path` (absolute, resolved); `st` is its os.stat result when the caller has it."""
        key = os.fspath(path)
        st = st if st is not None else os.stat(key)
        sig = [st.st_size, st.st_mtime_ns, st.st_ino]
        h = path_hash(key)
        i = self._old.find(h) if self.verify == "stat" else -1
        if i >= 0 and not self._old.racy[i] and self._old.sig[i].tolist() == sig:
            self.hits += 1
            self._seen[i] = True
            return self._old.digest[i].tobytes().hex()
        digest = _digest_file(key)
        self.reads += 1
        after = os.stat(key)
        # Changed while being read, or written too recently for its mtime to prove the next change: re-read next time.
        racy = [after.st_size, after.st_mtime_ns, after.st_ino] != sig or time.time_ns() - st.st_mtime_ns < RACY_NS
        self._new_keys.append(h)
        self._new_sig.extend(sig)
        self._new_digest += bytes.fromhex(digest)
        self._new_racy.append(int(racy))
        self.racy += int(racy)
        return digest

    def keep_unseen(self) -> None:
        """Keep the entries not looked up in this run on `save`: a source answered by its folder listing looked up
        none of its files, and they are still there."""
        self._seen[:] = True

    def save(self) -> None:
        """Write the entries looked up in this run (atomically); nothing is written when nothing changed."""
        if self.path is None:
            return
        if not self._new_keys and self._seen.all() and self.path.is_file():
            return
        old = self._old
        keep = self._seen
        cols = _Columns.build(
            np.concatenate([old.keys[keep], np.frombuffer(self._new_keys, np.uint64)]),
            np.concatenate([old.sig[keep], np.frombuffer(self._new_sig, np.int64).reshape(-1, 3)]),
            np.concatenate([old.digest[keep], np.frombuffer(bytes(self._new_digest), np.uint8).reshape(-1, 32)]),
            np.concatenate([old.racy[keep], np.frombuffer(self._new_racy, np.uint8).astype(bool)]))

        def write(f: io.BufferedWriter) -> None:
            np.savez(f, format=np.int64(_FORMAT), keys=cols.keys, sig=cols.sig, digest=cols.digest, racy=cols.racy)

        atomic_write_stream(self.path, write, f"a file index of {len(cols):,} entries")
        self.path.with_name(_LEGACY_NAME).unlink(missing_ok=True)
        self._old, self._seen = cols, np.ones(len(cols), bool)
        self._new_keys, self._new_sig, self._new_racy = array("Q"), array("q"), array("B")
        self._new_digest = bytearray()


def open_index(artifacts: str | os.PathLike[str] | None, verify: Verify | Literal["listing"]) -> FileIndex:
    """The project's file index (artifacts/ingest/file_index.npz); without artifacts, an in-memory one. Under
    `data.verify: listing` a source whose listing moved is walked as under `stat`."""
    path = None if artifacts is None else Path(artifacts) / "ingest" / INDEX_NAME
    return FileIndex(path, "content" if verify == "content" else "stat")
