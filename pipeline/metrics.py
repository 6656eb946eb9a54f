"""The metrics log (artifacts/metrics.jsonl, append-only) and the learning curve drawn from it."""

from __future__ import annotations

import io
import os
import tempfile
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
    """The project's metrics series: one row per round and metric, the newest logged (a round re-run after it failed
    past its evaluation, or re-evaluated, supersedes what it logged before), in round order. Every reader (the
    curve, the summary, the report, `tamis status`, the stop rules) reads this, never the raw log."""
    latest: dict[tuple[int, str], dict[str, Any]] = {}
    for r in read_jsonl(Path(artifacts) / METRICS_NAME):
        latest[int(r["round"]), r["metric"]] = r
    return sorted(latest.values(), key=lambda r: int(r["round"]))


def _curve_lines(rows: Sequence[Mapping[str, Any]], metric: str) -> dict[str, dict[int, tuple[float, Any]]]:
    """strategy → labels → (value, its 95 % interval or None); a re-evaluated round replaces its earlier value (the
    log is append-only, newest wins)."""
    lines: dict[str, dict[int, tuple[float, Any]]] = {}
    for r in rows:
        if r["metric"] == metric:
            lines.setdefault(str(r.get("strategy") or "?"), {})[int(r["labels"])] = (float(r["value"]), r.get("ci95"))
    return lines


def curve_figure(rows: Sequence[Mapping[str, Any]], *, metric: str | None = None, chance: float | None = None) -> Any:
    """The learning curve as a matplotlib Figure (the caller closes it): metric vs number of labels, one line per
    strategy, each point with its 95 % bootstrap interval when logged.

    The y-axis starts at `chance` (a closed answer set's 1 / number of answers, drawn as a line) or 0, and ends at 1:
    a 3-point gain shows as 3 points of the whole scale, not as a cliff. Labels are integers on the x-axis; a single
    round's point sits in the middle of a readable axis instead of between fractional ticks."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and workers
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if not rows:
        raise DataError("no metrics to plot: no round has been evaluated yet")
    metric = metric or rows[0]["metric"]
    lines = _curve_lines(rows, metric)
    if not lines:
        raise DataError(f"no rows for metric {metric!r}; logged: {', '.join(sorted({r['metric'] for r in rows}))}")
    xs_all = sorted({x for pts in lines.values() for x in pts})
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for strategy, pts in sorted(lines.items()):
        xs = sorted(pts)
        ys = [pts[x][0] for x in xs]
        ci = [pts[x][1] or [pts[x][0], pts[x][0]] for x in xs]
        err = [[y - lo for y, (lo, _) in zip(ys, ci, strict=True)], [hi - y for y, (_, hi) in zip(ys, ci, strict=True)]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=4, label=strategy)
    # Chance level, or lower where a point or its interval falls below it (a model worse than chance shows so).
    lows = [min(v, ci[0] if ci else v) for pts in lines.values() for v, ci in pts.values()]
    floor = 0.0 if chance is None else min(float(chance), *lows)
    if chance is not None:
        ax.axhline(chance, color="grey", linestyle="--", linewidth=1, label=f"chance ({chance:.3f})")
    ax.set_ylim(max(0.0, floor - 0.02), 1.0)  # the chance line just above the axis, visible
    span = xs_all[-1] - xs_all[0]
    pad = max(1, round(span * 0.1)) if span else max(1, round(xs_all[0] * 0.25))
    ax.set_xlim(max(0, xs_all[0] - pad), xs_all[-1] + pad)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=8))
    has_ci = any(p[1] for pts in lines.values() for p in pts.values())
    ax.set_xlabel("labeled samples")
    ax.set_ylabel(metric + (" (95% bootstrap interval)" if has_ci else ""))
    ax.set_title(f"Learning curve ({metric})")
    ax.grid(True, alpha=0.3)
    if len(lines) > 1 or chance is not None:
        ax.legend(loc="best")
    return fig


def plot_learning_curve(
    rows: Sequence[Mapping[str, Any]], out_png: str | os.PathLike[str], *, metric: str | None = None,
    chance: float | None = None,
) -> Path:
    """curve_figure written as a PNG."""
    if not rows:
        raise DataError(f"no metrics to plot into {out_png}: no round has been evaluated yet")
    fig = curve_figure(rows, metric=metric, chance=chance)  # selects the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    try:
        buf = io.BytesIO()
        # No timestamp / software metadata, so the same metrics give the same bytes.
        fig.savefig(buf, format="png", metadata={"Software": None})
    finally:
        plt.close(fig)
    return atomic_write_bytes(out_png, buf.getvalue())


def book_metrics(artifacts: str | os.PathLike[str], *, round_index: int, labels: int, metrics: Mapping[str, float],
                 strategy: str, intervals: Mapping[str, Sequence[float]] | None = None) -> None:
    """Log a round's evaluation: a re-run that evaluates the same (or a resumed one) appends nothing; a re-run whose
    rows differ (other labels, another strategy, after the first run failed past its evaluation) logs all of them
    again in one batch, and read_metrics shows only those. `intervals`: each metric's 95 % bootstrap interval,
    logged as the row's `ci95`."""
    rows = []
    for name, value in metrics.items():
        row = {"round": round_index, "labels": labels, "metric": name, "value": float(value), "strategy": strategy}
        if intervals and name in intervals:
            row["ci95"] = [float(x) for x in intervals[name]]
        rows.append(row)
    logged = {(m["round"], m["metric"]): {k: m.get(k) for k in (*METRIC_KEYS, "ci95")} for m in read_metrics(artifacts)}
    if any(logged.get((round_index, r["metric"])) != {"ci95": None, **r} for r in rows):
        now = time.time()
        append_jsonl(Path(artifacts) / METRICS_NAME, [{**r, "time": now} for r in rows])


CURVE_FILE = "learning_curve.png"


def learning_curve(artifacts: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]], *,
                   answers: Sequence[str] | None = None) -> Path | None:
    """The project's learning curve (artifacts/learning_curve.png) from the metrics log; None before any metric.
    With a closed answer set the y-axis starts at chance level, 1 / len(answers).

    No random baseline is drawn: benchmarks/label_efficiency.py runs with its own config and artifacts folder and
    writes benchmarks/results/, and nothing there says whether it ran on this project's data (the same images, test
    split and model), so a baseline beside this curve could be another data set's."""
    if not rows:
        return None
    return plot_learning_curve(rows, Path(artifacts) / CURVE_FILE, chance=1 / len(answers) if answers else None)


def round_curve_png(rows: Sequence[Mapping[str, Any]], round_index: int, *, answers: Sequence[str] | None = None,
                    drawn: str | os.PathLike[str] | None = None) -> bytes | None:
    """The learning curve as it stood after round `round_index` (later rounds' points left out), as PNG bytes; None
    before any metric. `drawn`: the project's learning_curve.png that learning_curve just drew from the same `rows`
    and `answers`, whose bytes are the same picture when no later round is logged: it is read, not drawn again."""
    upto = [r for r in rows if int(r["round"]) <= round_index]
    if not upto:
        return None
    if drawn is not None and len(upto) == len(rows):
        return Path(drawn).read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        return plot_learning_curve(upto, Path(tmp) / CURVE_FILE,
                                   chance=1 / len(answers) if answers else None).read_bytes()
