"""Confident learning (Northcutt et al. 2021) on one probability matrix: the confident joint, its noise-rate
estimate, which labels it prunes, and the posterior that a label is wrong."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pipeline.labelcheck.base import LabelCheckError
from pipeline.labelcheck.detection import LOG_FLOOR, Issue, _check_probs, _label_index


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
