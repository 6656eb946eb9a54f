"""Calibration of out-of-sample probabilities: temperature scaling and a signal's agreement with the labels."""

from __future__ import annotations

import numpy as np

from pipeline.labelcheck.detection import LOG_FLOOR, TEMPERATURE_BOUNDS


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
