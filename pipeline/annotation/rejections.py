"""Rejected label rows: the report each import writes (artifacts/rejections/<file digest>.jsonl), what a round and
`tamis status` read of them (pipeline/report.py words them), and which exported samples they give back.

A row is rejected with its file:line and a reason (pipeline/annotation/labels.py). Its sample was sent to the
annotators and got no label: it is not "still with the annotators" any more, so it returns to the next batch's
candidates, unless a round exported it again after the rejection (then it is out again). Each row keeps the round of
the import that first rejected it: a file all of whose rows were rejected is read again by every round (the ledger
never took its digest), and must not look like a fresh rejection of a sample exported meanwhile.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.store import atomic_write_jsonl, read_jsonl

REJECTIONS = "rejections"


def rejections_dir(artifacts: str | os.PathLike[str]) -> Path:
    return Path(artifacts) / REJECTIONS


def write_rejections(folder: str | os.PathLike[str], digest: str, rows: Sequence[Mapping[str, Any]], *,
                     round_index: int) -> Path:
    """The file's rejection report, each row with the round that first rejected it (kept from an earlier report of
    the same file)."""
    out = Path(folder) / f"{digest[:16]}.jsonl"
    first = {r.get("where"): r.get("round") for r in read_jsonl(out)} if out.is_file() else {}
    return atomic_write_jsonl(out, [{**r, "round": first.get(r["where"], round_index)} for r in rows])


def read_rejections(artifacts: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every rejected row of every import report."""
    folder = rejections_dir(artifacts)
    return [r for p in sorted(folder.glob("*.jsonl")) for r in read_jsonl(p)] if folder.is_dir() else []


def rejected_samples(artifacts: str | os.PathLike[str]) -> dict[str, int]:
    """sample ID → the latest round an import rejected a row of it (rows that named no sample left out)."""
    out: dict[str, int] = {}
    for r in read_rejections(artifacts):
        if r.get("sample_id") and r.get("round") is not None:
            out[r["sample_id"]] = max(out.get(r["sample_id"], -1), int(r["round"]))
    return out
