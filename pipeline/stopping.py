"""Stopping without labels: how much successive adapters agree on a fixed, never-selected stop set.

"Stabilizing predictions" (Bloodgood & Vijay-Shanker 2009): once the models of successive rounds predict the same
answers on a large unlabeled stop set (Cohen's kappa >= 0.99 over a few rounds), more labels stop changing the
model. Bloodgood & Grothendieck (arXiv:1504.06329) bound the change of the F-score between two such models by
4(1 - kappa) / kappa. Nothing here reads a test label.

A fixed kappa does not fit every pool: the digits probe's disagreement keeps falling past 0.99 long after its
accuracy stopped rising (6.8 rounds late at 0.99 × 3), while a VLM's retraining noise can hold it at a floor
below 0.97 for good. `converged_reason` (rounds.stop_when_converged, the default) reads the trend instead: the
disagreement of the last rounds fitted as geometric decay forecasts how much of the stop set later rounds would
still change, and a disagreement that has stopped falling is at its floor.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import ConvergedRule
from pipeline.meaning import normalize_answer
from pipeline.store import atomic_write_json

STOPSET_FILE = "stopset.json"
STOPSET = "stopset"  # round_dir/stopset/: its pool file for the scoring


def stop_set(pool_ids: Sequence[str], size: int, seed: int) -> list[str]:
    """A seeded sample of `size` pool samples (sorted IDs): the same every round while the pool stays the same."""
    ids = sorted(pool_ids)
    if size <= 0 or not ids:
        return []
    pick = np.random.default_rng(seed).choice(len(ids), min(size, len(ids)), replace=False)
    return sorted(ids[i] for i in pick)


def cohen_kappa(a: Sequence[Any], b: Sequence[Any]) -> float:
    """Cohen's kappa of two label sequences (1.0 when both are one and the same constant)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"kappa needs two equally long, non-empty sequences; got {len(a)} and {len(b)}")
    labels = sorted(set(a) | set(b), key=str)
    index = {lab: i for i, lab in enumerate(labels)}
    m = np.zeros((len(labels), len(labels)))
    for x, y in zip(a, b, strict=True):
        m[index[x], index[y]] += 1
    n = m.sum()
    observed = np.trace(m) / n
    expected = float((m.sum(0) * m.sum(1)).sum()) / n**2
    return 1.0 if expected == 1 else float((observed - expected) / (1 - expected))


def agreement(previous: Sequence[Any], current: Sequence[Any], *, closed: bool) -> dict[str, float]:
    """How two rounds' predictions on the stop set agree: kappa for closed answers (and the F-score change bound),
    the share of equal normalised answers for open ones (kappa does not apply to free text)."""
    if closed:
        k = cohen_kappa(list(previous), list(current))
        # No bound at kappa <= 0 (None, not inf: round.json stays standard JSON, which has no Infinity).
        bound = round(4 * (1 - k) / k, 6) if k > 0 else None
        return {"agreement": round(k, 6), "kappa": round(k, 6), "f_change_bound": bound}
    same = [normalize_answer(x) == normalize_answer(y) for x, y in zip(previous, current, strict=True)]
    return {"agreement": round(float(np.mean(same)), 6)}


def forecast(history: Sequence[float], target: float) -> tuple[int | None, str]:
    """(rounds until `target`, the sentence the summary prints) from the disagreement's trend: log(1 - agreement)
    fitted linearly over the rounds so far."""
    if history and history[-1] >= target:
        return 0, f"stable: agreement {history[-1]:.4f} ≥ {target}"
    if len(history) < 2:
        return None, "too few rounds for a trend (needs two agreements)"
    y = np.log(np.maximum(1 - np.asarray(history[-4:], dtype=float), 1e-9))
    slope = float(np.polyfit(np.arange(len(y)), y, 1)[0])
    if slope >= 0:
        return None, f"no trend toward stability yet (agreement {history[-1]:.4f}, not rising)"
    n = max(1, math.ceil((math.log(1 - target) - y[-1]) / slope))
    return n, f"stable in about {n} rounds at this trend (agreement {history[-1]:.4f} → {target})"


def remaining_change(history: Sequence[float], *, n: int, window: int = 6) -> tuple[float | None, float | None]:
    """(forecast share of stop-set answers that all later rounds will still change, the disagreement's ratio per
    round): the last `window` disagreements 1 - agreement fitted as d·q^t and summed beyond the last, d·q/(1-q).
    None before three agreements. inf when the disagreement is not falling: q >= 1, or its fitted fall over the
    window is under one standard error of a disagreement measured on n samples (sqrt(d(1-d)/n)), so what looks
    like a trend is the stop set's sampling noise. A disagreement below half a stop-set answer (0.5 / n) cannot be
    measured, so it counts as that."""
    if len(history) < 3:
        return None, None
    n = max(n, 1)
    d = np.maximum(1 - np.asarray(history[-window:], dtype=float), 0.5 / n)
    q = math.exp(float(np.polyfit(np.arange(len(d)), np.log(d), 1)[0]))
    last = float(d[-1])
    fall = last * (q ** -(len(d) - 1) - 1)  # the fitted curve's drop from the window's first round to its last
    if q >= 1 or fall < math.sqrt(max(last * (1 - last), 0.5 / n) / n):
        return math.inf, q
    return last * q / (1 - q), q


def converged_reason(stability: Mapping[str, Any] | None, rule: ConvergedRule | None) -> str | None:
    """Why to stop on `rounds.stop_when_converged`, or None: the forecast change still to come is at most
    rule.remaining_change, or the disagreement has not fallen over rule.window rounds (its floor)."""
    if rule is None or not stability:
        return None
    history = stability.get("history", [])
    left, q = remaining_change(history, n=int(stability.get("n") or 0), window=rule.window)
    if left is None or q is None:
        return None
    d = 1 - history[-1]
    if math.isinf(left):
        if len(history) < rule.window:
            return None
        return (f"converged: the stop set's disagreement between successive adapters stopped falling over the last "
                f"{rule.window} rounds (by no more than its sampling noise; now {d:.4f}): more labels move the "
                "answers only at that floor (rounds.stop_when_converged)")
    if left <= rule.remaining_change:
        return (f"converged: forecast {left:.3f} of the stop set's answers left to change over all later rounds ≤ "
                f"rounds.stop_when_converged.remaining_change = {rule.remaining_change} (disagreement {d:.4f}, "
                f"×{q:.2f} a round)")
    return None


def record_stop_set(round_dir: str | os.PathLike[str], previous_dir: str | os.PathLike[str] | None, *,
                    ids: Sequence[str], predictions: Sequence[Any], closed: bool, target: float) -> dict[str, Any]:
    """Write this round's stop-set predictions (round_dir/stopset.json) and compare them with the previous round's:
    {n, agreement?, kappa?, f_change_bound?, history, rounds_to_stable, remaining_change?, forecast}."""
    prev = _read(previous_dir)
    out: dict[str, Any] = {"n": len(ids)}
    if prev is not None and prev["ids"] == list(ids):
        out.update(agreement(prev["predictions"], predictions, closed=closed))
        out["history"] = [*prev.get("history", []), out["agreement"]]
    else:  # the first round with an adapter, or a pool that changed: no comparison yet
        out["history"] = []
    out["rounds_to_stable"], out["forecast"] = forecast(out["history"], target)
    left, _ = remaining_change(out["history"], n=len(ids))
    if left is not None:
        out["remaining_change"] = None if math.isinf(left) else round(left, 4)
        out["forecast"] += ("; disagreement not falling (at its floor)" if math.isinf(left) else
                            f"; forecast change still to come: {left:.3f} of the stop set's answers")
    atomic_write_json(Path(round_dir) / STOPSET_FILE, {"ids": list(ids), "predictions": list(predictions),
                                                       "history": out["history"]})
    return out


def _read(round_dir: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    path = Path(round_dir) / STOPSET_FILE if round_dir is not None else None
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def stable_reason(stability: Mapping[str, Any] | None, rule: Any) -> str | None:
    """Why to stop on `rounds.stop_when_stable`, or None: the last `window` agreements all reached the target."""
    if rule is None or not stability:
        return None
    recent = stability.get("history", [])[-rule.window:]
    if len(recent) == rule.window and min(recent) >= rule.agreement:
        return (f"stable predictions: the stop set's agreement between successive adapters ≥ "
                f"{rule.agreement} for {rule.window} rounds (rounds.stop_when_stable; last {recent[-1]:.4f})")
    return None


def measure_stop_set(shard_refs: Sequence[Mapping[str, Any]], *, ids: Sequence[str], answers: list[str] | None,
                     round_dir: str | os.PathLike[str], previous_dir: str | os.PathLike[str] | None,
                     target: float) -> dict[str, Any]:
    """The stop set's predictions by this round's adapter (from its scored shards), recorded and compared with the
    previous round's (`record_stop_set`)."""
    from pipeline.scoring import concat_scores, load_scores, predictions

    scores = concat_scores([load_scores(r["dir"]) for r in shard_refs])
    answer_of = dict(zip(scores.sample_ids, predictions(scores, answers)[0], strict=True))
    return record_stop_set(round_dir, previous_dir, ids=ids, predictions=[answer_of[s] for s in ids],
                           closed=bool(answers), target=target)
