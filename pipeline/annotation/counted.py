"""Each annotation counted once: its time and its vote are facts of the annotation, not of the file that carried it.

An inbox CSV imported half-written and again once complete, or a Label Studio project exported twice (v1, then v2
holding v1's annotations and more), carries the same annotations in two files with two digests. The ledger stays
right either way (the second import repeats labels it already holds), but the time log and the votes log would book
them twice: 300 s instead of 200 s, two votes from one person. So every time row and vote row carries its
annotation's key (`LabelRow.count_key`) and both logs count one row per key (`count_once`):

- a row with Label Studio's IDs: sample + task + annotation ID + annotator; a later version of the annotation (its
  `updated_at`, else the later import) replaces the earlier one's vote and time (Label Studio's `lead_time` of an
  edited annotation is its total so far, not the edit's);
- a row without IDs (a CSV, a JSONL): sample + annotator + answer + seconds (+ the re-label set it answers). Two
  such rows alike in all of these are one annotation seen twice; the importer already rejects them inside one file.

Rows logged before keys existed count once per (file digest, sample, annotator, answer), as they always did.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

# The ledger reads the logs through this module, and the stages that read the ledger (selection, evaluation) digest
# what it imports into their code versions: it imports nothing of tamis. The key of a row read from a label file is
# LabelRow.count_key (label_files.py).


def instant(stamp: str) -> float:
    """Label Studio's updated_at as seconds since the epoch, so `…:00Z` sorts before `…:00.400000Z` (as text it
    sorts after). Without a zone it is UTC, as Label Studio writes it; unreadable sorts first (-inf)."""
    try:
        when = datetime.fromisoformat(stamp.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except (ValueError, AttributeError):
        return -math.inf
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


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
        if (old is not None and old.get("updated_at") and r.get("updated_at")
                and instant(r["updated_at"]) < instant(old["updated_at"])):
            continue  # an older export imported after a newer one
        out[k] = dict(r)
    return list(out.values())


def new_rows(rows: Iterable[Mapping[str, Any]], logged: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`rows` less those the log already holds as they are (same key and version): a re-import writes nothing."""
    seen = {(row_key(r), r.get("updated_at"), r.get("label"), r.get("seconds")) for r in logged}
    return [dict(r) for r in rows if (row_key(r), r.get("updated_at"), r.get("label"), r.get("seconds")) not in seen]
