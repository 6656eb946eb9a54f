"""The Label Studio annotations imports took, remembered beside the ledger (annotations_taken.jsonl, append-only).

A whole-project export (Label Studio's default) brings every task again, the ones imported before included. As the
live pull does (pipeline/annotation/label_studio.py, per project), a file import remembers the (task, annotation)
IDs it took, with the annotation's content, so a later export brings only what is new: a task all of whose
annotations were taken before is skipped whole; a task with a new or edited annotation is taken whole (its votes
stay complete). An old answer is then never read as a fresh vote against a later correction, and a label corrected
in tamis meanwhile is never reverted by a re-export.

Written after the ledger's write: a crash in between re-reads those tasks on the next import, which finds their
labels already current (nothing appended), never a task skipped whose label did not land.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipeline.annotation.label_files import LabelRow
from pipeline.store import append_jsonl, read_jsonl

TAKEN_NAME = "annotations_taken.jsonl"


def taken_path(ledger_path: Path) -> Path:
    return Path(ledger_path).with_name(TAKEN_NAME)


def _key(sample_id: str, task: str, annotation: str) -> str:
    return f"{sample_id}|{task}|{annotation}"


def taken(ledger_path: Path) -> set[str]:
    """Every (sample, task, annotation) an import took, as keys."""
    return {_key(r["sample_id"], r["task"], r["annotation"]) for r in read_jsonl(taken_path(ledger_path))}


def _sample(r: LabelRow) -> str | None:
    return r.resolved or r.sample_id


def already_taken(rows: Iterable[LabelRow], known: set[str]) -> set[int]:
    """Indexes (in `rows`) of the rows of tasks whose every annotation is in `known`: skip those tasks whole."""
    rows = list(rows)
    by_task: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        by_task.setdefault(r.task or f"#{i}", []).append(i)
    out: set[int] = set()
    for idx in by_task.values():
        if all(rows[i].task and rows[i].annotation and _sample(rows[i]) and
               _key(_sample(rows[i]), rows[i].task, rows[i].annotation) in known for i in idx):
            out.update(idx)
    return out


def remember(ledger_path: Path, rows: Iterable[LabelRow], *, source_file: str, source_digest: str,
             known: set[str]) -> int:
    """Append the rows' (sample, task, annotation) IDs not known yet; returns how many."""
    new: list[dict[str, Any]] = []
    for r in rows:
        sid = _sample(r)
        if r.task and r.annotation and sid and (k := _key(sid, r.task, r.annotation)) not in known:
            known.add(k)
            new.append({"sample_id": sid, "task": r.task, "annotation": r.annotation, "source_file": source_file,
                        "source_digest": source_digest})
    if new:
        append_jsonl(taken_path(ledger_path), new)
    return len(new)
