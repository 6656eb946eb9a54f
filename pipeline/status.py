"""What `tamis status` shows from the annotation side: rounds exported and finished, labels, pending inbox files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pipeline.annotation.carry import orphan_labels
from pipeline.annotation.inbox import inbox_dir, inbox_files
from pipeline.annotation.ledger import Ledger, ledger_path
from pipeline.annotation.rejections import read_rejections, rejections_dir
from pipeline.metrics import read_metrics
from pipeline.round_state import ROUNDS_DIR, completed_rounds
from pipeline.store import MANIFEST_NAME, digest_file


def status_summary(artifacts: str | os.PathLike[str]) -> dict[str, Any]:
    """What `tamis status` shows from the annotation side: rounds exported, labels, pending inbox, last metrics."""
    artifacts = Path(artifacts)
    rounds_dir = artifacts / ROUNDS_DIR
    exported = sorted(
        int(p.name) for p in rounds_dir.glob("[0-9][0-9][0-9]") if (p / "export" / MANIFEST_NAME).is_file()
    ) if rounds_dir.is_dir() else []
    read = Ledger(ledger_path(artifacts)).read()
    entries = read.rows
    done = {e.get("source_digest") for e in entries}
    metrics = read_metrics(artifacts)
    last_round = max((int(m["round"]) for m in metrics), default=None)
    rejected = read_rejections(artifacts)
    return {
        "rounds_exported": exported,
        # Finished rounds (round.json written), as `tamis status` lists them; a round that stopped exports nothing.
        "rounds_done": len(completed_rounds(artifacts)),
        # A label carried over to a re-saved image counts once: under the sample its image is now.
        "labeled": len({e["sample_id"] for e in entries if "sample_id" in e}
                       - {e.get("carried_from") for e in entries if e.get("kind") == "carry"}),
        "ledger_entries": len(entries),
        "corrections": sum(e.get("kind") == "correction" for e in entries),
        # What the ledger holds besides committed entries: a torn last line, a damaged line (line numbers).
        "ledger_problems": [str(p) for p in read.problems],
        "carried": sum(e.get("kind") == "carry" for e in entries),
        # Labels of no sample of the dataset any more (`tamis labels orphans`); None before any dataset.
        "orphan_labels": None if (orphans := orphan_labels(artifacts)) is None else len(orphans),
        # Inbox files no ledger entry came from yet (a file whose rows were all rejected stays listed).
        "inbox_pending": [str(p) for p in inbox_files(inbox_dir(artifacts)) if digest_file(p) not in done],
        # Label rows refused (file:line and reason in rejections/*.jsonl); their samples without a label since are
        # back among the candidates of the next batch.
        "rejected_rows": len(rejected),
        "rejections_dir": str(rejections_dir(artifacts)),
        "rejected_unlabeled": len({r["sample_id"] for r in rejected if r.get("sample_id")}
                                  - {e["sample_id"] for e in entries if "sample_id" in e}),
        "last_round_evaluated": last_round,
        "last_metrics": {m["metric"]: m["value"] for m in metrics if last_round is not None and m["round"] == last_round},
        "metrics_rows": len(metrics),
        "annotation_time": annotation_time(artifacts),
    }


def annotation_time(artifacts: str | os.PathLike[str], *, next_batch: int | None = None) -> dict[str, Any] | None:
    """Annotator time so far (from the times Label Studio or the label files recorded): hours, median and p90
    seconds per label by annotator, and the forecast hours for a next batch of `next_batch` labels (at the median
    of every timed annotation). None when no annotation carried a time."""
    import numpy as np

    rows = Ledger(ledger_path(artifacts)).times()
    if not rows:
        return None
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r["annotator"], []).append(float(r["seconds"]))
    every = np.array([s for v in by.values() for s in v])
    out: dict[str, Any] = {
        "hours": round(float(every.sum()) / 3600, 3), "timed": len(every),
        "median_s": round(float(np.median(every)), 1), "p90_s": round(float(np.percentile(every, 90)), 1),
        "annotators": {a: {"n": len(v), "median_s": round(float(np.median(v)), 1),
                           "p90_s": round(float(np.percentile(v, 90)), 1)} for a, v in sorted(by.items())},
    }
    if next_batch:
        out["next_batch"] = next_batch
        out["next_batch_hours"] = round(next_batch * float(np.median(every)) / 3600, 3)
    return out
