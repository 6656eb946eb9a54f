"""Per-class evaluation of a closed answer set (precision / recall / F1 / support per answer, the confusion matrix,
accuracy and macro-F1 with bootstrap intervals), per-group metrics for open answers, and the confusion-matrix PNG.

`per_class.json` is a contract: the round's HTML report reads it as written here (keys and their order of meaning
are documented in docs/use-your-model.md). The point figures come from scikit-learn; the bootstrap recomputes the
same figures from per-answer counts (true positives, support, predictions) in chunks of resamples, which a test
checks against scikit-learn.
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
BOX_PER_CLASS_FILE = "box_per_class.json"  # a box project's per-class AP (pipeline.evaluate writes it; box_map's rows)
CONFUSION_FILE = "confusion.png"
OTHER = "(other)"  # the confusion column of predictions outside the answer set
RESAMPLES = 1000
BOOTSTRAP_SEED = 0


def _codes(values: Sequence[str | None], answers: Sequence[str]) -> np.ndarray:
    """Index of each value in `answers`, len(answers) for anything else (None included)."""
    at = {a: i for i, a in enumerate(answers)}
    return np.array([at.get((v or "").strip(), len(answers)) for v in values], dtype=np.int64)


BOOTSTRAP_CELLS = 1 << 18  # values per array per chunk of resamples: memory stays flat (a few MB) at any size


def _f1_from_counts(tp: np.ndarray, support: np.ndarray, predicted: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """[..., c] F1 of each answer from its true positives, support (true rows) and predictions of it; 0 where
    precision or recall is undefined (scikit-learn's zero_division=0). Columns restricted to `keep`."""
    tp = tp.astype(float)
    denom = (support + predicted).astype(float)
    f1 = np.divide(2 * tp, denom, out=np.zeros_like(tp), where=denom > 0)
    return f1[..., keep]


def _row_counts(codes: np.ndarray, width: int) -> np.ndarray:
    """[b, width] count of each code on each row of `codes` [b, n] (one `bincount` with a per-row offset)."""
    b = codes.shape[0]
    offsets = (np.arange(b, dtype=np.int64) * width)[:, None]
    return np.bincount((codes + offsets).ravel(), minlength=b * width).reshape(b, width)


def bootstrap_intervals(true: np.ndarray, pred: np.ndarray, n_answers: int, keep: np.ndarray, *,
                        resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> dict[str, list[float]]:
    """95 % percentile intervals of accuracy and macro-F1 over `resamples` resamples of the test rows (with
    replacement). Macro-F1 averages the answers in `keep` (those the test split holds).

    F1 needs only three counts per answer (true positives, support, predictions), not the whole confusion matrix:
    a [resamples, c, c + 1] matrix took 1.3 GB at 400 answers and grew with their square. The resamples are drawn
    in chunks of about BOOTSTRAP_CELLS values; the generator yields the same stream however its draws are split,
    so a seed gives the same intervals as one [resamples, n] draw."""
    rng = np.random.default_rng(seed)
    n, width = len(true), n_answers + 1
    chunk = max(1, BOOTSTRAP_CELLS // max(n, width))
    acc, macro = np.empty(resamples), np.empty(resamples)
    for start in range(0, resamples, chunk):
        b = min(chunk, resamples - start)
        idx = rng.integers(0, n, size=(b, n))
        t, p = true[idx], pred[idx]
        del idx
        hit = t == p
        acc[start: start + b] = hit.mean(1)
        tp = _row_counts(np.where(hit, t, n_answers), width)[:, :n_answers]  # misses land in the spare column
        support = _row_counts(t, width)[:, :n_answers]
        predicted = _row_counts(p, width)[:, :n_answers]
        macro[start: start + b] = _f1_from_counts(tp, support, predicted, keep).mean(1)
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
    """95 % bootstrap interval of the mean of per-row scores, drawn in chunks as bootstrap_intervals draws."""
    v = np.asarray(values, dtype=float)
    rng, n = np.random.default_rng(seed), len(v)
    chunk = max(1, BOOTSTRAP_CELLS // max(n, 1))
    means = np.concatenate([v[rng.integers(0, n, size=(min(chunk, resamples - start), n))].mean(1)
                            for start in range(0, resamples, chunk)])
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


CONFUSION_MATRIX_MAX = 30  # answers up to which the picture is the whole matrix; above, cells are too small to read
CONFUSION_TOP = 20  # confusions the picture ranks above CONFUSION_MATRIX_MAX answers
LABEL_CHARS = 32  # an answer's name on the picture, cut beyond this


def _short(name: str) -> str:
    return name if len(name) <= LABEL_CHARS else name[: LABEL_CHARS - 1] + "…"


def top_confusions(report: Mapping[str, Any], k: int = CONFUSION_TOP) -> list[tuple[str, str, int, int]]:
    """The `k` largest off-diagonal cells of the confusion matrix as (true answer, predicted answer, count, support
    of the true answer), largest first (ties in matrix order, so the same report gives the same list)."""
    cm = np.array(report["confusion"], dtype=np.int64)
    rows, cols = report["answers"], report["confusion_columns"]
    off = cm.copy()
    np.fill_diagonal(off[:, : len(rows)], 0)
    flat = off.ravel()
    order = np.argsort(-flat, kind="stable")[:k]
    support = cm.sum(1)
    return [(rows[i // len(cols)], cols[i % len(cols)], int(flat[i]), int(support[i // len(cols)]))
            for i in order if flat[i] > 0]


def _draw_matrix(ax: Any, report: Mapping[str, Any]) -> None:
    from sklearn.metrics import ConfusionMatrixDisplay

    cm = np.array(report["confusion"])
    rows, cols = report["answers"], report["confusion_columns"]
    # ConfusionMatrixDisplay wants a square matrix: the "(other)" column gets an all-zero row it then hides.
    square = np.zeros((len(cols), len(cols)), dtype=int)
    square[: len(rows)] = cm
    disp = ConfusionMatrixDisplay(square, display_labels=[_short(c) for c in cols])
    disp.plot(ax=ax, cmap="Blues", colorbar=False, values_format="d", xticks_rotation=45)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    for text in disp.text_[len(rows):].ravel():
        text.set_visible(False)
    import matplotlib.pyplot as plt

    plt.setp(ax.get_xticklabels(), ha="right", rotation_mode="anchor")
    ax.set_ylabel("true answer")
    ax.set_xlabel("predicted answer")
    ax.set_title(f"Confusion matrix (n = {report['n']}, accuracy {report['accuracy']:.3f})")


def _draw_top(ax: Any, report: Mapping[str, Any], pairs: Sequence[tuple[str, str, int, int]]) -> None:
    """A ranked bar chart of the largest confusions: one readable row per pair instead of every cell."""
    labels = [f"{_short(t)} → {_short(p)}" for t, p, _, _ in pairs]
    counts = [c for _, _, c, _ in pairs]
    y = np.arange(len(pairs))
    ax.barh(y, counts, color="#4c72b0")
    ax.set_yticks(y, labels, fontsize=9)
    ax.invert_yaxis()  # the largest confusion on top
    for k, (_, _, c, support) in enumerate(pairs):
        ax.text(c, k, f" {c} ({c / support:.0%} of its true rows)" if support else f" {c}", va="center",
                fontsize=8)
    ax.set_xlim(0, max(counts, default=1) * 1.45)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # counts of rows: no 2.5 ticks
    ax.set_xlabel("test rows (true answer → predicted answer)")
    ax.set_title(f"Top {len(pairs)} confusions of {len(report['answers'])} answers (n = {report['n']}, accuracy "
                 f"{report['accuracy']:.3f}); per_class.json holds the whole matrix", fontsize=10)


def confusion_figure(report: Mapping[str, Any]) -> Any:
    """The confusion picture as a matplotlib Figure (the caller closes it): the whole matrix up to
    CONFUSION_MATRIX_MAX answers, else the CONFUSION_TOP largest confusions ranked (a 200-answer matrix took 31 s
    to draw, weighed 1.9 MB and could not be read)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and workers
    import matplotlib.pyplot as plt

    cols = report["confusion_columns"]
    if len(cols) <= CONFUSION_MATRIX_MAX:
        side = min(14.0, 2.5 + 0.45 * len(cols))
        fig, ax = plt.subplots(figsize=(side, side * 0.85), dpi=100)
        _draw_matrix(ax, report)
    else:
        pairs = top_confusions(report)
        fig, ax = plt.subplots(figsize=(10, 1.5 + 0.32 * max(len(pairs), 1)), dpi=100)
        _draw_top(ax, report, pairs)
    fig.tight_layout()
    return fig


def plot_confusion(report: Mapping[str, Any], out_png: str | os.PathLike[str]) -> Path:
    """confusion_figure written as a PNG."""
    from pipeline.store import atomic_write_bytes

    fig = confusion_figure(report)
    import matplotlib.pyplot as plt

    try:
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
    fields: dict[str, Any] | None = None  # per_class.json of structured answers: its `fields` (pipeline/fields/metrics.py)
    per_box_class: list[dict[str, Any]] | None = None  # box projects: [{label, ap50, ap, their ci95, support}]

    @property
    def confusion_png(self) -> Path | None:
        path = self.dir / CONFUSION_FILE
        return path if path.is_file() else None


def load_eval_report(eval_dir: str | os.PathLike[str] | None) -> EvalReport | None:
    """The per-class (closed answers), per-group (open answers) or per-class AP (boxes) report of an evaluation
    folder; None when it has none (an evaluation of older code, or no folder)."""
    if not eval_dir:
        return None
    folder = Path(eval_dir)

    def read(name: str) -> dict[str, Any] | None:
        path = folder / name
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

    per_class = read(PER_CLASS_FILE)
    fields = per_class if per_class is not None and "fields" in per_class else None
    report = EvalReport(folder, None if fields else per_class, read(PER_GROUP_FILE), fields,
                        read(BOX_PER_CLASS_FILE))
    return report if report.per_class or report.per_group or report.fields or report.per_box_class else None
