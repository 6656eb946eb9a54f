"""The relabel queue: the likely errors sent back to annotators as a separate task set, and what earlier rounds
already sent."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.annotation.export import (
    EXPORTERS,
    ExportContext,
    ExportItem,
    LabelStudioExporter,
    _document_relpath,
    build_items,
)
from pipeline.annotation.redundancy import redundancy_spent
from pipeline.config import AnnotateConfig
from pipeline.errors import ArtifactError
from pipeline.labelcheck.base import LABELCHECK_VERSION
from pipeline.labelcheck.detection import Issue
from pipeline.round_state import round_dir
from pipeline.store import (
    Manifest,
    atomic_write_jsonl,
    digest_json,
    find_valid_manifest,
    read_jsonl,
    read_manifest,
    stage_key,
    write_manifest,
)

log = logging.getLogger(__name__)


RELABEL_TABLE = "relabel.jsonl"


def relabel_dir(artifacts: str | os.PathLike[str], round_index: int) -> Path:
    return round_dir(artifacts, round_index, "relabel")


def relabel_queued(artifacts: str | os.PathLike[str], before_round: int) -> dict[int, list[str]]:
    """Round → the sample IDs its relabel queue sent back to annotators, for rounds before `before_round`."""
    out = {}
    for d in sorted(Path(artifacts).glob("rounds/[0-9][0-9][0-9]/relabel")):
        r = int(d.parent.name)
        if r >= before_round:
            continue
        try:
            read_manifest(d)
        except ArtifactError:
            continue  # a queue whose write never finished was never handed out
        out[r] = [row["sample_id"] for row in read_jsonl(d / RELABEL_TABLE)]
    return out


def labels_spent(n_labeled: int, artifacts: str | os.PathLike[str], before_round: int) -> int:
    """Labels paid for before round `before_round`: the labeled samples plus every re-label task sent back (a
    re-label costs an annotator's time whether it changes the label or confirms it), and every task the consensus's
    redundancy queue sent to another annotator; rounds.label_budget counts this."""
    return (n_labeled + sum(len(ids) for ids in relabel_queued(artifacts, before_round).values())
            + redundancy_spent(artifacts, before_round))


def issues_from_report(report_dir: str | os.PathLike[str]) -> list[Issue]:
    """The Issue list behind a report's issues.jsonl (the relabel export needs the probabilities, not just the table).
    Reports written before confidences existed read as confidence 1 (they were queued by rank alone)."""
    out = []
    for row in read_jsonl(Path(report_dir) / "issues.jsonl"):
        out.append(Issue(row["rank"] - 1, row["sample_id"], row["given_label"], row["suggested_label"],
                         row["given_prob"], row["suggested_prob"], row["score"], row["threshold"],
                         row.get("confidence", 1.0), tuple(row.get("signals", ("model",)))))
    return out


def relabel_candidates(issues: Sequence[Issue], *, min_confidence: float, top_n: int,
                       skip: Iterable[str] = ()) -> list[Issue]:
    """The re-label queue: issues at least `min_confidence` likely wrong, not queued before, at most `top_n` — an
    annotator's time goes to the clear cases, and a list that is mostly noise sends nothing."""
    done = set(skip)
    return [i for i in issues if i.sample_id not in done and i.confidence >= min_confidence][:top_n]


class RelabelLabelStudioExporter(LabelStudioExporter):
    """Two pre-annotations per task: the label the sample has now and the model's suggestion; the annotator picks."""

    def __init__(self, ctx: ExportContext, current: Mapping[str, tuple[str, float]]):
        super().__init__(ctx)
        self.current = current

    def _prediction(self, item: ExportItem) -> list[dict[str, Any]]:
        label, prob = self.current[item.sample_id]
        now = super()._prediction(dataclasses.replace(item, prediction=label, confidence=prob))
        suggested = super()._prediction(item)
        for preds, version in ((now, "current-label"), (suggested, "suggested-label")):
            for p in preds:
                p["model_version"] = version
        return now + suggested


def export_relabel(
    issues: Sequence[Issue],
    dataset: Any,
    out_dir: str | os.PathLike[str],
    *,
    annotate: AnnotateConfig,
    answers: Sequence[str] | None,
    artifacts: str | os.PathLike[str],
    round_index: int,
) -> Manifest | None:
    """Write the issues as a separate annotation task set (rounds/NNN/relabel/): Label Studio tasks with the
    current label and the suggestion as pre-annotations, plus the other configured formats and relabel.jsonl.
    Their import appends correction entries (labels.py); None when there is nothing to relabel. Reads the annotate
    section, data.answers (`answers`) and the artifacts folder (image paths are relative to the document root)."""
    if not issues:
        log.info("relabel queue for round %d: no likely label errors", round_index)
        return None
    out_dir = Path(out_dir)
    inputs = {"issues": digest_json([iss.to_dict() for iss in issues])}
    config = {"annotate": annotate.model_dump(mode="json"), "answers": answers}
    if (m := find_valid_manifest(out_dir, stage_key("relabel", LABELCHECK_VERSION, inputs, config))) is not None:
        return m  # already exported: annotators may be working on these files
    sel = [{"sample_id": iss.sample_id, "rank": r, "score": iss.margin, "prediction": iss.suggested_label,
            "confidence": iss.suggested_prob,
            "scores": {"margin": iss.margin, "given_prob": iss.given_prob, "suggested_prob": iss.suggested_prob}}
           for r, iss in enumerate(issues)]
    items = build_items(sel, dataset, image_source=annotate.export_images)
    ctx = ExportContext(round_index=round_index, answers=answers, image_url_prefix=annotate.image_url_prefix,
                        export_relpath=_document_relpath(out_dir, annotate, artifacts), model_version="labelcheck")
    current = {iss.sample_id: (iss.given_label, iss.given_prob) for iss in issues}
    out_dir.mkdir(parents=True, exist_ok=True)
    outputs: dict[str, str] = {}
    for name in dict.fromkeys(annotate.formats):
        exporter = RelabelLabelStudioExporter(ctx, current) if name == "label_studio" else EXPORTERS[name](ctx)
        outputs |= {rel: rel for rel in exporter.write(items, out_dir)}
    atomic_write_jsonl(out_dir / RELABEL_TABLE, [iss.to_dict() for iss in issues])
    outputs[RELABEL_TABLE] = RELABEL_TABLE
    log.info("relabel queue: %d likely label errors of round %d exported to %s", len(items), round_index, out_dir)
    return write_manifest(
        out_dir, stage="relabel", stage_version=LABELCHECK_VERSION, inputs=inputs, config=config, outputs=outputs,
        info={"round": round_index, "count": len(items)},
    )
