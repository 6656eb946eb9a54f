"""Which sample a label row names: the tamis sample_id, the source's own ID, or an image path or Label Studio URL.

`SampleIndex.resolve` tries them in that order (see pipeline/annotation/labels.py for the import around it): a path
matches by its longest tail that names any sample, which must name exactly one; an upload or a remote URL by its file
name alone; tamis' own exports by the `<sample_id>.<ext>` file name.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from pipeline.annotation.label_files import LabelRow

MAX_TAIL = 6  # path components compared at most: deeper prefixes differ between machines, not between samples
_LS_UPLOAD = re.compile(r"^[0-9a-f]{8}-")  # Label Studio prefixes uploaded file names with 8 hex digits


def _parts(path: str) -> tuple[str, ...]:
    """A path's components, posix or Windows separators, without '.', '..' and the root."""
    return tuple(p for p in path.replace("\\", "/").split("/") if p not in ("", ".", ".."))


def image_key(value: str) -> tuple[tuple[str, ...], str]:
    """(path parts to match, how) for an image path or a Label Studio image URL.

    how: "path" (any unique tail of the path may match), "name" (the file name alone: uploads and remote URLs).
    """
    url = urlparse(value)
    if url.path.startswith("/data/local-files"):
        d = parse_qs(url.query).get("d")
        return _parts(unquote(d[0])) if d else (), "path"
    if url.path.startswith("/data/upload"):
        name = PurePosixPath(unquote(url.path)).name
        return ((_LS_UPLOAD.sub("", name),) if name else ()), "name"
    if url.scheme in ("http", "https", "s3", "gs", "azure-blob"):
        name = PurePosixPath(unquote(url.path)).name
        return ((name,) if name else ()), "name"
    if url.scheme == "file":
        return _parts(unquote(url.path)), "path"
    return _parts(value), "path"


class SampleIndex:
    """The samples a label file may name, with every key that may name them.

    Built for a whole prepared pool (10⁶ rows), so it holds its columns as they come and indexes them only when asked:
    sample IDs in an IdIndex (~28 bytes a row), the user's own IDs and the image paths as dicts built on the first
    label that needs them. A label file of tamis' own exports names samples by sample_id and never builds those."""

    def __init__(self, sample_ids: Any, external_ids: Any = None, image_paths: Any = None, *,
                 scope: str | None = None):
        from pipeline.idindex import IdIndex

        self._columns = (sample_ids, external_ids, image_paths)
        self._ids = IdIndex(sample_ids)
        self._added: set[str] = set()
        self.scope = scope or f"this project's {len(self)} samples"
        self._external: dict[str, set[str]] | None = None
        self._paths: dict[str, str] | None = None
        self._tails: dict[tuple[str, ...], set[str]] | None = None  # built on the first image lookup

    def _pairs(self, column: Any) -> list[tuple[str, str]]:
        """(sample_id, value) for the rows whose `column` holds a value."""
        if column is None:
            return []
        import pyarrow as pa
        import pyarrow.compute as pc

        sids = self._columns[0]
        if isinstance(column, (pa.Array, pa.ChunkedArray)):
            keep = pc.and_(pc.is_valid(column), pc.not_equal(column, ""))
            return list(zip(pc.filter(sids, keep).to_pylist(), pc.filter(column, keep).to_pylist(), strict=True))
        return [(sid, v) for sid, v in zip(sids, column, strict=True) if v not in (None, "")]

    @property
    def by_external(self) -> dict[str, set[str]]:
        """The user's own ID → the samples that carry it."""
        if self._external is None:
            self._external = {}
            for sid, ext in self._pairs(self._columns[1]):
                self._external.setdefault(str(ext), set()).add(sid)
        return self._external

    @property
    def paths(self) -> dict[str, str]:
        """sample_id → its image path."""
        if self._paths is None:
            self._paths = dict(self._pairs(self._columns[2]))
        return self._paths

    @property
    def by_tail(self) -> dict[tuple[str, ...], set[str]]:
        """The last 1..MAX_TAIL components of every image path → the samples whose path ends so."""
        if self._tails is None:
            self._tails = {}
            for sid, path in self.paths.items():
                parts = _parts(path)
                for k in range(1, min(len(parts), MAX_TAIL) + 1):
                    self._tails.setdefault(parts[-k:], set()).add(sid)
        return self._tails

    def __contains__(self, sample_id: object) -> bool:
        return isinstance(sample_id, str) and (sample_id in self._added or sample_id in self._ids)

    def knows(self, sample_ids: Sequence[str]) -> list[bool]:
        """`sample_id in self` for each of them, in one vectorised look-up."""
        return [bool(r >= 0) or s in self._added for s, r in zip(sample_ids, self._ids.rows(sample_ids), strict=True)]

    def __len__(self) -> int:
        return len(self._ids) + len(self._added)

    def add(self, sample_ids: Sequence[str]) -> None:
        """Samples a label may name by sample_id only (e.g. exported from an older dataset version)."""
        self._added.update(s for s in sample_ids if s not in self)

    @classmethod
    def from_dataset(cls, ds: Any, *, scope: str | None = None) -> SampleIndex:
        """The index of a saved dataset's sample_id, external_id and image_path columns, read as Arrow columns
        (no Python string per row until a label asks for a user's ID or a path)."""
        from pipeline.store import arrow_column

        cols = [arrow_column(ds, c) if c in ds.column_names else None for c in ("sample_id", "external_id",
                                                                                  "image_path")]
        return cls(*cols, scope=scope)

    @classmethod
    def of(cls, known: SampleIndex | set[str] | Sequence[str]) -> SampleIndex:
        return known if isinstance(known, SampleIndex) else cls(sorted(known))

    def _ambiguous(self, what: str, sids: set[str]) -> str:
        named = [f"{s} ({self.paths[s]})" if s in self.paths else s for s in sorted(sids)]
        return (f"{what} matches {len(sids)} samples: {', '.join(named[:5])}{' …' if len(named) > 5 else ''}; "
                "name the sample by its sample_id or a longer path")

    def resolve(self, row: LabelRow) -> str | None:
        """Set row.resolved / matched_by / matched_key; None when the row matched, else the rejection reason."""
        if row.sample_id and row.sample_id in self:
            row.resolved, row.matched_by, row.matched_key = row.sample_id, "sample_id", row.sample_id
            return None
        tried = []
        # The user's own ID: its column, or a sample_id column that holds the user's IDs.
        for value in dict.fromkeys(v for v in (row.external_id, row.sample_id) if v):
            hits = self.by_external.get(value, set())
            if len(hits) == 1:
                row.resolved, row.matched_by, row.matched_key = next(iter(hits)), "id", value
                return None
            if hits:
                return self._ambiguous(f"id {value!r}", hits)
        if row.external_id:
            tried.append(f"id {row.external_id!r}")
        if row.image:
            parts, how = image_key(row.image)
            # The longest tail of the path that names any sample must name exactly one.
            longest = min(len(parts), MAX_TAIL)
            for k in range(longest, 0, -1) if how == "path" else ([1] if parts else []):
                hits = self.by_tail.get(parts[-k:], set())
                if len(hits) == 1:
                    row.resolved = next(iter(hits))
                    row.matched_by = "image_path" if k == longest and how == "path" else "image_name"
                    row.matched_key = row.image
                    return None
                if hits:
                    return self._ambiguous(f"image {'/'.join(parts[-k:])!r}", hits)
            stem = PurePosixPath(parts[-1]).stem if parts else ""
            if stem in self:  # tamis's own exports name their images <sample_id>.<ext>
                row.resolved, row.matched_by, row.matched_key = stem, "image_name", row.image
                return None
            tried.append(f"image {row.image!r}" + (f" (as {'/'.join(parts)!r} and its tails)" if how == "path" and
                                                   len(parts) > 1 else ""))
        if row.sample_id and not tried:
            return f"unknown sample_id {row.sample_id!r}: not among {self.scope}"
        if row.sample_id:
            tried.insert(0, f"sample_id {row.sample_id!r}")
        if not tried:
            return "no sample_id, id or image; every row must name the sample it labels"
        return f"no sample matches: tried {', '.join(tried)}; not among {self.scope}"
