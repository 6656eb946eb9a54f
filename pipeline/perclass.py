"""Per-class evaluation of a closed answer set (precision / recall / F1 / support per answer, the confusion matrix,
accuracy and macro-F1 with bootstrap intervals), per-group metrics for open answers, and the confusion-matrix PNG.

`per_class.json` is a contract: the round's HTML report reads it as written here (keys and their order of meaning
are documented in docs/use-your-model.md). The point figures come from scikit-learn; the bootstrap recomputes the
same figures from confusion counts (one `bincount` per resample), which a test checks against scikit-learn.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import DataError

PER_CLASS_FILE = "per_class.json"
PER_GROUP_FILE = "per_group.json"
CONFUSION_FILE = "confusion.png"
OTHER = "(other)"  # the confusion column of predictions outside the answer set
RESAMPLES = 1000
BOOTSTRAP_SEED = 0


def _codes(values: Sequence[str | None], answers: Sequence[str]) -> np.ndarray:
    """Index of each value in `answers`, len(answers) for anything else (None included)."""
    at = {a: i for i, a in enumerate(answers)}
    return np.array([at.get((v or "").strip(), len(answers)) for v in values], dtype=np.int64)


def _f1_from_counts(cm: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """[..., c] F1 of each answer from confusion counts [..., c, c + 1] (rows true, columns predicted, the last
    column predictions outside the set); 0 where precision or recall is undefined (scikit-learn's zero_division=0)."""
    c = cm.shape[-2]
    tp = np.diagonal(cm[..., :c], axis1=-2, axis2=-1).astype(float)
    support, predicted = cm.sum(-1), cm[..., :c].sum(-2)
    denom = support + predicted
    f1 = np.divide(2 * tp, denom, out=np.zeros_like(tp), where=denom > 0)
    return f1[..., keep]


def bootstrap_intervals(true: np.ndarray, pred: np.ndarray, n_answers: int, keep: np.ndarray, *,
                        resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> dict[str, list[float]]:
    """95 % percentile intervals of accuracy and macro-F1 over `resamples` resamples of the test rows (with
    replacement). Macro-F1 averages the answers in `keep` (those the test split holds)."""
    rng = np.random.default_rng(seed)
    n, width = len(true), n_answers + 1
    idx = rng.integers(0, n, size=(resamples, n))
    flat = true[idx] * width + pred[idx]  # [B, n] cell of each resampled row
    offsets = (np.arange(resamples) * n_answers * width)[:, None]
    cm = np.bincount((flat + offsets).ravel(), minlength=resamples * n_answers * width)
    cm = cm.reshape(resamples, n_answers, width)
    acc = (true[idx] == pred[idx]).mean(1)
    macro = _f1_from_counts(cm, keep).mean(1)
    return {name: [round(float(np.percentile(v, 2.5)), 6), round(float(np.percentile(v, 97.5)), 6)]
            for name, v in (("accuracy", acc), ("macro_f1", macro))}


def per_class_report(preds: Sequence[str | None], refs: Sequence[str], answers: Sequence[str], *,
                     resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """The per_class.json contract: answers, per-class precision / recall / F1 / support, the confusion matrix
    (rows: true answer in `answers` order; columns: `confusion_columns`, the answers plus "(other)" when a prediction
    fell outside the set), accuracy and macro-F1 (over the answers the test split holds) with 95 % bootstrap
    intervals, n and the bootstrap's settings."""
    from sklearn.metrics import confusion_matrix, precision_recall_fscore_support

    answers = list(answers)
    if len(preds) != len(refs) or not refs:
        raise DataError(f"per-class metrics need one prediction per test row: {len(preds)} predictions, "
                        f"{len(refs)} references")
    true, pred = _codes(refs, answers), _codes(preds, answers)
    if (true == len(answers)).any():
        bad = sorted({r for r, t in zip(refs, true, strict=True) if t == len(answers)})
        raise DataError(f"test answers outside data.answers: {bad[:5]} ({int((true == len(answers)).sum())} rows); "
                        "fix those labels or add the answers to data.answers")
    other = bool((pred == len(answers)).any())
    labels = list(range(len(answers) + other))
    cm = confusion_matrix(true, pred, labels=labels)[: len(answers)]
    p, r, f, s = precision_recall_fscore_support(true, pred, labels=list(range(len(answers))), zero_division=0)
    keep = s > 0
    macro = float(f[keep].mean())
    full = np.zeros((len(answers), len(answers) + 1), dtype=np.int64)
    full[:, : cm.shape[1]] = cm
    ci = bootstrap_intervals(true, pred, len(answers), keep, resamples=resamples, seed=seed)
    return {
        "answers": answers,
        "per_class": [{"answer": a, "precision": round(float(pi), 6), "recall": round(float(ri), 6),
                       "f1": round(float(fi), 6), "support": int(si)}
                      for a, pi, ri, fi, si in zip(answers, p, r, f, s, strict=True)],
        "confusion": cm.astype(int).tolist(),
        "confusion_columns": answers + [OTHER] * other,
        "accuracy": round(float((true == pred).mean()), 6),
        "accuracy_ci95": ci["accuracy"],
        "macro_f1": round(macro, 6),
        "macro_f1_ci95": ci["macro_f1"],
        "n": len(refs),
        "bootstrap": {"resamples": resamples, "seed": seed},
    }


def mean_interval(values: Sequence[float], *, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> list[float]:
    """95 % bootstrap interval of the mean of per-row scores."""
    v = np.asarray(values, dtype=float)
    means = v[np.random.default_rng(seed).integers(0, len(v), size=(resamples, len(v)))].mean(1)
    return [round(float(np.percentile(means, 2.5)), 6), round(float(np.percentile(means, 97.5)), 6)]


def length_bucket(answer: str) -> str:
    words = len(answer.split())
    return "1 word" if words <= 1 else "2-3 words" if words <= 3 else "4+ words"


def per_group_report(rows: Sequence[Mapping[str, Any]], row_scores: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """Open answers: each metric's mean per question when the test split asks several, else per length bucket of
    the reference answer (1 word, 2-3, 4+), with its row count."""
    questions = [str(r.get("question") or "") for r in rows]
    by = "question" if len(set(questions)) > 1 else "answer_length"
    keys = questions if by == "question" else [length_bucket(str(r["answer"])) for r in rows]
    groups = []
    for g in sorted(set(keys)):
        at = [i for i, k in enumerate(keys) if k == g]
        groups.append({"group": g, "n": len(at),
                       **{m: round(float(np.mean([v[i] for i in at])), 6) for m, v in row_scores.items()}})
    return {"by": by, "metrics": list(row_scores), "groups": groups, "n": len(rows)}


def plot_confusion(report: Mapping[str, Any], out_png: str | os.PathLike[str]) -> Path:
    """The confusion matrix as a PNG (counts in the cells, rows true, columns predicted)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and workers
    import matplotlib.pyplot as plt
    from sklearn.metrics import ConfusionMatrixDisplay

    from pipeline.store import atomic_write_bytes

    cm = np.array(report["confusion"])
    rows, cols = report["answers"], report["confusion_columns"]
    side = min(14.0, 2.5 + 0.45 * len(cols))
    fig, ax = plt.subplots(figsize=(side, side * 0.85), dpi=100)
    try:
        # ConfusionMatrixDisplay wants a square matrix: the "(other)" column gets an all-zero row it then hides.
        square = np.zeros((len(cols), len(cols)), dtype=int)
        square[: len(rows)] = cm
        disp = ConfusionMatrixDisplay(square, display_labels=cols)
        disp.plot(ax=ax, cmap="Blues", colorbar=False, values_format="d", xticks_rotation=45)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        for text in disp.text_[len(rows):].ravel():
            text.set_visible(False)
        plt.setp(ax.get_xticklabels(), ha="right", rotation_mode="anchor")
        ax.set_ylabel("true answer")
        ax.set_xlabel("predicted answer")
        ax.set_title(f"Confusion matrix (n = {report['n']}, accuracy {report['accuracy']:.3f})")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", metadata={"Software": None})  # same counts, same bytes
    finally:
        plt.close(fig)
    return atomic_write_bytes(out_png, buf.getvalue())


@dataclass(frozen=True)
class EvalReport:
    """What an evaluation folder holds beyond metrics.json, for the summary, `tamis status` and the UI."""

    dir: Path
    per_class: dict[str, Any] | None
    per_group: dict[str, Any] | None

    @property
    def confusion_png(self) -> Path | None:
        path = self.dir / CONFUSION_FILE
        return path if path.is_file() else None


def load_eval_report(eval_dir: str | os.PathLike[str] | None) -> EvalReport | None:
    """The per-class (closed) or per-group (open) report of an evaluation folder; None when it has neither (an
    evaluation of older code, or no folder)."""
    if not eval_dir:
        return None
    folder = Path(eval_dir)

    def read(name: str) -> dict[str, Any] | None:
        path = folder / name
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

    report = EvalReport(folder, read(PER_CLASS_FILE), read(PER_GROUP_FILE))
    return report if report.per_class or report.per_group else None
