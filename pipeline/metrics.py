"""The metrics log (artifacts/metrics.jsonl, append-only) and the learning curve drawn from it."""

from __future__ import annotations

import io
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import DataError
from pipeline.store import append_jsonl, atomic_write_bytes, read_jsonl

METRICS_NAME = "metrics.jsonl"
METRIC_KEYS = ("round", "labels", "metric", "value", "strategy")


def append_metrics(artifacts: str | os.PathLike[str], row: Mapping[str, Any]) -> dict[str, Any]:
    """Append one metric value of one round to artifacts/metrics.jsonl (append-only, fsync'd)."""
    missing = [k for k in METRIC_KEYS if k not in row]
    if missing:
        raise DataError(f"metrics row lacks {', '.join(missing)} (needs {', '.join(METRIC_KEYS)}): {dict(row)}")
    out = dict(row)
    out["value"] = float(out["value"])
    out.setdefault("time", time.time())
    append_jsonl(Path(artifacts) / METRICS_NAME, [out])
    return out


def read_metrics(artifacts: str | os.PathLike[str]) -> list[dict[str, Any]]:
    return read_jsonl(Path(artifacts) / METRICS_NAME)


def merge_equal_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """Metrics with the same value under one joined name, in first-seen order: on a closed answer set accuracy and
    exact match are usually the same number, shown once as `accuracy = exact_match`."""
    groups: dict[float, list[str]] = {}
    for name, value in metrics.items():
        groups.setdefault(float(value), []).append(name)
    return {" = ".join(names): value for value, names in groups.items()}


def plot_learning_curve(
    rows: Sequence[Mapping[str, Any]], out_png: str | os.PathLike[str], *, metric: str | None = None
) -> Path:
    """Metric vs number of labels, one line per strategy; `metric` defaults to the first one logged."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and workers
    import matplotlib.pyplot as plt

    if not rows:
        raise DataError(f"no metrics to plot into {out_png}: no round has been evaluated yet")
    metric = metric or rows[0]["metric"]
    lines: dict[str, dict[int, float]] = {}
    for r in rows:
        if r["metric"] == metric:
            # A re-evaluated round replaces its earlier value (the log is append-only, newest wins).
            lines.setdefault(str(r.get("strategy") or "?"), {})[int(r["labels"])] = float(r["value"])
    if not lines:
        raise DataError(f"no rows for metric {metric!r}; logged: {', '.join(sorted({r['metric'] for r in rows}))}")
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    try:
        for strategy, pts in sorted(lines.items()):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker="o", label=strategy)
        ax.set_xlabel("labeled samples")
        ax.set_ylabel(metric)
        ax.set_title(f"Learning curve ({metric})")
        ax.grid(True, alpha=0.3)
        if len(lines) > 1:
            ax.legend()
        buf = io.BytesIO()
        # No timestamp / software metadata, so the same metrics give the same bytes.
        fig.savefig(buf, format="png", metadata={"Software": None})
    finally:
        plt.close(fig)
    return atomic_write_bytes(out_png, buf.getvalue())


def book_metrics(artifacts: str | os.PathLike[str], *, round_index: int, labels: int, metrics: Mapping[str, float],
                 strategy: str) -> None:
    """Log a round's evaluation once: a re-run of the round (or a resumed one) appends nothing it already holds."""
    recorded = {(m["round"], m["metric"]) for m in read_metrics(artifacts)}
    for name, value in metrics.items():
        if (round_index, name) not in recorded:
            append_metrics(artifacts, {"round": round_index, "labels": labels, "metric": name, "value": value,
                                       "strategy": strategy})


CURVE_FILE = "learning_curve.png"


def learning_curve(artifacts: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]]) -> Path | None:
    """The project's learning curve (artifacts/learning_curve.png) from the metrics log; None before any metric."""
    return plot_learning_curve(rows, Path(artifacts) / CURVE_FILE) if rows else None
