"""Out-of-sample probabilities: class probabilities of labeled samples from models that did not train on them
(k-fold adapters, or the round's adapter on the labels added since it was trained)."""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import LabelCheckConfig, TrainConfig
from pipeline.labelcheck.base import LABELCHECK_VERSION, CheckSpec, HeldOut, LabelCheckError
from pipeline.store import digest_path, find_valid_manifest, stage_key

log = logging.getLogger(__name__)


@dataclass
class OOSResult:
    """Class probabilities of labeled samples from models that did not train on them (rows of `sample_ids`)."""

    sample_ids: list[str]
    probs: np.ndarray  # [n, c] over data.answers
    folds: np.ndarray  # [n] fold each sample was held out in; -1 for the heldout method
    method: str  # "kfold" or "heldout"
    info: dict[str, Any] = field(default_factory=dict)
    # [n, d] pooled embeddings from the scoring pass (each fold's from its own adapter); None when not scored here.
    embeddings: np.ndarray | None = None

    def suggestions(self, answers: Sequence[str]) -> dict[str, str]:
        """sample_id → the out-of-sample model's answer."""
        return {sid: answers[int(j)] for sid, j in zip(self.sample_ids, self.probs.argmax(1), strict=True)}


def stratified_folds(labels: Sequence[str], k: int, seed: int) -> np.ndarray:
    """Fold index per sample: each class shuffled (seeded) and dealt round-robin, continuing where the previous
    class stopped, so every fold gets about n/k samples and each class's share."""
    labels = list(labels)
    folds = np.empty(len(labels), dtype=np.int64)
    rng = np.random.default_rng(seed)
    arr = np.asarray(labels, dtype=object)
    nxt = 0
    for c in sorted(set(labels)):
        idx = rng.permutation(np.flatnonzero(arr == c))
        folds[idx] = (nxt + np.arange(len(idx))) % k
        nxt = (nxt + len(idx)) % k
    return folds


def _answers(answers: Sequence[str] | None) -> list[str]:
    if not answers:
        raise LabelCheckError("label checks need a closed answer set: set data.answers (open answers have no class "
                              "probabilities to compare)")
    return list(answers)


def _check_labeled(rows: Sequence[Mapping[str, Any]], answers: Sequence[str] | None) -> list[dict[str, Any]]:
    """The rows sorted by sample_id, each with one label in `answers` (any non-empty text when None: open answers)."""
    allowed = set(answers) if answers is not None else None
    seen: set[str] = set()
    out = []
    for i, r in enumerate(rows):
        sid, label = r.get("sample_id"), r.get("answer")
        if not isinstance(sid, str) or not sid:
            raise LabelCheckError(f"labeled row {i}: no sample_id; pass rows from pipeline.selection.labeled_rows")
        if sid in seen:
            raise LabelCheckError(f"labeled row {i}: sample {sid} appears twice; each sample has one current label")
        if allowed is None and (not isinstance(label, str) or not label.strip()):
            raise LabelCheckError(f"labeled row {i} (sample {sid}): label {label!r} is empty; fix the label")
        if allowed is not None and label not in allowed:
            raise LabelCheckError(f"labeled row {i} (sample {sid}): label {label!r} is not in data.answers "
                                  f"[{', '.join(answers or [])}]; fix the label or the answer set")
        if not isinstance(r.get("prepared"), (bytes, bytearray)):
            raise LabelCheckError(f"labeled row {i} (sample {sid}): no 'prepared' image bytes; run the prepare stage")
        seen.add(sid)
        out.append(dict(r))
    return sorted(out, key=lambda r: r["sample_id"])


def fold_config(train: TrainConfig, labelcheck: LabelCheckConfig) -> TrainConfig:
    """The train section fold adapters train with: train.max_steps replaced by labelcheck.max_steps when that is set."""
    if labelcheck.max_steps is None:
        return train
    return train.model_copy(update={"max_steps": labelcheck.max_steps})


def train_fold(spec: CheckSpec, rows: list[dict[str, Any]], out_dir: Path, *, progress: bool) -> Any:
    """train_adapter on a fold's rows with the sections it reads (model, the fold's train section, seed)."""
    from pipeline.model.train import TrainSpec, train_adapter

    return train_adapter(TrainSpec(spec.model, fold_config(spec.train, spec.labelcheck), spec.seed), rows, out_dir,
                         hw=spec.hw, progress=progress)


def _score_config(spec: CheckSpec, answers: list[str]) -> dict[str, Any]:
    return {"model": spec.model.model_dump(mode="json"),
            "train": fold_config(spec.train, spec.labelcheck).model_dump(mode="json"), "seed": spec.seed,
            "answers": answers, "length_normalize": spec.scoring.length_normalize,
            "batch_size": spec.scoring.score_batch_size, "labelcheck_version": LABELCHECK_VERSION}


def _score_held_out(spec: CheckSpec, adapter_dir: Path, rows: list[dict[str, Any]], answers: list[str],
                    out_dir: Path, inputs: dict[str, str], config: dict[str, Any]) -> Any:
    from pipeline.model.loading import load_model
    from pipeline.scoring import ClosedSetScorer, save_scores

    loaded = load_model(spec.model, adapter=adapter_dir, hw=spec.hw)
    try:
        result = ClosedSetScorer(loaded, answers, length_normalize=spec.scoring.length_normalize).score(
            rows, batch_size=spec.scoring.score_batch_size)
    finally:
        del loaded
        gc.collect()
    save_scores(result, out_dir, version=LABELCHECK_VERSION, inputs=inputs, config=config)
    return result


def out_of_sample_probs(
    labeled_rows: Sequence[Mapping[str, Any]],
    work_dir: str | os.PathLike[str],
    spec: CheckSpec,
    *,
    k: int | None = None,
    method: str | None = None,
    progress: bool = False,
) -> OOSResult:
    """Class probabilities for labeled rows ({sample_id, prepared, question, answer}) from models that never saw them.

    Reads spec's model, train, scoring (length_normalize, score_batch_size), labelcheck (method, kfold, max_steps),
    answers, seed, held_out and hw.
    kfold (default `labelcheck.method`): seeded folds stratified by label; fold i's adapter is trained with
    `train_adapter` on the other folds into work_dir/fold-i and scores fold i. The scores are cached in
    work_dir/fold-i/oos, keyed by (labeled-set digest, fold, config): an unchanged labeled set costs nothing, and an
    interrupted run resumes (train_adapter resumes from its checkpoints).
    heldout: `spec.held_out.adapter` (the round's adapter) scores the rows it did not train on (not in its
    `trained_ids`), typically
    the ones labeled since it was trained; a cheap approximation for models too big to train k times.
    """
    method = method or spec.labelcheck.method
    answers = _answers(spec.answers)
    rows = _check_labeled(labeled_rows, answers)
    s = _Scoring(spec, answers, _score_config(spec, answers), Path(work_dir), progress)
    if method == "heldout":
        return _held_out_probs(rows, held_out_of(spec), s)
    if method != "kfold":
        raise LabelCheckError(f"labelcheck.method {method!r} is not one of kfold, heldout")
    k = spec.labelcheck.kfold if k is None else k
    if k < 2 or len(rows) < k:
        raise LabelCheckError(f"k-fold label check: {len(rows)} labeled samples cannot make {k} folds; label at least "
                              f"{k} samples or lower labelcheck.kfold (≥ 2)")
    return _kfold_probs(rows, k, s)


@dataclass(frozen=True)
class _Scoring:
    """What every out-of-sample scoring pass reads: the check's spec, the answer set, the scores' cache config, and
    where it runs."""

    spec: CheckSpec
    answers: list[str]
    config: dict[str, Any]
    work_dir: Path
    progress: bool


def held_out_of(spec: CheckSpec) -> HeldOut:
    """The heldout method's adapter, or the error that says how to give one."""
    if spec.held_out is None:
        raise LabelCheckError("labelcheck.method heldout needs the round's adapter (CheckSpec.held_out); or use kfold")
    return spec.held_out


def _held_out_probs(rows: list[dict[str, Any]], held_out: HeldOut, s: _Scoring) -> OOSResult:
    """The round's adapter scores the rows it did not train on, cached in work_dir/heldout."""
    from pipeline.model.train import check_rows
    from pipeline.scoring import load_scores

    n = len(rows)
    adapter = held_out.adapter
    held = [r for r in rows if r["sample_id"] not in held_out.trained_ids]
    info: dict[str, Any] = {"adapter": str(adapter), "scored": len(held), "skipped_trained_on": n - len(held)}
    if not held:
        log.info("heldout label check: all %d labeled samples were trained on; nothing to check", n)
        return OOSResult([], np.zeros((0, len(s.answers)), np.float32), np.zeros(0, np.int64), "heldout", info,
                         np.zeros((0, 0), np.float32))
    inputs = {"rows": check_rows(held), "adapter": digest_path(adapter)}
    out = s.work_dir / "heldout"
    if find_valid_manifest(out, stage_key("score", LABELCHECK_VERSION, inputs, s.config)) is None:
        _score_held_out(s.spec, Path(adapter), held, s.answers, out, inputs, s.config)
        info["reused"] = False
    else:
        info["reused"] = True
    res = load_scores(out)
    return OOSResult(res.sample_ids, res.probs, np.full(len(held), -1, np.int64), "heldout", info, res.embeddings)


def _kfold_probs(rows: list[dict[str, Any]], k: int, s: _Scoring) -> OOSResult:
    """Fold i's adapter, trained on the other folds, scores fold i; each fold's scores cached in work_dir/fold-i."""
    from pipeline.model.train import check_rows

    n = len(rows)
    labeled_digest = check_rows(rows)
    folds = stratified_folds([r["answer"] for r in rows], k, s.spec.seed)
    probs = np.full((n, len(s.answers)), np.nan, dtype=np.float32)
    embeddings: np.ndarray | None = None
    per_fold = []
    for i in range(k):
        held_idx = np.flatnonzero(folds == i)
        train_rows = [rows[j] for j in np.flatnonzero(folds != i)]
        res, reused = _fold_scores(rows, held_idx, train_rows, i, k, labeled_digest, s)
        pos = {sid: j for j, sid in enumerate(res.sample_ids)}
        order = [pos[rows[j]["sample_id"]] for j in held_idx]
        probs[held_idx] = res.probs[order]
        if embeddings is None:
            embeddings = np.zeros((n, res.embeddings.shape[1]), dtype=np.float32)
        embeddings[held_idx] = res.embeddings[order]
        per_fold.append({"fold": i, "train": len(train_rows), "held_out": len(held_idx), "reused": reused})
    return OOSResult([r["sample_id"] for r in rows], probs, folds, "kfold",
                     {"k": k, "labeled_digest": labeled_digest, "folds": per_fold}, embeddings)


def _fold_scores(rows: list[dict[str, Any]], held_idx: np.ndarray, train_rows: list[dict[str, Any]], i: int, k: int,
                 labeled_digest: str, s: _Scoring) -> tuple[Any, bool]:
    """(one fold's scores of its held-out rows, whether they were cached): trains the fold's adapter when not."""
    from pipeline.scoring import load_scores

    fold_dir = s.work_dir / f"fold-{i}"
    inputs = {"labeled": labeled_digest, "fold": f"{i}/{k}"}
    out = fold_dir / "oos"
    reused = find_valid_manifest(out, stage_key("score", LABELCHECK_VERSION, inputs, s.config)) is not None
    if not reused:
        log.info("label check fold %d/%d: training on %d samples, scoring %d held out", i + 1, k,
                 len(train_rows), len(held_idx))
        trained = train_fold(s.spec, train_rows, fold_dir, progress=s.progress)
        _score_held_out(s.spec, trained.adapter_dir, [rows[j] for j in held_idx], s.answers, out, inputs, s.config)
    return load_scores(out), reused
