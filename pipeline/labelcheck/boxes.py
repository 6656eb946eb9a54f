"""Label checks of box labels (data.task: boxes): out-of-sample box answers of models that did not train on the
labels (heldout: the previous round's adapter on the labels it did not see; kfold: fold adapters), read into each
image's pixels by the family's codec, compared with the labeled boxes by pipeline/boxes/labelcheck.py's
check_boxes (missing, swapped, badly placed boxes).

An image with issues is one likely label error (the re-label queue sends images back, not boxes): its confidence is
its most sure issue's score (check_boxes' scores are in [0, 1]: the prediction's score, × IoU or × (1 − IoU)), the
model's boxes are the suggestion, and the table row lists each issue's sentence. As for every label check, a model
too weak to judge abstains: its mean box agreement with the labels (matching.agreement: Hungarian-matched IoU ×
same class) must reach labelcheck.min_oos_accuracy, else its disagreement says more about it than the labels."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.labelcheck.base import CheckSpec
from pipeline.labelcheck.detection import MIN_MODEL_ACCURACY, Detection, Issue
from pipeline.labelcheck.out_of_sample import OOSResult
from pipeline.labelcheck.report import annotator_agreement, issue_files, label_issue_table, write_label_report
from pipeline.store import Manifest

log = logging.getLogger(__name__)

# Columns of a box check's "probabilities" (oos_probs.npz): per checked image, its box agreement with the model and
# its most sure issue's score.
BOX_COLUMNS = ("box_agreement", "issue_score")


def detect_box_label_issues(labels: Mapping[str, Sequence[Any]], predicted: Mapping[str, Sequence[Any]], *,
                            texts: Mapping[str, str], given: Mapping[str, str], sample_ids: Sequence[str],
                            min_oos_accuracy: float) -> tuple[Detection, np.ndarray, dict[str, list[str]]]:
    """(the Detection, the [n, 2] BOX_COLUMNS array, sample_id → its issues' sentences) from each image's labeled and
    out-of-sample predicted boxes; `texts`: the model's answers (the suggestion), `given`: the label texts."""
    from pipeline.boxes.labelcheck import check_boxes
    from pipeline.boxes.matching import agreement

    n = len(sample_ids)
    cols = np.zeros((n, len(BOX_COLUMNS)), dtype=np.float32)
    for i, s in enumerate(sample_ids):
        cols[i, 0] = agreement(labels[s], predicted.get(s, []))
    accuracy = float(cols[:, 0].mean()) if n else 0.0
    signals: dict[str, dict[str, Any]] = {
        "model": {"used": True, "accuracy": accuracy, "estimated_accuracy": accuracy, "temperature": 1.0},
        "knn": {"used": False, "note": "box labels: no kNN label consistency (a label is several boxes)"}}
    if n == 0 or accuracy < min_oos_accuracy or accuracy < MIN_MODEL_ACCURACY:
        signals["model"]["used"] = False
        why = ("no labels to check" if n == 0 else
               f"model not yet accurate enough to judge labels (OOS accuracy {accuracy:.2f}, its mean box agreement "
               f"with the labels; the check needs labelcheck.min_oos_accuracy {min_oos_accuracy:.2f})")
        return Detection([], n, signals, accuracy, None, 0.0, why, min_oos_accuracy), cols, {}
    reasons: dict[str, list[str]] = {}
    at = {s: i for i, s in enumerate(sample_ids)}
    for issue in check_boxes({s: labels[s] for s in sample_ids}, predicted):
        reasons.setdefault(issue.image, []).append(issue.reason)
        cols[at[issue.image], 1] = max(cols[at[issue.image], 1], issue.score)
    order = sorted(reasons, key=lambda s: (-cols[at[s], 1], s))
    issues = [Issue(at[s], s, given[s], texts.get(s) or "[]", float(cols[at[s], 0]), 1.0, float(cols[at[s], 1]),
                    0.5, float(cols[at[s], 1]), ("model",)) for s in order]
    ranking = order + sorted(set(sample_ids) - set(order))
    return (Detection(issues, n, signals, accuracy, len(issues) / n, float(sum(1 - i.confidence for i in issues)),
                      None, min_oos_accuracy, ranking, accuracy), cols, reasons)


def check_box_labels(labeled_rows: Sequence[Mapping[str, Any]], out_dir: str | os.PathLike[str], ledger: Any,
                     spec: CheckSpec, *, oos_dir: str | os.PathLike[str] | None = None) -> Manifest:
    """check_labels for box labels: out_of_sample_answers (the open-answer generation: a box answer is text) → the
    family codec's boxes through each row's geometry → detect_box_label_issues → the same report files (issue
    table with each issue's sentence, annotator agreement, verdict) the relabel queue and the round report read."""
    from pipeline.boxes.answer import parse_box_label
    from pipeline.boxes.rows import predicted_boxes
    from pipeline.labelcheck.open_answers import out_of_sample_answers
    from pipeline.model.box_frames import training_codec

    oos = out_of_sample_answers(labeled_rows, Path(oos_dir) if oos_dir else Path(out_dir) / "oos", spec)
    rows = {r["sample_id"]: r for r in labeled_rows}
    codec, frame = training_codec(spec.model)
    checked = [rows[s] for s in oos.sample_ids]
    predicted, dropped = predicted_boxes(oos.answers, checked, codec, frame) if checked else ({}, 0)
    given = {s: rows[s]["answer"] for s in oos.sample_ids}
    labels = {s: parse_box_label(given[s], where=f"sample {s}'s label") for s in oos.sample_ids}
    texts = dict(zip(oos.sample_ids, oos.answers, strict=True))
    det, cols, reasons = detect_box_label_issues(labels, predicted, texts=texts, given=given,
                                                 sample_ids=oos.sample_ids,
                                                 min_oos_accuracy=spec.labelcheck.min_oos_accuracy)
    table = label_issue_table(det.issues, ledger, files=issue_files(labeled_rows))
    for row in table:
        row["box_issues"] = reasons.get(row["sample_id"], [])
    agreement = annotator_agreement(ledger, {})  # a box answer never equals a label as text: no model column
    log.info("%s (%s, boxes; %d unreadable pieces of the model's answers dropped)", det.summary(), oos.method, dropped)
    probs = OOSResult(oos.sample_ids, cols, oos.folds, oos.method, {**oos.info, "dropped": dropped})
    return write_label_report(out_dir, oos=probs, table=table, agreement=agreement, answers=list(BOX_COLUMNS),
                              verdict=det.info())


def export_box_relabel(issues: Sequence[Issue], dataset: Any, out_dir: str | os.PathLike[str], *, annotate: Any,
                       box_labels: Sequence[str], artifacts: str | os.PathLike[str], round_index: int
                       ) -> Manifest | None:
    """A box project's re-label queue in rounds/NNN/relabel/: the box batch folder (pipeline/boxes/batch.py: Label
    Studio RectangleLabels tasks, COCO, YOLO, images under their original names), each task pre-annotated with the
    image's labeled boxes as they stand (the annotator corrects them), plus relabel.jsonl. None when nothing is
    queued. A corrected label comes back as any box label file does (by sample_id or original file name)."""
    from dataclasses import replace

    from pipeline.annotation.box_export import batch_images
    from pipeline.annotation.export import _document_relpath
    from pipeline.boxes.answer import parse_box_label
    from pipeline.boxes.batch import IMAGES_DIR, export_box_batch
    from pipeline.labelcheck.base import LABELCHECK_VERSION
    from pipeline.labelcheck.relabel import RELABEL_TABLE
    from pipeline.store import atomic_write_jsonl, digest_json, find_valid_manifest, stage_key, write_manifest

    if not issues:
        log.info("relabel queue for round %d: no likely label errors", round_index)
        return None
    out = Path(out_dir)
    inputs = {"issues": digest_json([iss.to_dict() for iss in issues])}
    config = {"annotate": annotate.model_dump(mode="json"), "box_labels": list(box_labels)}
    if (m := find_valid_manifest(out, stage_key("relabel", LABELCHECK_VERSION, inputs, config))) is not None:
        return m  # already exported: annotators may be working on these files
    rows = [{"sample_id": iss.sample_id, "rank": r} for r, iss in enumerate(issues)]
    given = {iss.sample_id: iss.given_label for iss in issues}
    images = [replace(im, predicted=tuple(parse_box_label(given[im.sample_id])), confidence=None)
              for im in batch_images(rows, dataset, None)]
    url = f"{annotate.image_url_prefix}{_document_relpath(out, annotate, Path(artifacts))}/{IMAGES_DIR}/"
    out.mkdir(parents=True, exist_ok=True)
    written = export_box_batch(out, images, box_labels, image_url=lambda name: url + name,
                               model_version="labelcheck", round_index=round_index)
    atomic_write_jsonl(out / RELABEL_TABLE, [iss.to_dict() for iss in issues])
    log.info("relabel queue: %d images with likely box label errors of round %d exported to %s", len(images),
             round_index, out)
    return write_manifest(out, stage="relabel", stage_version=LABELCHECK_VERSION, inputs=inputs, config=config,
                          outputs={p: p for p in [*written, RELABEL_TABLE]},
                          info={"round": round_index, "count": len(images)})
