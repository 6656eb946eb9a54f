"""The listing check (`data.verify: listing`): learn that a source is unchanged from its folders' modification times,
without looking up each image file.

A folder's mtime moves whenever an entry is added to it, removed from it or renamed in it (a file replaced by an
atomic rename included). So a source whose every folder, manifest and saved-dataset file still has the (mtime, ctime,
inode, size) recorded after its last full walk holds the same files under the same names, and its entry in the ingest
key is the one that walk computed: it is re-used without looking up one image. A pool of 10⁶ images in a few
folders then costs a few stats, not 10⁶.

What it cannot see: a file rewritten in place under the same name (open, truncate, write) moves that file's mtime,
not its folder's. `data.sweep_every` bounds how long such an edit goes unseen: after that many runs answered by the
listing, the next run walks every file through the file index (as `verify: stat`), which sees it. A same-size rewrite
whose old timestamp was put back (touch -d, os.utime) is seen only by `verify: content`. A manifest is watched by its
own stat, ctime included (which no tool sets back), so any edit of it is seen at once.

Racy folders, as in the file index: a folder whose mtime is within the timestamp granularity of the walk's start may
have changed during the walk, or change again without its mtime moving, so a listing recorded then is not kept and
the next run walks again; the same holds when the walk recorded a racy file.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipeline.config import SourceConfig
from pipeline.data.file_index import RACY_NS
from pipeline.store import atomic_write_json

log = logging.getLogger(__name__)

LISTING_NAME = "listing.json"  # under artifacts/ingest/
_FORMAT = 1

Sig = list[int] | None  # [mtime_ns, ctime_ns, inode, size] of a folder or file; None when it is not there


def path_sig(path: str) -> Sig:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_size]


def source_files(src: SourceConfig) -> list[str]:
    """What a source's rows are read from besides its image files (whose folders the readers note): a manifest, or
    a saved dataset's folders and files (a few)."""
    p = Path(src.path)
    if src.kind == "hf" and p.is_dir():
        return [str(p), *(str(q) for q in p.rglob("*"))]
    return [str(p)]  # a manifest, or a folder source's root as configured (the walk notes it resolved)


class Listings:
    """The recorded listings of a project's sources (artifacts/ingest/listing.json), by source key (the source's
    config, the data section and the ingest code: what its rows depend on besides the files)."""

    def __init__(self, path: Path | None):
        self.path = path
        self.runs, self.sources = self._load()  # runs answered by listings since every file was last looked up
        self.answered = 0  # sources answered by their listing in this run

    def _load(self) -> tuple[int, dict[str, Any]]:
        if self.path is None or not self.path.is_file():
            return 0, {}
        try:
            d = json.loads(self.path.read_text(encoding="utf-8"))
            if d["format"] != _FORMAT:
                raise ValueError(f"format {d['format']}")
            return int(d["runs_since_sweep"]), dict(d["sources"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # Only a shortcut: a damaged file costs one walk of every source, never a wrong key.
            log.warning("%s: unreadable listing (%s); every source is walked once and the listing rebuilt",
                        self.path, exc)
            return 0, {}

    def answer(self, key: str) -> dict[str, Any] | None:
        """The source's recorded entry when nothing it watches moved (one stat each), else None."""
        rec = self.sources.get(key)
        if rec is None or any(path_sig(p) != sig for p, sig in rec["watched"].items()):
            return None
        self.answered += 1
        return rec["entry"]

    def record(self, key: str, entry: dict[str, Any], watched: Iterable[str], start_ns: int, *,
               racy_files: bool) -> bool:
        """Keep `entry` with the stats of what it was read from, taken now, after the walk that began at `start_ns`;
        a racy walk is not kept (the next run walks again). Returns whether it was kept."""
        sigs = {p: path_sig(p) for p in sorted(set(watched))}
        racy = racy_files or any(s is not None and s[0] >= start_ns - RACY_NS for s in sigs.values())
        if racy:
            self.sources.pop(key, None)
        else:
            self.sources[key] = {"entry": entry, "watched": sigs}
        return not racy

    def save(self, keys: set[str]) -> None:
        """Write the listings of the sources in `keys` (the configured ones) and count this run: a run that walked
        every source starts the count again."""
        if self.path is None:
            return
        self.runs = self.runs + 1 if self.answered else 0
        self.sources = {k: v for k, v in self.sources.items() if k in keys}
        atomic_write_json(self.path, {"format": _FORMAT, "runs_since_sweep": self.runs, "sources": self.sources},
                          indent=None)


def open_listings(artifacts: str | os.PathLike[str] | None) -> Listings:
    """The project's listings (artifacts/ingest/listing.json); without artifacts, an in-memory one (never answers)."""
    return Listings(None if artifacts is None else Path(artifacts) / "ingest" / LISTING_NAME)
