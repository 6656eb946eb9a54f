"""Label checks of open answers (data.answers: null): out-of-sample answers of models that did not train on the
labels, compared with the labels after SQuAD normalisation."""

from __future__ import annotations

import gc
import logging
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.labelcheck.base import LABELCHECK_VERSION, CheckSpec, LabelCheckError
from pipeline.labelcheck.detection import MIN_MODEL_ACCURACY, REPORT_CONFIDENCE, Detection, Issue
from pipeline.labelcheck.out_of_sample import (
    OOSResult,
    _check_labeled,
    _score_config,
    held_out_of,
    stratified_folds,
    train_fold,
)
from pipeline.labelcheck.report import annotator_agreement, issue_files, label_issue_table, write_label_report
from pipeline.store import Manifest, digest_path, find_valid_manifest, stage_key

log = logging.getLogger(__name__)


# Columns of an open-answer check's "probabilities" (oos_probs.npz): what the report stores per checked sample.
OPEN_COLUMNS = ("given_support", "model_consistency")


# The model's answers (greedy + MC dropout) must agree this much among themselves before their consensus is held
# against a label: a model that answers differently under dropout has no opinion worth an annotator's time.
OPEN_MIN_CONSISTENCY = 0.75


@dataclass
class OpenOOS:
    """Out-of-sample answers of labeled samples (open answers): the greedy answer and the MC-dropout answers of a
    model that did not train on them."""

    sample_ids: list[str]
    answers: list[str]
    mc_answers: list[list[str]]
    folds: np.ndarray
    method: str
    info: dict[str, Any] = field(default_factory=dict)

    def model_answers(self, i: int) -> list[str]:
        return [self.answers[i], *self.mc_answers[i]]


def _score_open(spec: CheckSpec, adapter_dir: Path, rows: list[dict[str, Any]], out_dir: Path,
                inputs: dict[str, str], config: dict[str, Any]) -> None:
    from pipeline.model.loading import load_model
    from pipeline.scoring import OpenAnswerScorer, save_scores

    loaded = load_model(spec.model, adapter=adapter_dir, hw=spec.hw)
    try:
        result = OpenAnswerScorer(loaded, max_new_tokens=spec.model.max_new_tokens, min_new_tokens=1).score(
            rows, batch_size=spec.scoring.score_batch_size, mc_passes=spec.scoring.mc_dropout_passes, seed=spec.seed)
    finally:
        del loaded
        gc.collect()
    save_scores(result, out_dir, version=LABELCHECK_VERSION, inputs=inputs, config=config)


def out_of_sample_answers(
    labeled_rows: Sequence[Mapping[str, Any]],
    work_dir: str | os.PathLike[str],
    spec: CheckSpec,
    *,
    method: str | None = None,
    progress: bool = False,
) -> OpenOOS:
    """out_of_sample_probs for open answers: the greedy and `select.mc_dropout_passes` MC-dropout answers of models
    that never saw the rows (heldout: `spec.held_out`'s adapter on the rows it did not train on; kfold: fold adapters, folds
    stratified by the normalised answer), cached the same way."""
    from pipeline.meaning import normalize_answer
    from pipeline.model.train import check_rows
    from pipeline.scoring import load_scores

    method = method or spec.labelcheck.method
    rows = _check_labeled(labeled_rows, None)
    config = {**_score_config(spec, []), "answers": None,
              "max_new_tokens": spec.model.max_new_tokens, "mc_dropout_passes": spec.scoring.mc_dropout_passes}
    parts: list[tuple[list[int], Path, dict[str, str], Path | None, list[dict[str, Any]]]] = []
    if method == "heldout":
        adapter, skip = held_out_of(spec).adapter, held_out_of(spec).trained_ids
        idx = [j for j, r in enumerate(rows) if r["sample_id"] not in skip]
        info: dict[str, Any] = {"adapter": str(adapter), "scored": len(idx), "skipped_trained_on": len(rows) - len(idx)}
        folds = np.full(len(idx), -1, np.int64)
        if idx:
            held = [rows[j] for j in idx]
            parts.append((idx, Path(work_dir) / "heldout", {"rows": check_rows(held), "adapter": digest_path(adapter)},
                          Path(adapter), []))
    elif method == "kfold":
        k = spec.labelcheck.kfold
        if k < 2 or len(rows) < k:
            raise LabelCheckError(f"k-fold label check: {len(rows)} labeled samples cannot make {k} folds; label at "
                                  f"least {k} samples or lower labelcheck.kfold (≥ 2)")
        all_folds = stratified_folds([normalize_answer(r["answer"]) for r in rows], k, spec.seed)
        digest = check_rows(rows)
        for i in range(k):
            parts.append(([int(j) for j in np.flatnonzero(all_folds == i)], Path(work_dir) / f"fold-{i}" / "oos",
                          {"labeled": digest, "fold": f"{i}/{k}"}, None,
                          [rows[j] for j in np.flatnonzero(all_folds != i)]))
        idx = list(range(len(rows)))
        folds = all_folds
        info = {"k": k, "labeled_digest": digest}
    else:
        raise LabelCheckError(f"labelcheck.method {method!r} is not one of kfold, heldout")
    by_id: dict[str, tuple[str, list[str]]] = {}
    for held_idx, out, inputs, adapter_dir, train_rows in parts:
        if find_valid_manifest(out, stage_key("score", LABELCHECK_VERSION, inputs, config)) is None:
            if adapter_dir is None:
                adapter_dir = train_fold(spec, train_rows, out.parent, progress=progress).adapter_dir
            _score_open(spec, adapter_dir, [rows[j] for j in held_idx], out, inputs, config)
        res = load_scores(out)
        mc = res.mc_answers or [[] for _ in res.sample_ids]
        by_id.update({s: (a, m) for s, a, m in zip(res.sample_ids, res.answers or [], mc, strict=True)})
    ids = [rows[j]["sample_id"] for j in idx]
    return OpenOOS(ids, [by_id[s][0] for s in ids], [by_id[s][1] for s in ids], folds, method, info)


def detect_open_label_issues(
    model_answers: Sequence[Sequence[str]],
    given_labels: Sequence[str],
    *,
    sample_ids: Sequence[str],
    min_oos_accuracy: float = 0.75,
    min_consistency: float = OPEN_MIN_CONSISTENCY,
) -> tuple[Detection, np.ndarray]:
    """Label errors among typed answers, from an out-of-sample model's answers to the same questions (its greedy
    answer first, then its MC-dropout answers), all compared after SQuAD normalisation.

    - support: the share of the model's answers equal to the given label; consistency: the share of the model's
      answers equal to their most common one (the suggestion);
    - abstain rule, as for closed sets: the model's greedy answers must agree with the given labels (token F1, the
      open-answer accuracy) at least `min_oos_accuracy`, else it is too weak to tell its mistakes from wrong labels;
    - a label is an issue when the model's answers agree among themselves (consistency ≥ `min_consistency`) on an
      answer other than the given one; its confidence P(wrong) is the model's precision when it is that consistent,
      measured on the checked labels themselves (the share of consistent cases whose consensus equals the label,
      which label noise can only lower), capped by the consistency.
    Returns (the Detection, the [n, 2] OPEN_COLUMNS array)."""
    from pipeline.answer_metrics import token_f1
    from pipeline.meaning import normalize_answer

    n = len(given_labels)
    if len(model_answers) != n or len(sample_ids) != n:
        raise LabelCheckError(f"open label check: {len(model_answers)} model answers and {len(sample_ids)} IDs for "
                              f"{n} labels")
    cols = np.zeros((n, 2), dtype=np.float32)
    if n == 0:
        return Detection([], 0, {}, None, None, 0.0, "no labels to check", min_oos_accuracy), cols
    given = [normalize_answer(g) for g in given_labels]
    suggested: list[str] = []
    for i, answers in enumerate(model_answers):
        norm = [normalize_answer(a) for a in answers]
        counts = Counter(norm)
        top = max(counts.items(), key=lambda kv: (kv[1], kv[0] == norm[0]))[0]  # ties: the greedy answer
        suggested.append(next(a for a, z in zip(answers, norm, strict=True) if z == top))
        cols[i] = (counts[given[i]] / len(norm), counts[top] / len(norm))
    f1 = token_f1([a[0] for a in model_answers], list(given_labels))
    consistent = cols[:, 1] >= min_consistency
    precision = float((cols[consistent, 0] >= cols[consistent, 1]).mean()) if consistent.any() else 0.0
    signals: dict[str, dict[str, Any]] = {"model": {
        "used": True, "accuracy": f1, "estimated_accuracy": f1, "temperature": 1.0,
        "consistent_share": float(consistent.mean()), "consistent_precision": precision,
        "answers_per_sample": len(model_answers[0])}}
    signals["knn"] = {"used": False, "note": "open answers: no kNN label consistency (answers are not classes)"}
    if f1 < min_oos_accuracy or f1 < MIN_MODEL_ACCURACY:
        signals["model"]["used"] = False
        why = (f"model not yet accurate enough to judge labels (OOS accuracy {f1:.2f}, token F1 of its answers "
               f"against the labels; the check needs labelcheck.min_oos_accuracy {min_oos_accuracy:.2f})")
        return Detection([], n, signals, f1, None, 0.0, why, min_oos_accuracy), cols
    wrong = consistent & (cols[:, 0] < cols[:, 1]) & np.array([s_ != g for s_, g in
                                                                zip(map(normalize_answer, suggested), given,
                                                                    strict=True)])
    confidence = np.minimum(cols[:, 1], precision)
    order = sorted(np.flatnonzero(wrong), key=lambda i: (-confidence[i], cols[i, 0], sample_ids[i]))
    issues = [Issue(int(i), sample_ids[i], given_labels[i], suggested[i], float(cols[i, 0]), float(cols[i, 1]),
                    float(cols[i, 0] - cols[i, 1]), min_consistency, float(confidence[i]), ("model",))
              for i in order if confidence[i] >= REPORT_CONFIDENCE]
    ranking = sorted(range(n), key=lambda i: (not wrong[i], -confidence[i], cols[i, 0], sample_ids[i]))
    return Detection(issues, n, signals, f1, float(wrong.mean()), float(sum(1.0 - i.confidence for i in issues)),
                     None, min_oos_accuracy, [sample_ids[i] for i in ranking], f1), cols


def check_open_labels(
    labeled_rows: Sequence[Mapping[str, Any]],
    out_dir: str | os.PathLike[str],
    ledger: Any,
    spec: CheckSpec,
    *,
    oos_dir: str | os.PathLike[str] | None = None,
) -> Manifest:
    """check_labels for open answers (data.answers: null): out_of_sample_answers → detect_open_label_issues → the
    same report files (oos_probs.npz holds the OPEN_COLUMNS), issue table, annotator agreement and relabel queue."""
    from pipeline.meaning import normalize_answer

    oos = out_of_sample_answers(labeled_rows, Path(oos_dir) if oos_dir else Path(out_dir) / "oos", spec)
    given = {r["sample_id"]: r["answer"] for r in labeled_rows}
    det, cols = detect_open_label_issues([oos.model_answers(i) for i in range(len(oos.sample_ids))],
                                         [given[s] for s in oos.sample_ids], sample_ids=oos.sample_ids,
                                         min_oos_accuracy=spec.labelcheck.min_oos_accuracy)
    table = label_issue_table(det.issues, ledger, files=issue_files(labeled_rows))
    at = {s: i for i, s in enumerate(oos.sample_ids)}
    for row in table:
        row["model_answers"] = oos.model_answers(at[row["sample_id"]])
    # Agreement with the model after normalisation: "Seven." typed for the model's "seven" agrees.
    suggestions = {s: given[s] if normalize_answer(a) == normalize_answer(given[s]) else a
                   for s, a in zip(oos.sample_ids, oos.answers, strict=True)}
    agreement = annotator_agreement(ledger, suggestions)
    log.info("%s (%s, open answers)", det.summary(), oos.method)
    probs = OOSResult(oos.sample_ids, cols, oos.folds, oos.method, oos.info)
    return write_label_report(out_dir, oos=probs, table=table, agreement=agreement, answers=list(OPEN_COLUMNS),
                              verdict=det.info())
