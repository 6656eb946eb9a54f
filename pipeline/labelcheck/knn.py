"""The kNN label-consistency signal and the label check's verdict combining it with the model (detect_label_issues)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.labelcheck.base import LabelCheckError
from pipeline.labelcheck.calibration import agreement, apply_temperature, fit_temperature
from pipeline.labelcheck.confident_learning import (
    _ranked_issues,
    _ranking,
    calibrate_confident_joint,
    confident_joint,
    label_error_posterior,
    noise_rate,
    num_label_issues,
)
from pipeline.labelcheck.detection import (
    LOG_FLOOR,
    MIN_MODEL_ACCURACY,
    REPORT_CONFIDENCE,
    Detection,
    _check_probs,
    _label_index,
)


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

    from pipeline.faiss_threads import faiss_threads

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
    neighbours: KnnSpace | None = None,
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

    6. While the model cannot judge (steps 2-3 abstain), the neighbours judge alone: `neighbours`, a space that does
       not come from the model being checked (the selection embeddings, or the labeled images' gradient histograms:
       check.neighbour_space), takes over when its leave-one-out kNN agreement with the given labels reaches
       `min_oos_accuracy` (label noise only lowers that agreement, so it underestimates the kNN's accuracy);
       confident learning then runs on its calibrated label distributions, reporting labels at least
       NEIGHBOURS_CONFIDENCE likely wrong (_neighbours_alone). Once the model can judge, steps 2-5 decide.

    `use_model=False` judges by the kNN signal alone (a benchmark ablation; a round always uses the model)."""
    n = len(given_labels)
    p_raw = _check_probs(probs, n, answers)
    if sample_ids is not None and len(sample_ids) != n:
        raise LabelCheckError(f"label check: {len(sample_ids)} sample IDs for {n} labels")
    ids = list(sample_ids) if sample_ids is not None else [str(i) for i in range(n)]
    given = _label_index(given_labels, answers)
    if n == 0:
        return Detection([], 0, {}, None, None, 0.0, "no labels to check", min_oos_accuracy)

    signals, calibrated, clean = _signals(p_raw, given, ids, answers, knn=knn, knn_note=knn_note,
                                          use_model=use_model, min_oos_accuracy=min_oos_accuracy, knn_k=knn_k)
    a_mg = signals["model"]["accuracy"]
    if use_model and signals["model"]["estimated_accuracy"] < MIN_MODEL_ACCURACY:
        # Wrong more often than right: its disagreement means nothing, and as a rater it cannot vouch for the kNN.
        _stand_down(signals)
        why = (f"model not yet accurate enough to judge labels (OOS accuracy {a_mg:.2f}; it must be right more often "
               f"than wrong, and the check needs labelcheck.min_oos_accuracy {min_oos_accuracy:.2f})")
        return _neighbours_alone(neighbours, given, ids, answers, signals, why, min_oos_accuracy, knn_k) or Detection(
            [], n, signals, a_mg, None, 0.0, why, min_oos_accuracy, label_accuracy=clean)
    if not calibrated:
        return Detection([], n, signals, a_mg, None, 0.0, "no signal accurate enough to judge labels",
                         min_oos_accuracy)

    p = combine_signals(calibrated, given, len(answers))
    # Abstain rule: what judges (the model, or the model and kNN combined) must reach the floor, its agreement with
    # the given labels corrected for the label noise the three raters reveal.
    a_cg = agreement(p, given)
    judging = float(min(1.0, max(a_cg, a_cg / (clean or 1.0))))
    if judging < min_oos_accuracy:
        _stand_down(signals)
        with_knn = f"; with kNN label consistency {judging:.2f}" if "knn" in calibrated else ""
        why = (f"model not yet accurate enough to judge labels (OOS accuracy {a_mg:.2f}{with_knn}; the check needs "
               f"labelcheck.min_oos_accuracy {min_oos_accuracy:.2f})")
        return _neighbours_alone(neighbours, given, ids, answers, signals, why, min_oos_accuracy, knn_k) or Detection(
            [], n, signals, a_mg, None, 0.0, why, min_oos_accuracy, judging=judging, label_accuracy=clean)
    return _confident_learning(p, given, ids, answers, calibrated, signals, judging=judging, clean=clean,
                               min_oos_accuracy=min_oos_accuracy)


def _stand_down(signals: dict[str, dict[str, Any]]) -> None:
    """The check abstains: no signal took part in a verdict (the report shows each one's accuracy all the same)."""
    for s in signals.values():
        s["used"] = False


NEIGHBOURS_CONFIDENCE = 0.5  # P(label wrong) an issue needs when the neighbours judge alone (REPORT_CONFIDENCE: 0.3)


def _neighbours_alone(space: KnnSpace | None, given: np.ndarray, ids: list[str], answers: Sequence[str],
                      signals: dict[str, dict[str, Any]], why: str, min_oos_accuracy: float,
                      knn_k: int) -> Detection | None:
    """The check by neighbours alone while the model abstains (`why`): confident learning on the calibrated kNN label
    distributions of `space` when their leave-one-out agreement with the given labels reaches `min_oos_accuracy`;
    None (the caller abstains) without a space. Below the floor the kNN's report says why and the check abstains."""
    if space is None or knn_k == 0:
        return None
    p_raw = _knn_for(space, ids, given, answers, knn_k)
    p = apply_temperature(p_raw, fit_temperature(p_raw, given))
    a = agreement(p, given)
    report = {"accuracy": a, "estimated_accuracy": a, "k": knn_k, "source": space.source,
              "neighbours_from": len(space.sample_ids)}
    if a < min_oos_accuracy:
        signals["neighbours"] = {"used": False, **report, "note": (
            f"neighbours alone too weak to judge while the model is ({a:.2f} leave-one-out agreement < "
            f"labelcheck.min_oos_accuracy {min_oos_accuracy:.2f})")}
        return None
    for s in signals.values():
        s["used"] = False
    signals["neighbours"] = {"used": True, **report, "note": f"judging alone: {why}"}
    det = _confident_learning(p, given, ids, answers, {"neighbours": p}, signals, judging=a, clean=None,
                              min_oos_accuracy=min_oos_accuracy)
    # One signal, weaker than a model that can judge: only labels more likely wrong than right are reported (at the
    # model's 0.3, clean letter tiles drew 3x the false alarms, 12 vs 4 in 400 labels, for one more of 40 flips
    # found at 5 % noise: benchmarks/label_check_knn.py).
    det.issues = [i for i in det.issues if i.confidence >= NEIGHBOURS_CONFIDENCE]
    det.expected_false_alarms = float(sum(1.0 - i.confidence for i in det.issues))
    return det


def _signals(p_raw: np.ndarray, given: np.ndarray, ids: list[str], answers: Sequence[str], *, knn: KnnSpace | None,
             knn_note: str | None, use_model: bool, min_oos_accuracy: float,
             knn_k: int) -> tuple[dict[str, dict[str, Any]], dict[str, np.ndarray], float | None]:
    """(each signal's report, the calibrated probabilities of those in use, the estimated share of correct labels:
    None without a second rater). The model's is always reported; the kNN's is used when accurate enough."""
    t_m = fit_temperature(p_raw, given)
    p_m = apply_temperature(p_raw, t_m)
    a_mg = agreement(p_m, given)
    signals: dict[str, dict[str, Any]] = {"model": {"used": use_model, "accuracy": a_mg, "estimated_accuracy": a_mg,
                                                    "temperature": t_m}}
    calibrated = {"model": p_m}
    clean: float | None = None
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
    if not use_model:  # a benchmark ablation: the kNN judges alone
        calibrated.pop("model")
    return signals, calibrated, clean


def _confident_learning(p: np.ndarray, given: np.ndarray, ids: list[str], answers: Sequence[str],
                        calibrated: dict[str, np.ndarray], signals: dict[str, dict[str, Any]], *, judging: float,
                        clean: float | None, min_oos_accuracy: float) -> Detection:
    """The issues the combined probabilities `p` find (steps 4 and 5 of detect_label_issues)."""
    n, c = len(given), len(answers)
    joint = calibrate_confident_joint(confident_joint(p, given, c), given)
    eta = noise_rate(joint)
    confidence = label_error_posterior(p[np.arange(n), given], eta, c)
    # Reported: as many as the joint's off-diagonal says are wrong, lowest self-confidence first, and of those only
    # the ones with a real chance of being wrong.
    flagged = np.zeros(n, dtype=bool)
    flagged[_ranking(p, given, ids)[:num_label_issues(joint)]] = True
    flagged &= confidence >= REPORT_CONFIDENCE
    issues = _ranked_issues(p, given, flagged, confidence, answers, ids, calibrated)
    return Detection(issues, n, signals, signals["model"]["accuracy"], eta,
                     float(sum(1.0 - i.confidence for i in issues)), None, min_oos_accuracy,
                     [ids[i] for i in _ranking(p, given, ids)], judging, clean)
