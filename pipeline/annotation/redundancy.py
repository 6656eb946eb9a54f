"""The redundancy queue (annotate.redundancy): samples whose consensus is unsure go to another annotator with the
next export, as a separate task set (rounds/NNN/consensus/) beside the round's batch, the way the label check's
re-label queue goes out. Every task sent costs an annotator's time, one label each, so rounds.label_budget counts
them (`redundancy_spent`), as it counts re-label tasks, and caps the queue: a round sends at most what the budget
leaves after its batch and its re-label tasks (`budget_trim`), least confident first, and says how many it held back.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.annotation.consensus import ConsensusRecord
from pipeline.codeversion import stage_version
from pipeline.config import AnnotateConfig
from pipeline.errors import ArtifactError
from pipeline.round_state import round_dir
from pipeline.store import (
    Manifest,
    atomic_write_jsonl,
    column,
    digest_json,
    find_valid_manifest,
    read_jsonl,
    read_manifest,
    stage_key,
    write_manifest,
)

log = logging.getLogger(__name__)

REDUNDANCY_VERSION = stage_version("1", "pipeline.annotation.redundancy")  # the queue's export moves with its code
REDUNDANCY_TABLE = "redundancy.jsonl"
REDUNDANCY_DIR = "consensus"  # in the round's folder


def redundancy_dir(artifacts: str | os.PathLike[str], round_index: int) -> Path:
    return round_dir(artifacts, round_index, REDUNDANCY_DIR)


def redundancy_queued(artifacts: str | os.PathLike[str], before_round: int | None = None) -> dict[int, list[dict]]:
    """Round → the rows its redundancy queue sent out (sample_id, votes it had then, confidence), for rounds before
    `before_round` (all with None). A queue whose manifest never landed was never handed out."""
    out = {}
    for d in sorted(Path(artifacts).glob("rounds/[0-9][0-9][0-9]/consensus")):
        r = int(d.parent.name)
        if before_round is not None and r >= before_round:
            continue
        try:
            read_manifest(d)
        except ArtifactError:
            continue
        out[r] = read_jsonl(d / REDUNDANCY_TABLE)
    return out


def redundancy_spent(artifacts: str | os.PathLike[str], before_round: int) -> int:
    """Labels the redundancy queues of earlier rounds asked for: one per task sent, answered or not yet."""
    return sum(len(rows) for rows in redundancy_queued(artifacts, before_round).values())


def requeued_ids(artifacts: str | os.PathLike[str]) -> set[str]:
    return {row["sample_id"] for rows in redundancy_queued(artifacts).values() for row in rows}


def redundancy_candidates(record: ConsensusRecord | None, rule: Any, *, queued: Mapping[int, Sequence[Mapping]],
                          eligible: set[str] | None = None) -> list[dict[str, Any]]:
    """Samples below rule.threshold with fewer than rule.max_labels votes, least confident first; a sample sent
    before goes again only once its earlier request was answered (it has more votes than it had then)."""
    if record is None or rule is None:
        return []
    asked = {}
    for rows in queued.values():
        for row in rows:
            asked[row["sample_id"]] = max(asked.get(row["sample_id"], 0), int(row["votes"]))
    return [{"sample_id": sid, "votes": d.n, "confidence": round(d.confidence, 6), "label": d.label}
            for sid, d in record.low_confidence(rule.threshold, rule.max_labels)
            if d.n > asked.get(sid, 0) and (eligible is None or sid in eligible)]


def budget_trim(rows: Sequence[Mapping[str, Any]], cap: int | None
                ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(the rows the budget pays for, the trim as round.json records it, or None when nothing was held back). `rows`
    come least confident first (redundancy_candidates), so the samples that need a second opinion most go first;
    `cap`: the labels rounds.label_budget leaves for the queue (pipeline.round.stop.redundancy_cap), None without one."""
    rows = [dict(r) for r in rows]
    if cap is None or len(rows) <= cap:
        return rows, None
    kept = rows[:max(0, cap)]
    held = len(rows) - len(kept)
    return kept, {"count": held, "reason": (
        f"{held} of {len(rows)} samples below annotate.redundancy.threshold not sent to another annotator: each costs "
        f"a label and rounds.label_budget leaves {max(0, cap)} after this round's batch and re-label tasks (the least "
        "confident went first); raise rounds.label_budget to send them")}


def export_redundancy(rows: Sequence[Mapping[str, Any]], dataset: Any, out_dir: str | os.PathLike[str], *,
                      annotate: Any, answers: Sequence[str] | None, artifacts: str | os.PathLike[str],
                      round_index: int) -> Manifest | None:
    """Write the queue as a task set in every configured format, plus redundancy.jsonl and the manifest (last);
    None when nothing is unsure. No pre-annotation: a second opinion shown the first one is not independent."""
    from pipeline.annotation.export import EXPORTERS, ExportContext, _document_relpath, build_items

    if not rows:
        return None
    out_dir = Path(out_dir)
    inputs = {"rows": digest_json([dict(r) for r in rows])}
    config = {"annotate": annotate.model_dump(mode="json"), "answers": answers}
    if (m := find_valid_manifest(out_dir, stage_key("redundancy", REDUNDANCY_VERSION, inputs, config))) is not None:
        return m  # already exported: annotators may be working on these files
    sel = [{"sample_id": r["sample_id"], "rank": k, "score": 1.0 - float(r["confidence"]), "scores": {}}
           for k, r in enumerate(rows)]
    items = build_items(sel, dataset, image_source=annotate.export_images)
    ctx = ExportContext(round_index=round_index, answers=list(answers) if answers else None,
                        image_url_prefix=annotate.image_url_prefix,
                        export_relpath=_document_relpath(out_dir, annotate, artifacts),
                        model_version="consensus")
    out_dir.mkdir(parents=True, exist_ok=True)
    outputs: dict[str, str] = {}
    for name in dict.fromkeys(annotate.formats):
        outputs |= {rel: rel for rel in EXPORTERS[name](ctx).write(items, out_dir)}
    atomic_write_jsonl(out_dir / REDUNDANCY_TABLE, [dict(r) for r in rows])
    outputs[REDUNDANCY_TABLE] = REDUNDANCY_TABLE
    log.info("redundancy queue: %d samples below the consensus threshold sent to another annotator → %s",
             len(items), out_dir)
    return write_manifest(out_dir, stage="redundancy", stage_version=REDUNDANCY_VERSION, inputs=inputs,
                          config=config, outputs=outputs, info={"round": round_index, "count": len(items)})


def queue_redundancy(artifacts: str | os.PathLike[str], annotate: AnnotateConfig, *, answers: Sequence[str] | None,
                     dataset: Any, round_folder: str | os.PathLike[str], round_index: int,
                     cap: int | None = None) -> dict[str, Any]:
    """The round's redundancy queue from the current consensus.json, at most `cap` tasks (what rounds.label_budget
    leaves: pipeline.round.stop.redundancy_cap), as round.json records it: {"consensus_dir", "consensus_requeued"}, with
    "consensus_trimmed" ({"count", "reason"}) when the budget held samples back; {} when annotate.redundancy is off
    or no sample is unsure. `dataset`: the prepared pool the round already holds (its samples are the eligible ones
    and the tasks' pictures); `round_folder`: the round's folder, the queue goes to its consensus/."""
    from pipeline.annotation.consensus import read_consensus

    if annotate.redundancy is None:
        return {}
    rows = redundancy_candidates(read_consensus(artifacts), annotate.redundancy,
                                 queued=redundancy_queued(artifacts, round_index),
                                 eligible=set(column(dataset, "sample_id")))
    rows, trimmed = budget_trim(rows, cap)
    if trimmed:
        log.warning("redundancy queue: %s", trimmed["reason"])
    out = Path(round_folder) / REDUNDANCY_DIR
    m = export_redundancy(rows, dataset, out, annotate=annotate, answers=answers, artifacts=artifacts,
                          round_index=round_index)
    sent = {} if m is None else {"consensus_dir": str(out), "consensus_requeued": int(m.info["count"])}
    return sent | ({"consensus_trimmed": trimmed} if trimmed else {})


def settle_votes(artifacts: str | os.PathLike[str], annotate: AnnotateConfig, *, answers: Sequence[str] | None,
                 round_index: int) -> dict[str, Any]:
    """After the imports, before the round plans its labeled set: the consensus of every raw vote (it may change
    labels), with the samples sent out for another vote decided again over all theirs. {"consensus": the round's
    record} when some sample has two votes, else {} (round.json stays as it was)."""
    from pipeline.annotation.consensus import apply_consensus, round_record

    rec = round_record(apply_consensus(artifacts, annotate, answers=answers, round_index=round_index,
                                       requeued=requeued_ids(artifacts)))
    return {"consensus": rec} if rec else {}
