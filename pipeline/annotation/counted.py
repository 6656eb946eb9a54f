"""Each annotation counted once: its time and its vote are facts of the annotation, not of the file that carried it.

An inbox CSV imported half-written and again once complete, or a Label Studio project exported twice (v1, then v2
holding v1's annotations and more), carries the same annotations in two files with two digests. The ledger stays
right either way (the second import repeats labels it already holds), but the time log and the votes log would book
them twice: 300 s instead of 200 s, two votes from one person. So every time row and vote row carries its
annotation's key (`annotation_key`) and both logs count one row per key (`count_once`):

- a row with Label Studio's IDs: sample + task + annotation ID + annotator; a later version of the annotation (its
  `updated_at`, else the later import) replaces the earlier one's vote and time (Label Studio's `lead_time` of an
  edited annotation is its total so far, not the edit's);
- a row without IDs (a CSV, a JSONL): sample + annotator + answer + seconds (+ the re-label set it answers). Two
  such rows alike in all of these are one annotation seen twice; the importer already rejects them inside one file.

Rows logged before keys existed count once per (file digest, sample, annotator, answer), as they always did.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the ledger reads the logs through this module: it needs no label file reader
    from pipeline.annotation.label_files import LabelRow


def annotation_key(sample_id: str, row: LabelRow) -> str:
    """The identity of the annotation `row` reads: what its time and vote are counted once by (module docstring)."""
    if row.task and row.annotation:
        # row.annotation is "ID:content digest" (label_files._taken_key): the ID names the annotation, the content
        # is its version, which a newer export of the same annotation replaces.
        return json.dumps(["ls", sample_id, row.task, row.annotation.split(":", 1)[0], row.annotator])
    return json.dumps(["row", sample_id, row.relabel, row.annotator, row.label, row.seconds])


def _legacy_key(r: Mapping[str, Any]) -> str:
    return json.dumps([r.get("source_digest"), r.get("sample_id"), r.get("annotator"), r.get("label")])


def row_key(r: Mapping[str, Any]) -> str:
    """The key a logged time / vote row counts by."""
    return r.get("annotation") or _legacy_key(r)


def count_once(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per annotation, in the order each was first logged: the newest version of each (the greatest
    `updated_at` when both rows have one, else the later row)."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        k = row_key(r)
        old = out.get(k)
        if old is not None and old.get("updated_at") and r.get("updated_at") and r["updated_at"] < old["updated_at"]:
            continue  # an older export imported after a newer one
        out[k] = dict(r)
    return list(out.values())


def new_rows(rows: Iterable[Mapping[str, Any]], logged: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`rows` less those the log already holds as they are (same key and version): a re-import writes nothing."""
    seen = {(row_key(r), r.get("updated_at"), r.get("label"), r.get("seconds")) for r in logged}
    return [dict(r) for r in rows if (row_key(r), r.get("updated_at"), r.get("label"), r.get("seconds")) not in seen]
