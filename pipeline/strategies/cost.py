"""Annotation cost: a model of the seconds a label takes, and gain per predicted second (`select.cost: predicted`).

Labeling teams pay for hours, not labels, and the seconds a label takes vary per sample (Settles, Craven &
Friedland 2008); ranking by expected gain per predicted second is the return-on-investment rule of Haertel et al.
2008. The cost model is refitted every round on the labeled samples' recorded seconds (the ledger's times) with
the features the round already has (selection embeddings, model confidence, image size, question length when
given): ridge regression on log-seconds (annotation times are right-skewed and their noise is multiplicative),
its regularisation chosen by efficient leave-one-out CV inside each training fold (RidgeCV), its error measured
by k-fold cross-validation.

It is used only when it predicts: with fewer than `min_timed` timed labels, or a cross-validated R² (of
log-seconds) below `min_r2`, selection stays cost-blind and the report says why. Seconds no feature explains must
not buy a fake gain: a model fitted to noise would still rank some samples "cheap", and picking those is picking
by noise.

How a selector spends a predicted cost ĉ_i (`Selector.cost_use`):
- "scores": it ranks by the scores it is given (top_k, stratified, cluster_margin), so it gets
  gain_i = s_i / ĉ_i (s_i the heuristic's score, shifted by -min(s) first if any is negative);
- "own": its gain is not the score (k-center's distance, a coverage gain), so it divides its own greedy gain by
  ĉ_i at each step: k-center d_i / ĉ_i, MaxHerding and ProbCover marginal coverage gain / ĉ_i, TypiClust the
  typicality / ĉ_i of the members of the cluster it visits;
- "none": it has no gain to divide (the legacy `typical` cold start): cost-blind, and the selection says so.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.errors import SelectionError

log = logging.getLogger(__name__)

FOLDS = 5
ALPHAS = np.logspace(-3, 4, 15)


@dataclass
class CostModel:
    """Predicted seconds per sample; `usable` False means cost-blind (the report's `reason` says why)."""

    usable: bool
    report: dict[str, Any] = field(default_factory=dict)
    _model: Any = None
    _smear: float = 1.0  # Duan's smearing factor: mean of exp(residual), turns predicted log-seconds into seconds
    _median: float = 0.0

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Expected seconds per row of `features` (the median recorded seconds for every row when not usable)."""
        x = np.asarray(features, dtype=np.float64)
        if not self.usable or self._model is None:
            return np.full(len(x), self._median if self._median > 0 else 1.0)
        return np.exp(self._model.predict(x)) * self._smear


def features(*parts: np.ndarray | None) -> np.ndarray:
    """Feature columns side by side ([n, d] arrays or [n] vectors); None parts (not known this round) are left out."""
    cols = [np.asarray(p, dtype=np.float64).reshape(len(p), -1) for p in parts if p is not None]
    if not cols:
        raise SelectionError("cost model: no features (selection embeddings, confidence...) to predict seconds from")
    return np.concatenate(cols, axis=1)


def seconds_per_sample(times: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Median recorded seconds per sample (a sample labeled by two annotators, or re-labeled, has several)."""
    by: dict[str, list[float]] = {}
    for r in times:
        s = float(r["seconds"])
        if np.isfinite(s) and s > 0:
            by.setdefault(r["sample_id"], []).append(s)
    return {sid: float(np.median(v)) for sid, v in by.items()}


def fit_cost_model(x: np.ndarray, seconds: np.ndarray, *, min_timed: int = 20, min_r2: float = 0.05,
                   seed: int = 0) -> CostModel:
    """Fit log-seconds ~ ridge(x) on the timed labeled samples, with its k-fold cross-validated error.

    The report holds n, the CV R² of log-seconds, the CV mean absolute error in seconds and that of always
    predicting the median (the cost-blind guess), the ridge alpha, and `status` (predicted / cost-blind) with the
    reason.
    """
    from sklearn.linear_model import RidgeCV
    from sklearn.metrics import r2_score
    from sklearn.model_selection import KFold, cross_val_predict
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x = np.asarray(x, dtype=np.float64)
    y_s = np.asarray(seconds, dtype=np.float64)
    if x.ndim != 2 or len(x) != len(y_s):
        raise SelectionError(f"cost model: features must be [n, d] with one row per timed label; got {x.shape} for "
                             f"{len(y_s)} times")
    ok = np.isfinite(y_s) & (y_s > 0) & np.isfinite(x).all(axis=1)
    x, y_s = x[ok], y_s[ok]
    n = len(y_s)
    median = float(np.median(y_s)) if n else 0.0
    report: dict[str, Any] = {"n": n, "min_timed": min_timed, "median_s": round(median, 2)}
    if n < max(min_timed, FOLDS):
        report.update(status="cost-blind", reason=f"{n} timed labels < select.cost_min_timed = {min_timed}")
        return CostModel(False, report, _median=median)
    y = np.log(y_s)
    model = make_pipeline(StandardScaler(), RidgeCV(alphas=ALPHAS))
    cv = KFold(FOLDS, shuffle=True, random_state=seed % (2**32))
    pred = cross_val_predict(model, x, y, cv=cv)
    r2 = float(r2_score(y, pred))
    model.fit(x, y)
    smear = float(np.mean(np.exp(y - model.predict(x))))
    mae = float(np.mean(np.abs(np.exp(pred) * smear - y_s)))
    mae0 = float(np.mean(np.abs(y_s - median)))
    report.update(cv_r2=round(r2, 4), cv_mae_s=round(mae, 2), median_mae_s=round(mae0, 2),
                  alpha=float(model[-1].alpha_), folds=FOLDS)
    if r2 < min_r2:
        report.update(status="cost-blind", reason=f"the features do not predict the seconds: CV R² {r2:.3f} < "
                                                  f"select.cost_min_r2 = {min_r2}")
        return CostModel(False, report, _median=median)
    report.update(status="predicted", reason=f"CV R² {r2:.3f} ≥ {min_r2} on {n} timed labels")
    return CostModel(True, report, model, smear, median)


def gain_per_second(scores: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """s_i / ĉ_i for selectors that rank by their scores; scores shifted by -min first when any is negative."""
    s = np.asarray(scores, dtype=np.float64)
    lo = float(s.min()) if len(s) else 0.0
    return (s - min(lo, 0.0)) / costs


def check_costs(costs: Any, n: int) -> np.ndarray:
    c = np.asarray(costs, dtype=np.float64)
    if c.shape != (n,):
        raise SelectionError(f"select: costs must have shape [{n}] like the candidates, got {c.shape}")
    bad = ~(np.isfinite(c) & (c > 0))
    if bad.any():
        raise SelectionError(f"select: {int(bad.sum())} of {n} predicted costs are not positive finite seconds "
                             f"(first at row {int(np.flatnonzero(bad)[0])}); check the cost model's features")
    return c


def round_costs(ids: Sequence[str], x: np.ndarray, labeled: Sequence[str], seconds: Mapping[str, float], *,
                min_timed: int, min_r2: float, seed: int) -> tuple[np.ndarray | None, CostModel]:
    """Fit the round's cost model on the labeled samples among `ids` that have recorded seconds, and predict every
    row of `x` (row-aligned with `ids`); costs are None when the model is not usable (cost-blind)."""
    at = {s: i for i, s in enumerate(ids)}
    timed = [s for s in sorted(set(labeled)) if s in seconds and s in at]
    rows = [at[s] for s in timed]
    model = fit_cost_model(x[rows], np.array([seconds[s] for s in timed]), min_timed=min_timed, min_r2=min_r2,
                           seed=seed)
    if not model.usable:
        log.info("select.cost predicted: cost-blind ranking this round (%s)", model.report["reason"])
        return None, model
    log.info("select.cost predicted: %s", model.report["reason"])
    return model.predict(x), model


def forecast_hours(model: CostModel, x: np.ndarray) -> float:
    """Predicted annotator-hours of labeling the rows of `x` (a batch)."""
    return float(model.predict(x).sum()) / 3600
