"""Data-centric label checks: out-of-sample probabilities, calibrated and abstaining label-error detection (confident
learning on the model's probabilities combined with kNN label consistency), a relabel queue and annotator agreement.

A check that cries wolf is worse than none: the model's out-of-sample probabilities are calibrated (temperature
scaling), the check abstains while the model is too weak to tell its own mistakes from wrong labels, confident
learning's noise-rate estimate bounds how many labels are reported, and each reported label carries the probability
that it is wrong, so the report can say how many of its own alarms are probably false.

Nothing here changes a label. Likely errors are reported (with who labeled them, from which file) and sent back to
annotators as a separate task set; their answers come in through the normal import and land in the ledger as
correction entries, so the old label stays visible in `tamis labels history`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.annotation.export import (
    EXPORTERS,
    ExportContext,
    ExportItem,
    LabelStudioExporter,
    _document_relpath,
    build_items,
)
from pipeline.config import ProjectConfig
from pipeline.errors import ArtifactError, DataError
from pipeline.store import (
    Manifest,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_jsonl,
    digest_json,
    digest_path,
    find_valid_manifest,
    read_jsonl,
    read_manifest,
    stage_key,
    write_manifest,
)

log = logging.getLogger(__name__)

LABELCHECK_VERSION = "1"
# Softmax outputs of fp16/bf16 models sum to 1 only to about 1e-3.
PROB_TOL = 1e-3


class LabelCheckError(DataError):
    pass


# ------------------------------------------------------------------------------------ out-of-sample probabilities
@dataclass
class OOSResult:
    """Class probabilities of labeled samples from models that did not train on them (rows of `sample_ids`)."""

    sample_ids: list[str]
    probs: np.ndarray  # [n, c] over cfg.data.answers
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


def _answers(cfg: ProjectConfig) -> list[str]:
    if not cfg.data.answers:
        raise LabelCheckError("label checks need a closed answer set: set data.answers (open answers have no class "
                              "probabilities to compare)")
    return list(cfg.data.answers)


def _check_labeled(rows: Sequence[Mapping[str, Any]], answers: Sequence[str] | None) -> list[dict[str, Any]]:
    """The rows sorted by sample_id, each with one label in `answers` (any non-empty text when None: open answers)."""
    allowed = set(answers) if answers is not None else None
    seen: set[str] = set()
    out = []
    for i, r in enumerate(rows):
        sid, label = r.get("sample_id"), r.get("answer")
        if not isinstance(sid, str) or not sid:
            raise LabelCheckError(f"labeled row {i}: no sample_id; pass rows from pipeline.rounds.labeled_rows")
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


def fold_config(cfg: ProjectConfig) -> ProjectConfig:
    """The config fold adapters train with: train.max_steps replaced by labelcheck.max_steps when that is set."""
    if cfg.labelcheck.max_steps is None:
        return cfg
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps": cfg.labelcheck.max_steps})})


def _score_config(cfg: ProjectConfig, answers: list[str]) -> dict[str, Any]:
    return {"model": cfg.section("model"), "train": fold_config(cfg).section("train"), "seed": cfg.seed,
            "answers": answers, "length_normalize": cfg.select.length_normalize,
            "batch_size": cfg.select.score_batch_size, "labelcheck_version": LABELCHECK_VERSION}


def _score_held_out(cfg: ProjectConfig, adapter_dir: Path, rows: list[dict[str, Any]], answers: list[str],
                    out_dir: Path, inputs: dict[str, str], config: dict[str, Any], hw: Any) -> Any:
    from pipeline.model.loading import load_model
    from pipeline.scoring import ClosedSetScorer, save_scores

    loaded = load_model(cfg.model, adapter=adapter_dir, hw=hw)
    try:
        result = ClosedSetScorer(loaded, answers, length_normalize=cfg.select.length_normalize).score(
            rows, batch_size=cfg.select.score_batch_size)
    finally:
        del loaded
        gc.collect()
    save_scores(result, out_dir, inputs=inputs, config=config)
    return result


def out_of_sample_probs(
    cfg: ProjectConfig,
    labeled_rows: Sequence[Mapping[str, Any]],
    work_dir: str | os.PathLike[str],
    *,
    k: int | None = None,
    method: str | None = None,
    adapter: str | os.PathLike[str] | None = None,
    trained_ids: Iterable[str] = (),
    hw: Any = None,
    progress: bool = False,
) -> OOSResult:
    """Class probabilities for labeled rows ({sample_id, prepared, question, answer}) from models that never saw them.

    kfold (default `cfg.labelcheck.method`): seeded folds stratified by label; fold i's adapter is trained with
    `train_adapter` on the other folds into work_dir/fold-i and scores fold i. The scores are cached in
    work_dir/fold-i/oos, keyed by (labeled-set digest, fold, config): an unchanged labeled set costs nothing, and an
    interrupted run resumes (train_adapter resumes from its checkpoints).
    heldout: `adapter` (the round's adapter) scores the rows it did not train on (not in `trained_ids`), typically
    the ones labeled since it was trained; a cheap approximation for models too big to train k times.
    """
    from pipeline.model.train import check_rows
    from pipeline.scoring import SCORE_VERSION, load_scores

    method = method or cfg.labelcheck.method
    answers = _answers(cfg)
    rows = _check_labeled(labeled_rows, answers)
    work_dir = Path(work_dir)
    config = _score_config(cfg, answers)
    n = len(rows)

    if method == "heldout":
        if adapter is None:
            raise LabelCheckError("labelcheck.method heldout needs the round's adapter (pass adapter=...); or use kfold")
        skip = set(trained_ids)
        held = [r for r in rows if r["sample_id"] not in skip]
        info: dict[str, Any] = {"adapter": str(adapter), "scored": len(held), "skipped_trained_on": n - len(held)}
        if not held:
            log.info("heldout label check: all %d labeled samples were trained on; nothing to check", n)
            return OOSResult([], np.zeros((0, len(answers)), np.float32), np.zeros(0, np.int64), method, info,
                             np.zeros((0, 0), np.float32))
        inputs = {"rows": check_rows(held), "adapter": digest_path(adapter)}
        out = work_dir / "heldout"
        if find_valid_manifest(out, stage_key("score", SCORE_VERSION, inputs, config)) is None:
            _score_held_out(cfg, Path(adapter), held, answers, out, inputs, config, hw)
            info["reused"] = False
        else:
            info["reused"] = True
        res = load_scores(out)
        return OOSResult(res.sample_ids, res.probs, np.full(len(held), -1, np.int64), method, info, res.embeddings)

    if method != "kfold":
        raise LabelCheckError(f"labelcheck.method {method!r} is not one of kfold, heldout")
    from pipeline.model.train import train_adapter

    k = cfg.labelcheck.kfold if k is None else k
    if k < 2 or n < k:
        raise LabelCheckError(f"k-fold label check: {n} labeled samples cannot make {k} folds; label at least {k} "
                              "samples or lower labelcheck.kfold (≥ 2)")
    labeled_digest = check_rows(rows)
    folds = stratified_folds([r["answer"] for r in rows], k, cfg.seed)
    probs = np.full((n, len(answers)), np.nan, dtype=np.float32)
    embeddings: np.ndarray | None = None
    per_fold = []
    for i in range(k):
        held_idx = np.flatnonzero(folds == i)
        train_rows = [rows[j] for j in np.flatnonzero(folds != i)]
        fold_dir = work_dir / f"fold-{i}"
        inputs = {"labeled": labeled_digest, "fold": f"{i}/{k}"}
        out = fold_dir / "oos"
        reused = find_valid_manifest(out, stage_key("score", SCORE_VERSION, inputs, config)) is not None
        if not reused:
            log.info("label check fold %d/%d: training on %d samples, scoring %d held out", i + 1, k,
                     len(train_rows), len(held_idx))
            trained = train_adapter(fold_config(cfg), train_rows, fold_dir, hw=hw, progress=progress)
            _score_held_out(cfg, trained.adapter_dir, [rows[j] for j in held_idx], answers, out, inputs, config, hw)
        res = load_scores(out)
        pos = {sid: j for j, sid in enumerate(res.sample_ids)}
        order = [pos[rows[j]["sample_id"]] for j in held_idx]
        probs[held_idx] = res.probs[order]
        if embeddings is None:
            embeddings = np.zeros((n, res.embeddings.shape[1]), dtype=np.float32)
        embeddings[held_idx] = res.embeddings[order]
        per_fold.append({"fold": i, "train": len(train_rows), "held_out": len(held_idx), "reused": reused})
    return OOSResult([r["sample_id"] for r in rows], probs, folds, "kfold",
                     {"k": k, "labeled_digest": labeled_digest, "folds": per_fold}, embeddings)


# ------------------------------------------------------------------------------------------ label-error detection
SIGNALS = ("model", "knn")
# Bounds of the fitted temperature: beyond them the probabilities are flat or one-hot and nothing changes.
TEMPERATURE_BOUNDS = (0.05, 50.0)
# Log-probabilities are clipped here: a hard 0 (fp16 underflow, an unseen kNN class) must not become -inf.
LOG_FLOOR = 1e-12
# The model always takes part, so it must be right more often than wrong (estimated against the true labels): below
# that its disagreement means nothing, and as the third rater it cannot vouch for the kNN signal's accuracy.
MIN_MODEL_ACCURACY = 0.5
# A label is reported only when it has at least this chance of being wrong (label_error_posterior): worth an
# annotator's look, and the report says how many of the reported are probably right (expected false alarms).
REPORT_CONFIDENCE = 0.3


@dataclass(frozen=True)
class Issue:
    """A likely label error. given_prob / suggested_prob / margin (= their difference) are on the combined,
    calibrated probabilities; confidence = P(the label is wrong) (label_error_posterior), what the re-label queue's
    labelcheck.min_confidence bar reads; signals = which signals on their own prefer the suggestion over the given
    label ("model", "knn")."""

    index: int
    sample_id: str
    given_label: str
    suggested_label: str
    given_prob: float
    suggested_prob: float
    margin: float
    threshold: float  # the given class's threshold (mean self-confidence)
    confidence: float = 1.0
    signals: tuple[str, ...] = ("model",)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "signals": list(self.signals)}


def _check_probs(probs: Any, n: int, answers: Sequence[str]) -> np.ndarray:
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 2 or p.shape != (n, len(answers)):
        raise LabelCheckError(f"label check: probabilities have shape {p.shape}, expected ({n}, {len(answers)}) "
                              f"for {n} labels over {len(answers)} answers")
    if not np.isfinite(p).all():
        row = int(np.argwhere(~np.isfinite(p))[0, 0])
        raise LabelCheckError(f"label check: probabilities of row {row} are NaN/inf; score that sample again")
    bad = np.flatnonzero((p.min(1) < -PROB_TOL) | (np.abs(p.sum(1) - 1) > PROB_TOL))
    if len(bad):
        raise LabelCheckError(f"label check: row {int(bad[0])} is not a probability distribution (sum "
                              f"{p[bad[0]].sum():.4f}, min {p[bad[0]].min():.4f}); {len(bad)} rows like it")
    return np.clip(p, 0.0, None) / np.clip(p, 0.0, None).sum(1, keepdims=True)


def _label_index(given_labels: Sequence[str], answers: Sequence[str]) -> np.ndarray:
    pos = {a: j for j, a in enumerate(answers)}
    out = np.empty(len(given_labels), dtype=np.int64)
    for i, lab in enumerate(given_labels):
        if lab not in pos:
            raise LabelCheckError(f"label check: label {lab!r} of row {i} is not in the answer set "
                                  f"[{', '.join(answers)}]")
        out[i] = pos[lab]
    return out


# ------------------------------------------------------------------------------------------------- calibration
def apply_temperature(probs: np.ndarray, temperature: float) -> np.ndarray:
    """softmax(log p / T): T > 1 softens over-confident probabilities, T < 1 sharpens timid ones."""
    z = np.log(np.clip(probs, LOG_FLOOR, None)) / temperature
    z -= z.max(1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(1, keepdims=True)


def _nll(probs: np.ndarray, given: np.ndarray) -> float:
    return float(-np.log(np.clip(probs[np.arange(len(given)), given], LOG_FLOOR, None)).mean())


def fit_temperature(probs: np.ndarray, given: np.ndarray) -> float:
    """Temperature scaling (Guo et al. 2017) fitted on out-of-sample probabilities against the given labels: the T
    minimising their negative log-likelihood. Fold adapters trained for a fixed step budget on few labels are
    over-confident (or timid), and the confident joint, the combination of signals and the false-alarm estimate all
    read probabilities as probabilities. Fitted on the noisy labels themselves, so it errs towards softer
    probabilities when labels are wrong: a conservative direction for a detector."""
    from scipy.optimize import minimize_scalar

    p = np.asarray(probs, dtype=np.float64)
    if len(given) == 0:
        return 1.0
    lo, hi = np.log(TEMPERATURE_BOUNDS[0]), np.log(TEMPERATURE_BOUNDS[1])
    res = minimize_scalar(lambda lt: _nll(apply_temperature(p, float(np.exp(lt))), given), bounds=(lo, hi),
                          method="bounded", options={"xatol": 1e-4})
    return float(np.exp(res.x))


def agreement(probs: np.ndarray, given: np.ndarray) -> float:
    """Share of labels the signal's most probable class agrees with: a model's out-of-sample accuracy measured
    against the labels it checks (noise in them lowers it)."""
    return float((probs.argmax(1) == given).mean()) if len(given) else float("nan")


# ------------------------------------------------------------------------------------------ confident learning
def class_thresholds(probs: np.ndarray, given: np.ndarray, n_classes: int) -> np.ndarray:
    """Per-class threshold t_j = mean p_j over the samples labeled j; +inf for a class nobody was given (it can
    never be suggested: with no samples there is no estimate of how confident the model is about it)."""
    t = np.full(n_classes, np.inf)
    for j in np.unique(given):
        t[j] = probs[given == j, j].mean()
    return t


def confident_joint(probs: np.ndarray, given: np.ndarray, n_classes: int) -> np.ndarray:
    """C[i, j]: samples labeled i whose probability of j reaches j's threshold (the most probable such j when
    several do) — Northcutt et al. 2021. Samples reaching no threshold are not counted."""
    t = class_thresholds(probs, given, n_classes)
    above = probs >= t[None, :]
    j = np.where(above, probs, -np.inf).argmax(1)
    joint = np.zeros((n_classes, n_classes), dtype=np.int64)
    counted = above.any(1)
    np.add.at(joint, (given[counted], j[counted]), 1)
    return joint


def calibrate_confident_joint(joint: np.ndarray, given: np.ndarray) -> np.ndarray:
    """Rows rescaled so row i sums to the number of samples labeled i: the confident joint counts only samples that
    reach a threshold, the calibrated one estimates counts over the whole labeled set. Its off-diagonal sum is the
    estimated number of wrong labels."""
    n_i = np.bincount(given, minlength=joint.shape[0]).astype(np.float64)
    rows = joint.sum(1).astype(np.float64)
    return np.where(rows[:, None] > 0, joint / np.maximum(rows, 1)[:, None] * n_i[:, None], 0.0)


def prune_by_noise_rate(probs: np.ndarray, given: np.ndarray, calibrated_joint: np.ndarray) -> np.ndarray:
    """Mask of likely errors (confident learning's prune_by_noise_rate): for every off-diagonal cell (i, j), the
    round(C[i, j]) samples labeled i with the largest margin p_j − p_i. The noise-rate estimate bounds how many are
    reported, instead of every sample below its class threshold; at least one sample of each class is kept."""
    flagged = np.zeros(len(given), dtype=bool)
    for i in np.unique(given):
        idx = np.flatnonzero(given == i)
        budget = len(idx) - 1
        for j in np.argsort(-calibrated_joint[i], kind="stable"):
            m = min(int(round(calibrated_joint[i, j])), budget)
            if j == i or m <= 0:
                continue
            margin = probs[idx, j] - probs[idx, i]
            pick = idx[np.argsort(-margin, kind="stable")[:m]]
            budget -= int((~flagged[pick]).sum())
            flagged[pick] = True
    return flagged


def _margins(p: np.ndarray, given: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the most probable other class per sample, p(given) − p(that class))."""
    rows = np.arange(len(given))
    other = p.copy()
    other[rows, given] = -np.inf
    suggested = other.argmax(1)
    return suggested, p[rows, given] - p[rows, suggested]


def _ranking(p: np.ndarray, given: np.ndarray, ids: Sequence[str]) -> np.ndarray:
    """Row order, likeliest error first: by self-confidence p(given), then margin, then sample ID."""
    _, margin = _margins(p, given)
    return np.lexsort((np.asarray(ids, dtype=object).astype(str), margin, p[np.arange(len(given)), given]))


def _ranked_issues(p: np.ndarray, given: np.ndarray, flagged: np.ndarray, confidence: np.ndarray,
                   answers: Sequence[str], ids: list[str], signal_probs: Mapping[str, np.ndarray]) -> list[Issue]:
    """Issues for the flagged rows, likeliest error first (_ranking); each names the signals that, on their own,
    prefer the suggestion to the given label (the stronger one when neither does and the prior tipped it)."""
    t = class_thresholds(p, given, len(answers))
    suggested, margin = _margins(p, given)
    out = []
    for i in (i for i in _ranking(p, given, ids) if flagged[i]):
        g, s = given[i], suggested[i]
        ratio = {name: float(np.log(max(q[i, s], LOG_FLOOR)) - np.log(max(q[i, g], LOG_FLOOR)))
                 for name, q in signal_probs.items()}
        signals = tuple(name for name in ratio if ratio[name] > 0) or (max(ratio, key=ratio.__getitem__),)
        out.append(Issue(int(i), ids[i], answers[g], answers[s], float(p[i, g]), float(p[i, s]), float(margin[i]),
                         float(t[g]), float(confidence[i]), signals))
    return out


def num_label_issues(calibrated_joint: np.ndarray) -> int:
    """How many labels the calibrated confident joint says are wrong: its off-diagonal sum, rounded. The check
    reports at most this many, lowest self-confidence first (cleanlab's low_self_confidence filter) — unlike the
    per-cell prune_by_noise_rate it does not miss a flip whose combined probability reached no class threshold."""
    return int(round(calibrated_joint.sum() - np.trace(calibrated_joint)))


def noise_rate(calibrated_joint: np.ndarray) -> float:
    """Estimated share of wrong labels: the calibrated confident joint's off-diagonal over its total."""
    total = calibrated_joint.sum()
    return float((total - np.trace(calibrated_joint)) / total) if total else 0.0


def find_label_issues(
    probs: Any,
    given_labels: Sequence[str],
    answers: Sequence[str],
    *,
    sample_ids: Sequence[str] | None = None,
) -> list[Issue]:
    """Confident learning (Northcutt et al. 2021) on one probability matrix, as given (no calibration, no abstain
    rule: detect_label_issues adds those): the calibrated confident joint estimates how many labels are wrong and
    prune_by_noise_rate picks that many, likeliest first (lowest p(given)); the suggestion is the most probable other
    class, the confidence label_error_posterior at the estimated noise rate. Pure numpy; probs are out-of-sample
    [n, c]."""
    n = len(given_labels)
    p = _check_probs(probs, n, answers)
    if sample_ids is not None and len(sample_ids) != n:
        raise LabelCheckError(f"label check: {len(sample_ids)} sample IDs for {n} labels")
    if n == 0:
        return []
    given = _label_index(given_labels, answers)
    ids = list(sample_ids) if sample_ids is not None else [str(i) for i in range(n)]
    joint = calibrate_confident_joint(confident_joint(p, given, len(answers)), given)
    flagged = prune_by_noise_rate(p, given, joint)
    confidence = label_error_posterior(p[np.arange(n), given], noise_rate(joint), len(answers))
    return _ranked_issues(p, given, flagged, confidence, answers, ids, {"model": p})


# ------------------------------------------------------------------------------------------------- kNN signal
@dataclass
class KnnSpace:
    """The labeled samples the kNN signal searches: their IDs, embeddings [n, d] and current labels. The checked
    samples are among them; the rest only vote (a heldout check judges the new labels against every labeled
    neighbour). `groups`: neighbours only within a group (embeddings from different fold adapters share no space).
    `source` says where the embeddings came from, for the report."""

    sample_ids: list[str]
    embeddings: np.ndarray
    labels: list[str]
    groups: np.ndarray | None = None
    source: str = ""


def knn_label_probs(
    embeddings: Any,
    labels: np.ndarray,
    n_classes: int,
    *,
    k: int,
    query: Any = None,
    groups: Any = None,
    smoothing: float = 1.0,
) -> np.ndarray:
    """For each query row (default: every row), the labels of its k nearest *other* rows (cosine similarity, faiss)
    as a distribution: (votes_j + smoothing) / (k + smoothing · c). A label its neighbours do not share is suspect
    whatever the model thinks (deep-kNN, Bahri et al. 2020; SimiFeat, Zhu et al. 2022), and the neighbours' labels
    are independent of the model's errors. Leave-one-out, so out-of-sample by construction. [len(query), c]."""
    import faiss

    from pipeline.strategies.selectors import faiss_threads

    x = np.asarray(embeddings, dtype=np.float32)
    n = len(labels)
    if x.ndim != 2 or len(x) != n:
        raise LabelCheckError(f"label check: embeddings have shape {x.shape}, expected ({n}, d) for {n} labels")
    if not np.isfinite(x).all():
        raise LabelCheckError("label check: the kNN embeddings hold NaN/inf; recompute the selection embeddings")
    x = np.ascontiguousarray(x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12))
    rows = np.arange(n) if query is None else np.asarray(query, dtype=np.int64)
    grp = np.zeros(n, dtype=np.int64) if groups is None else np.asarray(groups)
    out = np.full((len(rows), n_classes), 1.0 / n_classes)
    with faiss_threads():
        for gv in np.unique(grp[rows]):
            members = np.flatnonzero(grp == gv)
            kk = min(k, len(members) - 1)
            if kk < 1:
                continue
            index = faiss.IndexFlatIP(x.shape[1])
            index.add(x[members])
            asking = np.flatnonzero(grp[rows] == gv)
            _, nb = index.search(x[rows[asking]], kk + 1)
            for r, q in zip(asking, nb, strict=True):
                # The row itself must not vote (it is not always the first hit: duplicates tie).
                mates = [members[j] for j in q if j >= 0 and members[j] != rows[r]][:kk]
                votes = np.bincount(labels[mates], minlength=n_classes).astype(np.float64)
                out[r] = (votes + smoothing) / (votes.sum() + smoothing * n_classes)
    return out


def _knn_for(space: KnnSpace, ids: list[str], given: np.ndarray, answers: Sequence[str], k: int) -> np.ndarray:
    """kNN label distributions of the checked samples `ids` (labels `given`) in `space`."""
    pos = {s: i for i, s in enumerate(space.sample_ids)}
    missing = [s for s in ids if s not in pos]
    if missing:
        raise LabelCheckError(f"label check: sample {missing[0]} has no kNN embedding ({len(missing)} of {len(ids)} "
                              "checked samples missing); pass embeddings of every checked sample")
    labels = _label_index(space.labels, answers)
    query = np.asarray([pos[s] for s in ids], dtype=np.int64)
    stale = np.flatnonzero(labels[query] != given)
    if len(stale):
        raise LabelCheckError(f"label check: sample {ids[stale[0]]} has label {answers[given[stale[0]]]!r} but "
                              f"{answers[labels[query[stale[0]]]]!r} in the kNN space; build both from one labeled set")
    return knn_label_probs(space.embeddings, labels, len(answers), k=k, query=query, groups=space.groups)


def combine_signals(signal_probs: Mapping[str, np.ndarray], given: np.ndarray, n_classes: int) -> np.ndarray:
    """Product of experts: p(y) ∝ Π_s p_s(y) / prior(y)^(S−1) over the calibrated signals (naive Bayes: each signal's
    evidence counts once, the class prior once), then temperature-scaled again — the model and kNN err on some of the
    same hard samples, and the second fit takes back the confidence that double counting adds."""
    probs = list(signal_probs.values())
    if len(probs) == 1:
        return probs[0]
    prior = (np.bincount(given, minlength=n_classes) + 1.0) / (len(given) + n_classes)
    logp = sum(np.log(np.clip(q, LOG_FLOOR, None)) for q in probs) - (len(probs) - 1) * np.log(prior)[None, :]
    logp -= logp.max(1, keepdims=True)
    p = np.exp(logp)
    p /= p.sum(1, keepdims=True)
    return apply_temperature(p, fit_temperature(p, given))


def three_rater_accuracy(a_xg: float, a_yg: float, a_xy: float) -> float:
    """Accuracy of rater x against the true labels from three pairwise agreements (x, y and the annotator g, errors
    independent): P(x = y) ≈ acc_x · acc_y, so acc_x = sqrt(a_xg · a_xy / a_yg). Label noise lowers a_xg and a_yg
    alike but not a_xy, which is how a good model checking noisy labels is told from a weak model checking clean
    ones. Clipped to [a_xg, 1]: noise only ever lowers the measured agreement."""
    if min(a_xg, a_yg, a_xy) <= 0:
        return a_xg
    return float(min(1.0, max(a_xg, np.sqrt(a_xg * a_xy / a_yg))))


def label_error_posterior(p_given: np.ndarray, noise_rate: float, n_classes: int) -> np.ndarray:
    """P(the label is wrong | calibrated p(given), noise rate η), per sample, under uniform label noise.

    Calibrated against the given labels, p(g) estimates how often an annotator would give label g here:
    p(g) = (1 − η)·π_g + e·(1 − π_g) with e = η / (c − 1) and π_g the probability that g is the true class. A wrong
    label accounts for e·(1 − π_g) of it, so P(wrong) = e·(1 − p(g) − η) / ((1 − c·e)·p(g)). Low p(g) alone is not
    enough: where labels are rarely wrong (small η), a hard sample the model gets wrong explains a low p(g) better
    than an annotator's slip does."""
    eta = float(np.clip(noise_rate, 0.0, 0.5))
    e = eta / max(n_classes - 1, 1)
    p = np.clip(np.asarray(p_given, dtype=np.float64), LOG_FLOOR, 1.0)
    return np.clip(e * (1.0 - p - eta) / ((1.0 - n_classes * e) * p), 0.0, 1.0)


@dataclass
class Detection:
    """What one label check concluded: the issues (empty when it abstained), why it abstained, what each signal did,
    and the calibration's own estimate of how many reported labels are right after all."""

    issues: list[Issue]
    checked: int
    signals: dict[str, dict[str, Any]]
    oos_accuracy: float | None
    noise_rate: float | None
    expected_false_alarms: float
    abstained: str | None
    min_oos_accuracy: float
    ranking: list[str] = field(default_factory=list)  # every checked sample, likeliest error first
    judging: float | None = None  # estimated accuracy of what judged (model, or model and kNN combined)
    label_accuracy: float | None = None  # three-rater estimate of the share of correct labels (None: one signal)

    def summary(self) -> str:
        """One line for the log and the report."""
        if self.abstained:
            return f"label check: {self.abstained}"
        used = "+".join(s for s in SIGNALS if self.signals.get(s, {}).get("used"))
        return (f"label check ({used}): {len(self.issues)} likely label errors among {self.checked} labels"
                + (f"; {false_alarm_text(self.expected_false_alarms)}" if self.issues else ""))

    def info(self) -> dict[str, Any]:
        """JSON-able: the report's verdict.json and the stage manifest."""
        def r(x: float | None) -> float | None:
            return None if x is None else round(float(x), 4)

        return {"checked": self.checked, "issues": len(self.issues), "abstained": self.abstained is not None,
                "abstain_reason": self.abstained, "oos_accuracy": r(self.oos_accuracy),
                "min_oos_accuracy": self.min_oos_accuracy, "judging_accuracy": r(self.judging),
                "label_accuracy": r(self.label_accuracy), "noise_rate": r(self.noise_rate),
                "expected_false_alarms": round(self.expected_false_alarms, 2), "message": self.summary(),
                "signals": {k: {kk: r(vv) if isinstance(vv, float) else vv for kk, vv in v.items()}
                            for k, v in self.signals.items()}}


def detect_label_issues(
    probs: Any,
    given_labels: Sequence[str],
    answers: Sequence[str],
    *,
    sample_ids: Sequence[str] | None = None,
    knn: KnnSpace | None = None,
    knn_note: str | None = None,
    use_model: bool = True,
    min_oos_accuracy: float = 0.75,
    knn_k: int = 5,
) -> Detection:
    """The label check's verdict on out-of-sample probabilities [n, c] of the checked labels (and, optionally, a kNN
    space holding them).

    1. Calibration: each signal is temperature-scaled against the given labels — the model's probabilities, and the
       label distribution of each sample's `knn_k` nearest labeled neighbours (knn_label_probs).
    2. The kNN signal takes part when its own accuracy, estimated against the true labels (three_rater_accuracy:
       label noise lowers its agreement with the labels but not with the model), reaches `min_oos_accuracy`;
       otherwise it is left out and the report says why. The signals in use are multiplied as experts
       (combine_signals).
    3. Abstain rule: the check judges only when what judges — the model, or model and kNN combined — is accurate
       enough: its out-of-sample agreement with the given labels, divided by the share of correct labels the three
       raters imply (no correction with the model alone), must reach `min_oos_accuracy`; and the model, which always
       takes part, must be right more often than wrong (estimated accuracy ≥ 0.5). Otherwise nothing is reported and
       the reason says so ("model not yet accurate enough to judge labels (OOS accuracy 0.70 ...)").
    4. Confident learning on the combined probabilities: the calibrated confident joint's off-diagonal bounds how
       many issues (num_label_issues), taken lowest self-confidence p(given) first, and of those only the labels with
       a real chance of being wrong are reported: P(wrong) = label_error_posterior(p(given), the joint's noise rate)
       ≥ 0.3. Each issue names the signal(s) that on their own prefer the suggestion.
    5. expected_false_alarms = Σ (1 − P(wrong)) over the issues: "about N of these may be correct labels".

    `use_model=False` judges by the kNN signal alone (a benchmark ablation; a round always uses the model)."""
    n = len(given_labels)
    p_raw = _check_probs(probs, n, answers)
    if sample_ids is not None and len(sample_ids) != n:
        raise LabelCheckError(f"label check: {len(sample_ids)} sample IDs for {n} labels")
    ids = list(sample_ids) if sample_ids is not None else [str(i) for i in range(n)]
    given = _label_index(given_labels, answers)
    c = len(answers)
    if n == 0:
        return Detection([], 0, {}, None, None, 0.0, "no labels to check", min_oos_accuracy)

    t_m = fit_temperature(p_raw, given)
    p_m = apply_temperature(p_raw, t_m)
    a_mg = agreement(p_m, given)
    signals: dict[str, dict[str, Any]] = {"model": {"used": use_model, "accuracy": a_mg, "estimated_accuracy": a_mg,
                                                    "temperature": t_m}}
    calibrated = {"model": p_m}
    clean: float | None = None  # estimated share of correct labels (three raters); None without a second rater
    if knn is None:
        signals["knn"] = {"used": False, "note": knn_note or "no embeddings of the checked samples"}
    else:
        p_k_raw = _knn_for(knn, ids, given, answers, knn_k)
        t_k = fit_temperature(p_k_raw, given)
        p_k = apply_temperature(p_k_raw, t_k)
        a_kg, a_mk = agreement(p_k, given), float((p_k.argmax(1) == p_m.argmax(1)).mean())
        est_k = three_rater_accuracy(a_kg, a_mg, a_mk)
        signals["knn"] = {"used": est_k >= min_oos_accuracy, "accuracy": a_kg, "estimated_accuracy": est_k,
                          "temperature": t_k, "k": knn_k, "agreement_with_model": a_mk, "source": knn.source,
                          "neighbours_from": len(knn.sample_ids), "note": knn_note or ""}
        if est_k >= min_oos_accuracy:
            calibrated["knn"] = p_k
            clean = float(np.clip(np.sqrt(a_mg * a_kg / a_mk), 0.5, 1.0)) if a_mk > 0 else 1.0
            signals["model"]["estimated_accuracy"] = three_rater_accuracy(a_mg, a_kg, a_mk)
        else:
            signals["knn"]["note"] = (f"kNN label consistency too weak to use (accuracy {est_k:.2f} < "
                                      f"labelcheck.min_oos_accuracy {min_oos_accuracy:.2f})")
    if not use_model:
        signals["model"]["used"] = False
        calibrated.pop("model")
    elif signals["model"]["estimated_accuracy"] < MIN_MODEL_ACCURACY:
        # Wrong more often than right: its disagreement means nothing, and as a rater it cannot vouch for the kNN.
        for s in signals.values():
            s["used"] = False
        why = (f"model not yet accurate enough to judge labels (OOS accuracy {a_mg:.2f}; it must be right more often "
               f"than wrong, and the check needs labelcheck.min_oos_accuracy {min_oos_accuracy:.2f})")
        return Detection([], n, signals, a_mg, None, 0.0, why, min_oos_accuracy, label_accuracy=clean)
    if not calibrated:
        return Detection([], n, signals, a_mg, None, 0.0, "no signal accurate enough to judge labels",
                         min_oos_accuracy)

    p = combine_signals(calibrated, given, c)
    # Abstain rule: what judges (the model, or the model and kNN combined) must reach the floor, its agreement with
    # the given labels corrected for the label noise the three raters reveal.
    a_cg = agreement(p, given)
    judging = float(min(1.0, max(a_cg, a_cg / (clean or 1.0))))
    if judging < min_oos_accuracy:
        for s in signals.values():
            if s.get("used"):
                s["used"] = False
        with_knn = f"; with kNN label consistency {judging:.2f}" if "knn" in calibrated else ""
        why = (f"model not yet accurate enough to judge labels (OOS accuracy {a_mg:.2f}{with_knn}; the check needs "
               f"labelcheck.min_oos_accuracy {min_oos_accuracy:.2f})")
        return Detection([], n, signals, a_mg, None, 0.0, why, min_oos_accuracy, judging=judging,
                         label_accuracy=clean)

    joint = calibrate_confident_joint(confident_joint(p, given, c), given)
    eta = noise_rate(joint)
    confidence = label_error_posterior(p[np.arange(n), given], eta, c)
    # Reported: as many as the joint's off-diagonal says are wrong, lowest self-confidence first, and of those only
    # the ones with a real chance of being wrong.
    flagged = np.zeros(n, dtype=bool)
    flagged[_ranking(p, given, ids)[:num_label_issues(joint)]] = True
    flagged &= confidence >= REPORT_CONFIDENCE
    issues = _ranked_issues(p, given, flagged, confidence, answers, ids, calibrated)
    return Detection(issues, n, signals, a_mg, eta, float(sum(1.0 - i.confidence for i in issues)), None,
                     min_oos_accuracy, [ids[i] for i in _ranking(p, given, ids)], judging, clean)


def _entries(ledger: Any) -> list[dict[str, Any]]:
    return ledger.entries() if hasattr(ledger, "entries") else [dict(e) for e in ledger]


def label_issue_table(issues: Sequence[Issue], ledger: Any) -> list[dict[str, Any]]:
    """One row per issue, with who gave the label and from which file (from the ledger; `ledger` is a Ledger or
    its entries). Labels that never went through the ledger (the dataset's train split) show origin "dataset"."""
    current: dict[str, dict[str, Any]] = {}
    for e in _entries(ledger):
        if "sample_id" in e:
            current[e["sample_id"]] = e
    table = []
    for rank, iss in enumerate(issues, 1):
        e = current.get(iss.sample_id)
        row: dict[str, Any] = {
            "rank": rank, "sample_id": iss.sample_id, "given_label": iss.given_label,
            "suggested_label": iss.suggested_label, "score": round(iss.margin, 6),
            "given_prob": round(iss.given_prob, 6), "suggested_prob": round(iss.suggested_prob, 6),
            "threshold": round(iss.threshold, 6), "confidence": round(iss.confidence, 6),
            "signals": list(iss.signals),
        }
        if e is None:
            row |= {"annotators": [], "source_file": "", "round": None, "origin": "dataset", "entry_id": None}
        else:
            voters = [v["annotator"] for v in e.get("votes") or []] or [a for a in e["annotator"].split(",") if a]
            row |= {"annotators": sorted(set(voters)), "source_file": e["source_file"], "round": e["round"],
                    "origin": e["kind"], "entry_id": e.get("entry_id")}
            if e["label"] != iss.given_label:
                # The ledger moved on since the probabilities were computed: the issue may already be fixed.
                row["ledger_label"] = e["label"]
        table.append(row)
    return table


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
    re-label costs an annotator's time whether it changes the label or confirms it); rounds.label_budget counts this."""
    return n_labeled + sum(len(ids) for ids in relabel_queued(artifacts, before_round).values())


def annotator_agreement(ledger_entries: Any, oos_suggestions: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Per annotator: n votes on samples several people labeled, the share agreeing with the majority, and the
    share of all their labels agreeing with the out-of-sample model (n_model of them had a model suggestion).

    A confused annotator shows up low on both; one low only against the model may be right where the model is not.
    """
    stats: dict[str, dict[str, float]] = {}

    def s(who: str) -> dict[str, float]:
        return stats.setdefault(who, {"n": 0, "majority": 0, "n_model": 0, "model": 0})

    for e in _entries(ledger_entries):
        sid = e.get("sample_id")
        votes = e.get("votes") or [{"annotator": a, "label": e["label"]} for a in e["annotator"].split(",") if a]
        for v in votes:
            st = s(v["annotator"])
            if e.get("votes"):
                st["n"] += 1
                st["majority"] += v["label"] == e["label"]
            if sid in oos_suggestions:
                st["n_model"] += 1
                st["model"] += v["label"] == oos_suggestions[sid]
    return {
        who: {"n": int(st["n"]), "agree_majority": st["majority"] / st["n"] if st["n"] else None,
              "n_model": int(st["n_model"]), "agree_model": st["model"] / st["n_model"] if st["n_model"] else None}
        for who, st in sorted(stats.items())
    }


# ------------------------------------------------------------------------------------------------ relabel queue
RELABEL_TABLE = "relabel.jsonl"


def relabel_dir(artifacts: str | os.PathLike[str], round_index: int) -> Path:
    return Path(artifacts) / "rounds" / f"{round_index:03d}" / "relabel"


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
    cfg: ProjectConfig,
    out_dir: str | os.PathLike[str],
    *,
    round_index: int,
) -> Manifest | None:
    """Write the issues as a separate annotation task set (rounds/NNN/relabel/): Label Studio tasks with the
    current label and the suggestion as pre-annotations, plus the other configured formats and relabel.jsonl.
    Their import appends correction entries (labels.py); None when there is nothing to relabel."""
    if not issues:
        log.info("relabel queue for round %d: no likely label errors", round_index)
        return None
    out_dir = Path(out_dir)
    inputs = {"issues": digest_json([iss.to_dict() for iss in issues])}
    config = {"annotate": cfg.section("annotate"), "answers": cfg.data.answers}
    if (m := find_valid_manifest(out_dir, stage_key("relabel", LABELCHECK_VERSION, inputs, config))) is not None:
        return m  # already exported: annotators may be working on these files
    sel = [{"sample_id": iss.sample_id, "rank": r, "score": iss.margin, "prediction": iss.suggested_label,
            "confidence": iss.suggested_prob,
            "scores": {"margin": iss.margin, "given_prob": iss.given_prob, "suggested_prob": iss.suggested_prob}}
           for r, iss in enumerate(issues)]
    items = build_items(sel, dataset, image_source=cfg.annotate.export_images)
    ctx = ExportContext(round_index=round_index, answers=cfg.data.answers,
                        image_url_prefix=cfg.annotate.image_url_prefix,
                        export_relpath=_document_relpath(out_dir, cfg), model_version="labelcheck")
    current = {iss.sample_id: (iss.given_label, iss.given_prob) for iss in issues}
    out_dir.mkdir(parents=True, exist_ok=True)
    outputs: dict[str, str] = {}
    for name in dict.fromkeys(cfg.annotate.formats):
        exporter = RelabelLabelStudioExporter(ctx, current) if name == "label_studio" else EXPORTERS[name](ctx)
        outputs |= {rel: rel for rel in exporter.write(items, out_dir)}
    atomic_write_jsonl(out_dir / RELABEL_TABLE, [iss.to_dict() for iss in issues])
    outputs[RELABEL_TABLE] = RELABEL_TABLE
    log.info("relabel queue: %d likely label errors of round %d exported to %s", len(items), round_index, out_dir)
    return write_manifest(
        out_dir, stage="relabel", stage_version=LABELCHECK_VERSION, inputs=inputs, config=config, outputs=outputs,
        info={"round": round_index, "count": len(items)},
    )


# -------------------------------------------------------------------------------------------------- the report
VERDICT_FILE = "verdict.json"


def write_label_report(
    out_dir: str | os.PathLike[str],
    *,
    oos: OOSResult,
    table: Sequence[Mapping[str, Any]],
    agreement: Mapping[str, Mapping[str, Any]],
    answers: Sequence[str],
    verdict: Mapping[str, Any] | None = None,
) -> Manifest:
    """issues.jsonl (the table), oos_probs.npz, agreement.json, verdict.json (Detection.info: abstained or not and
    why, the signals, the expected false alarms) and a manifest (stage "labelcheck") in out_dir; an identical report
    already there is left as it is (a re-run never rewrites a finished stage's outputs)."""
    import io

    out_dir = Path(out_dir)
    verdict = dict(verdict or {})
    inputs = {"oos": digest_json({"ids": oos.sample_ids, "probs": np.round(oos.probs, 6).tolist()}),
              "table": digest_json([dict(r) for r in table]),
              "agreement": digest_json({k: dict(v) for k, v in agreement.items()}),
              "verdict": digest_json(verdict)}
    config = {"answers": list(answers), "method": oos.method}
    if (m := find_valid_manifest(out_dir, stage_key("labelcheck", LABELCHECK_VERSION, inputs, config))) is not None:
        return m
    atomic_write_jsonl(out_dir / "issues.jsonl", [dict(r) for r in table])
    buf = io.BytesIO()
    np.savez(buf, probs=oos.probs, folds=oos.folds, sample_ids=np.asarray(oos.sample_ids, dtype=str))
    atomic_write_bytes(out_dir / "oos_probs.npz", buf.getvalue())
    atomic_write_json(out_dir / "agreement.json", {k: dict(v) for k, v in agreement.items()})
    atomic_write_json(out_dir / VERDICT_FILE, verdict)
    summary = {k: verdict[k] for k in ("abstained", "oos_accuracy", "expected_false_alarms", "message")
               if k in verdict}
    return write_manifest(
        out_dir, stage="labelcheck", stage_version=LABELCHECK_VERSION, inputs=inputs, config=config,
        outputs={"issues": "issues.jsonl", "oos_probs": "oos_probs.npz", "agreement": "agreement.json",
                 "verdict": VERDICT_FILE},
        info={"method": oos.method, "checked": len(oos.sample_ids), "issues": len(table), **oos.info, **summary},
    )


def verdict_headline(verdict: Mapping[str, Any], n_issues: int, checked: int, how: str = "") -> str:
    """What the check concluded, in one sentence: the abstain message, or the count with its false-alarm estimate."""
    if verdict.get("abstained"):
        return (f"label check: {verdict['abstain_reason']}. No label is judged or queued for re-labeling this "
                "round.")
    text = f"{n_issues} likely label errors among {checked} labeled samples" + (f" ({how})" if how else "") + "."
    if n_issues and "expected_false_alarms" in verdict:
        text += f" {false_alarm_text(verdict['expected_false_alarms']).capitalize()}."
    return text


def false_alarm_text(expected: float) -> str:
    """"about N of these may be correct labels", from the expected false alarms (Σ P(label right) over the issues)."""
    if expected < 0.5:
        return f"probably none of these is a correct label (expected false alarms {expected:.1f})"
    return f"about {round(expected)} of these may be correct labels (expected false alarms {expected:.1f})"


def verdict_signals(verdict: Mapping[str, Any]) -> list[str]:
    """One line per signal: how accurate it is and whether it took part (shared with `tamis labels issues`)."""
    sig = verdict.get("signals") or {}
    lines = []
    model, knn = sig.get("model") or {}, sig.get("knn") or {}
    if model:
        est = (f"estimated {model['estimated_accuracy']:.2f} against the true labels with the kNN signal as a second "
               "rater; " if knn.get("used") else "")
        lines.append(f"Model signal: out-of-sample accuracy {model['accuracy']:.2f} on these labels ({est}"
                     f"labelcheck.min_oos_accuracy {verdict.get('min_oos_accuracy', 0):.2f}), calibrated at "
                     f"temperature {model['temperature']:.2f}.")
    if knn.get("used"):
        lines.append(f"kNN signal: the labels of the {knn['k']} nearest labeled neighbours in "
                     f"{knn['source']} agree with {knn['accuracy']:.2f} of these labels.")
    elif knn:
        lines.append(f"kNN signal not used: {knn.get('note') or 'unavailable'}.")
    return lines


def label_report_markdown(table: Sequence[Mapping[str, Any]], agreement: Mapping[str, Mapping[str, Any]], *,
                          method: str, checked: int, top: int = 10, verdict: Mapping[str, Any] | None = None) -> str:
    """The round summary's "Label quality" section."""
    how = ("out-of-sample probabilities from k-fold adapters" if method == "kfold" else
           "out-of-sample probabilities from the round's adapter on samples it did not train on")
    verdict = verdict or {}
    lines = ["## Label quality", "", verdict_headline(verdict, len(table), checked, how), ""]
    if signals := verdict_signals(verdict):
        lines += ["- " + s for s in signals] + [""]
    if table:
        lines += ["| rank | sample | given | suggested | P(wrong) | signals | annotators | source |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['rank']} | {r['sample_id']} | {r['given_label']} | {r['suggested_label']} | "
                  f"{r.get('confidence', 1.0):.2f} | {', '.join(r.get('signals', []))} | "
                  f"{', '.join(r['annotators']) or r['origin']} | {Path(r['source_file']).name} |"
                  for r in table[:top]]
    if agreement:
        def pct(x: Any) -> str:
            return "–" if x is None else f"{100 * x:.0f}%"

        lines += ["", "| annotator | votes on shared samples | agree with majority | labels checked | "
                  "agree with model |", "|---|---|---|---|---|"]
        lines += [f"| {who} | {a['n']} | {pct(a['agree_majority'])} | {a['n_model']} | {pct(a['agree_model'])} |"
                  for who, a in agreement.items()]
    return "\n".join(lines)


def knn_space(cfg: ProjectConfig, labeled_rows: Sequence[Mapping[str, Any]], oos: OOSResult,
              selection: tuple[Sequence[str], np.ndarray] | None) -> tuple[KnnSpace | None, str | None]:
    """The kNN signal's space and, when there is none, why. `selection`: the selection-embeddings stage's (IDs,
    vectors) when select.embeddings is not `model`; every labeled sample is a neighbour there. With `model`, the
    label check's own scoring embeddings of the checked samples, neighbours within each fold's adapter."""
    from pipeline.embeddings import lookup

    source = cfg.select.embeddings.source
    if cfg.labelcheck.knn_k == 0:
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


def check_labels(
    cfg: ProjectConfig,
    labeled_rows: Sequence[Mapping[str, Any]],
    out_dir: str | os.PathLike[str],
    ledger: Any,
    *,
    adapter: str | os.PathLike[str] | None = None,
    trained_ids: Iterable[str] = (),
    hw: Any = None,
    oos_dir: str | os.PathLike[str] | None = None,
    selection_embeddings: tuple[Sequence[str], np.ndarray] | None = None,
) -> Manifest:
    """One round's label check: out-of-sample probabilities (cfg.labelcheck.method; fold adapters and scores under
    `oos_dir`, default out_dir/oos), detect_label_issues with the kNN signal (knn_space), the issues with who gave
    each label, annotator agreement, written by write_label_report to out_dir. `adapter` / `trained_ids` are for the
    heldout method (see out_of_sample_probs). Open answers (data.answers: null) go to check_open_labels."""
    if not cfg.data.answers:
        return check_open_labels(cfg, labeled_rows, out_dir, ledger, adapter=adapter, trained_ids=trained_ids, hw=hw,
                                 oos_dir=oos_dir)
    answers = _answers(cfg)
    oos = out_of_sample_probs(cfg, labeled_rows, Path(oos_dir) if oos_dir else Path(out_dir) / "oos",
                              adapter=adapter, trained_ids=trained_ids, hw=hw)
    given = {r["sample_id"]: r["answer"] for r in labeled_rows}
    space, note = knn_space(cfg, labeled_rows, oos, selection_embeddings)
    lc = cfg.labelcheck
    det = detect_label_issues(oos.probs, [given[s] for s in oos.sample_ids], answers, sample_ids=oos.sample_ids,
                              knn=space, knn_note=note, min_oos_accuracy=lc.min_oos_accuracy, knn_k=lc.knn_k)
    table = label_issue_table(det.issues, ledger)
    agreement = annotator_agreement(ledger, oos.suggestions(answers))
    log.info("%s (%s)", det.summary(), oos.method)
    return write_label_report(out_dir, oos=oos, table=table, agreement=agreement, answers=answers,
                              verdict=det.info())


# ------------------------------------------------------------------------------------------------ open answers
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


def _score_open(cfg: ProjectConfig, adapter_dir: Path, rows: list[dict[str, Any]], out_dir: Path,
                inputs: dict[str, str], config: dict[str, Any], hw: Any) -> None:
    from pipeline.model.loading import load_model
    from pipeline.scoring import OpenAnswerScorer, save_scores

    loaded = load_model(cfg.model, adapter=adapter_dir, hw=hw)
    try:
        result = OpenAnswerScorer(loaded, max_new_tokens=cfg.model.max_new_tokens, min_new_tokens=1).score(
            rows, batch_size=cfg.select.score_batch_size, mc_passes=cfg.select.mc_dropout_passes, seed=cfg.seed)
    finally:
        del loaded
        gc.collect()
    save_scores(result, out_dir, inputs=inputs, config=config)


def out_of_sample_answers(
    cfg: ProjectConfig,
    labeled_rows: Sequence[Mapping[str, Any]],
    work_dir: str | os.PathLike[str],
    *,
    method: str | None = None,
    adapter: str | os.PathLike[str] | None = None,
    trained_ids: Iterable[str] = (),
    hw: Any = None,
    progress: bool = False,
) -> OpenOOS:
    """out_of_sample_probs for open answers: the greedy and `select.mc_dropout_passes` MC-dropout answers of models
    that never saw the rows (heldout: `adapter` on the rows not in `trained_ids`; kfold: fold adapters, folds
    stratified by the normalised answer), cached the same way."""
    from pipeline.evaluate import normalize_answer
    from pipeline.model.train import check_rows, train_adapter
    from pipeline.scoring import SCORE_VERSION, load_scores

    method = method or cfg.labelcheck.method
    rows = _check_labeled(labeled_rows, None)
    config = {**_score_config(cfg, []), "answers": None, "max_new_tokens": cfg.model.max_new_tokens,
              "mc_dropout_passes": cfg.select.mc_dropout_passes}
    parts: list[tuple[list[int], Path, dict[str, str], Path | None, list[dict[str, Any]]]] = []
    if method == "heldout":
        if adapter is None:
            raise LabelCheckError("labelcheck.method heldout needs the round's adapter (pass adapter=...); or use kfold")
        skip = set(trained_ids)
        idx = [j for j, r in enumerate(rows) if r["sample_id"] not in skip]
        info: dict[str, Any] = {"adapter": str(adapter), "scored": len(idx), "skipped_trained_on": len(rows) - len(idx)}
        folds = np.full(len(idx), -1, np.int64)
        if idx:
            held = [rows[j] for j in idx]
            parts.append((idx, Path(work_dir) / "heldout", {"rows": check_rows(held), "adapter": digest_path(adapter)},
                          Path(adapter), []))
    elif method == "kfold":
        k = cfg.labelcheck.kfold
        if k < 2 or len(rows) < k:
            raise LabelCheckError(f"k-fold label check: {len(rows)} labeled samples cannot make {k} folds; label at "
                                  f"least {k} samples or lower labelcheck.kfold (≥ 2)")
        all_folds = stratified_folds([normalize_answer(r["answer"]) for r in rows], k, cfg.seed)
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
        if find_valid_manifest(out, stage_key("score", SCORE_VERSION, inputs, config)) is None:
            if adapter_dir is None:
                adapter_dir = train_adapter(fold_config(cfg), train_rows, out.parent, hw=hw, progress=progress).adapter_dir
            _score_open(cfg, adapter_dir, [rows[j] for j in held_idx], out, inputs, config, hw)
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
    from pipeline.evaluate import normalize_answer, token_f1

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
    cfg: ProjectConfig,
    labeled_rows: Sequence[Mapping[str, Any]],
    out_dir: str | os.PathLike[str],
    ledger: Any,
    *,
    adapter: str | os.PathLike[str] | None = None,
    trained_ids: Iterable[str] = (),
    hw: Any = None,
    oos_dir: str | os.PathLike[str] | None = None,
) -> Manifest:
    """check_labels for open answers (data.answers: null): out_of_sample_answers → detect_open_label_issues → the
    same report files (oos_probs.npz holds the OPEN_COLUMNS), issue table, annotator agreement and relabel queue."""
    from pipeline.evaluate import normalize_answer

    oos = out_of_sample_answers(cfg, labeled_rows, Path(oos_dir) if oos_dir else Path(out_dir) / "oos",
                                adapter=adapter, trained_ids=trained_ids, hw=hw)
    given = {r["sample_id"]: r["answer"] for r in labeled_rows}
    det, cols = detect_open_label_issues([oos.model_answers(i) for i in range(len(oos.sample_ids))],
                                         [given[s] for s in oos.sample_ids], sample_ids=oos.sample_ids,
                                         min_oos_accuracy=cfg.labelcheck.min_oos_accuracy)
    table = label_issue_table(det.issues, ledger)
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
