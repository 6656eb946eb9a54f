"""The label ledger: an append-only JSONL log, the single source of truth for what is labeled.

Nothing rewrites it. Each import is one committed batch (pipeline/store.py's append_jsonl): a crash mid-write leaves
the whole batch or none of it, the next write sets a cut-off tail aside in a file beside the ledger, and a label file
counts as imported only once its batch is committed. A changed label is a new "correction" entry that names the entry it supersedes;
the newest entry per sample wins and the full history stays readable. "Newest" is file order, not the `time` field,
because wall clocks can step backwards while appends cannot.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pipeline.annotation.counted import count_once
from pipeline.errors import LabelImportError
from pipeline.store import LogProblem, LogRead, append_jsonl, digest_json, read_jsonl, read_log

LEDGER_NAME = "labels.jsonl"
TIMES_NAME = "annotation_times.jsonl"  # beside the ledger: seconds per annotation, when the file gave them
KINDS = ("label", "correction", "carry")  # carry: a label passed on to the sample its image became (carry.py)
REQUIRED = ("sample_id", "label", "annotator", "round", "source_file", "source_digest", "kind")


def ledger_path(artifacts: str | os.PathLike[str]) -> Path:
    return Path(artifacts) / LEDGER_NAME


def make_entry(
    sample_id: str,
    label: str,
    *,
    annotator: str,
    round_index: int,
    source_file: str,
    source_digest: str,
    supersedes: Mapping[str, Any] | None = None,
    votes: list[dict[str, str]] | None = None,
    matched_by: str | None = None,
    matched_key: str | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """A ledger entry; a label replacing an existing one is a correction pointing at the entry it supersedes.

    `matched_by` records which key of the label row named the sample (sample_id, id, image_path, image_name) and
    `matched_key` its value, when it was not the sample_id itself.
    """
    e: dict[str, Any] = {
        "sample_id": sample_id,
        "label": label,
        "annotator": annotator,
        "round": round_index,
        "source_file": source_file,
        "source_digest": source_digest,
        "time": time.time() if now is None else now,
        "kind": "correction" if supersedes else "label",
    }
    if supersedes:
        e["supersedes"] = supersedes["entry_id"]
        e["previous_label"] = supersedes["label"]
    if votes:
        e["votes"] = votes
    if matched_by:
        e["matched_by"] = matched_by
        if matched_key is not None and matched_by != "sample_id":
            e["matched_key"] = matched_key
    e["entry_id"] = digest_json(e)[:16]
    return e


class Ledger:
    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)

    def read(self) -> LogRead:
        """The committed entries and whatever else the file holds (a torn last line, a damaged line...)."""
        return read_log(self.path)

    def entries(self) -> list[dict[str, Any]]:
        return self.read().rows

    def problems(self) -> list[LogProblem]:
        return self.read().problems

    def current(self) -> dict[str, dict[str, Any]]:
        """sample_id → its newest entry."""
        return {e["sample_id"]: e for e in self.entries() if "sample_id" in e}

    def labels(self) -> dict[str, str]:
        return {sid: e["label"] for sid, e in self.current().items()}

    def history(self, sample_id: str) -> list[dict[str, Any]]:
        """Every entry for one sample, oldest first; the last one is current."""
        return [e for e in self.entries() if e.get("sample_id") == sample_id]

    def imported_digests(self) -> set[str]:
        return {e["source_digest"] for e in self.entries() if e.get("source_digest")}

    def append(self, entries: Iterable[Mapping[str, Any]]) -> int:
        """Append a batch in one fsync'd, committed write: after a crash it is all there or not at all."""
        rows = [dict(e) for e in entries]
        for i, e in enumerate(rows):
            missing = [k for k in REQUIRED if k not in e]
            if missing:
                raise LabelImportError(f"ledger entry {i} ({e.get('sample_id')!r}) lacks {', '.join(missing)}")
            if e["kind"] not in KINDS:
                raise LabelImportError(f"ledger entry {i}: kind {e['kind']!r} is not one of {', '.join(KINDS)}")
            if not isinstance(e["label"], str) or not e["label"].strip():
                raise LabelImportError(f"ledger entry {i} ({e['sample_id']}): empty label")
        append_jsonl(self.path, rows)
        return len(rows)

    # Annotation time is a fact of each annotation, not of a label: a re-label that confirms the label changes no
    # ledger entry but cost its annotator the same time. So it has its own append-only log beside the ledger.
    @property
    def times_path(self) -> Path:
        return self.path.with_name(TIMES_NAME)

    def append_times(self, rows: Iterable[Mapping[str, Any]]) -> None:
        rows = [dict(r) for r in rows]
        if rows:
            append_jsonl(self.times_path, rows)

    def times(self) -> list[dict[str, Any]]:
        """One row per timed annotation: sample_id, annotator, seconds, round, source_digest, annotation. An
        annotation two files carried (a CSV imported half-written then whole, cumulative exports, an import that
        crashed before its ledger write and ran again) counts once, its newest version (pipeline/annotation/counted.py)."""
        return count_once(read_jsonl(self.times_path))
