"""One round's label check: out-of-sample probabilities, the kNN space, the verdict and the report."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import LabelCheckConfig
from pipeline.labelcheck.base import CheckScoring, CheckSpec
from pipeline.labelcheck.knn import KnnSpace, detect_label_issues
from pipeline.labelcheck.open_answers import check_open_labels
from pipeline.labelcheck.out_of_sample import OOSResult, _answers, out_of_sample_probs
from pipeline.labelcheck.report import annotator_agreement, issue_files, label_issue_table, write_label_report
from pipeline.store import Manifest

log = logging.getLogger(__name__)


def knn_space(labeled_rows: Sequence[Mapping[str, Any]], oos: OOSResult,
              selection: tuple[Sequence[str], np.ndarray] | None, *, scoring: CheckScoring,
              labelcheck: LabelCheckConfig) -> tuple[KnnSpace | None, str | None]:
    """The kNN signal's space and, when there is none, why. `selection`: the selection-embeddings stage's (IDs,
    vectors) when select.embeddings is not `model`; every labeled sample is a neighbour there. With `model`, the
    label check's own scoring embeddings of the checked samples, neighbours within each fold's adapter."""
    from pipeline.embeddings import lookup

    source = scoring.embeddings.source
    if labelcheck.knn_k == 0:
        return None, "labelcheck.knn_k is 0"
    if source != "model":
        if selection is None:
            return None, f"select.embeddings is {source!r} but its embeddings were not passed to the check"
        rows = sorted(labeled_rows, key=lambda r: r["sample_id"])
        ids = [r["sample_id"] for r in rows]
        return KnnSpace(ids, lookup(selection[0], selection[1], ids), [r["answer"] for r in rows],
                        source=f"the select.embeddings space ({source})"), None
    if oos.embeddings is None or len(oos.embeddings) != len(oos.sample_ids) or not len(oos.sample_ids):
        return None, "select.embeddings is 'model' and the check's scoring produced no embeddings"
    given = {r["sample_id"]: r["answer"] for r in labeled_rows}
    return KnnSpace(list(oos.sample_ids), oos.embeddings, [given[s] for s in oos.sample_ids], groups=oos.folds,
                    source="the scoring model's embeddings (select.embeddings is model)"), None


HOG_SIDE = 32  # images are squared to this side (grey) before their gradient histograms


def hog_features(images: Sequence[Any]) -> np.ndarray:
    """Histograms of oriented gradients (9 orientations, 8-px cells, 2×2-cell blocks) of each uint8 RGB image squared
    to HOG_SIDE px, centred on their mean: a model-free space where shapes (letters, digits, signs) a few pixels apart
    stay neighbours. Raw pixels do not: measured on generated letter tiles (benchmarks/label_check_knn.py), 5-NN
    leave-one-out accuracy at 160 labels was 0.41 on pixels and 0.86 on these. [n, 324]."""
    from skimage.feature import hog

    from pipeline.embedders import square_resize

    grey = [square_resize(np.asarray(im), HOG_SIDE).astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32)
            / 255.0 for im in images]
    x = np.stack([hog(g, orientations=9, pixels_per_cell=(8, 8), cells_per_block=(2, 2)) for g in grey])
    return (x - x.mean(0)).astype(np.float32)


def neighbour_space(labeled_rows: Sequence[Mapping[str, Any]], knn: KnnSpace | None, *, scoring: CheckScoring,
                    labelcheck: LabelCheckConfig) -> KnnSpace | None:
    """The space the neighbours judge in while the model is too weak to (detect_label_issues, step 6): one that does
    not come from the model being checked. The selection embeddings when select.embeddings is not `model` (the kNN
    signal's own space); with `model`, the labeled images' gradient histograms (hog_features: cheap, no pool read,
    nothing fitted). None with labelcheck.knn_k 0 or fewer than 3 labels."""
    if labelcheck.knn_k == 0:
        return None
    if scoring.embeddings.source != "model":
        return knn
    import io

    from PIL import Image

    rows = sorted(labeled_rows, key=lambda r: r["sample_id"])
    if len(rows) < 3:
        return None
    images = [np.asarray(Image.open(io.BytesIO(r["prepared"])).convert("RGB")) for r in rows]
    return KnnSpace([r["sample_id"] for r in rows], hog_features(images), [r["answer"] for r in rows],
                    source="the labeled images' gradient histograms (HOG)")


def check_labels(
    labeled_rows: Sequence[Mapping[str, Any]],
    out_dir: str | os.PathLike[str],
    ledger: Any,
    spec: CheckSpec,
    *,
    oos_dir: str | os.PathLike[str] | None = None,
    selection_embeddings: tuple[Sequence[str], np.ndarray] | None = None,
) -> Manifest:
    """One round's label check: out-of-sample probabilities (labelcheck.method; fold adapters and scores under
    `oos_dir`, default out_dir/oos), detect_label_issues with the kNN signal (knn_space), the issues with who gave
    each label, annotator agreement, written by write_label_report to out_dir. `spec.held_out` is for the heldout
    method (see out_of_sample_probs). Box labels (`spec.box_labels`) go to check_box_labels, open answers
    (`spec.answers` None) to check_open_labels."""
    if spec.box_labels:
        from pipeline.labelcheck.boxes import check_box_labels

        return check_box_labels(labeled_rows, out_dir, ledger, spec, oos_dir=oos_dir)
    if not spec.answers:
        return check_open_labels(labeled_rows, out_dir, ledger, spec, oos_dir=oos_dir)
    answers, labelcheck = _answers(spec.answers), spec.labelcheck
    oos = out_of_sample_probs(labeled_rows, Path(oos_dir) if oos_dir else Path(out_dir) / "oos", spec)
    given = {r["sample_id"]: r["answer"] for r in labeled_rows}
    space, note = knn_space(labeled_rows, oos, selection_embeddings, scoring=spec.scoring, labelcheck=labelcheck)
    det = detect_label_issues(oos.probs, [given[s] for s in oos.sample_ids], answers, sample_ids=oos.sample_ids,
                              knn=space, knn_note=note, min_oos_accuracy=labelcheck.min_oos_accuracy,
                              knn_k=labelcheck.knn_k,
                              neighbours=neighbour_space(labeled_rows, space, scoring=spec.scoring,
                                                         labelcheck=labelcheck))
    table = label_issue_table(det.issues, ledger, files=issue_files(labeled_rows))
    agreement = annotator_agreement(ledger, oos.suggestions(answers))
    log.info("%s (%s)", det.summary(), oos.method)
    return write_label_report(out_dir, oos=oos, table=table, agreement=agreement, answers=answers,
                              verdict=det.info())
