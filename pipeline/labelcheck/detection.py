"""Label-error detection: what an issue is, what one check concluded (Detection), and the input checks every
detector shares (probabilities, labels)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.labelcheck.base import PROB_TOL, LabelCheckError

SIGNALS = ("model", "knn", "neighbours")  # neighbours: the kNN judging alone while the model abstains


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


def false_alarm_text(expected: float) -> str:
    """"about N of these may be correct labels", from the expected false alarms (Σ P(label right) over the issues)."""
    if expected < 0.5:
        return f"probably none of these is a correct label (expected false alarms {expected:.1f})"
    return f"about {round(expected)} of these may be correct labels (expected false alarms {expected:.1f})"
