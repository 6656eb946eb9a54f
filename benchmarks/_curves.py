"""The label-efficiency benchmark's curve arithmetic and figure: labels to a target, areas, paired bootstrap
intervals over seeds, the per-strategy summary and headline, the learning-curve plot.

Pure functions of the per-seed curves (no model, no pipeline state), so they are tested on hand-made curves.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.store import atomic_write_bytes


def labels_to(labels: list[float], curve: list[float], target: float) -> float | None:
    """Labels at which the curve first reaches `target` (linear between points); the first point's labels when it
    starts there; None when it never does."""
    for i, y in enumerate(curve):
        if y >= target:
            if i == 0:
                return float(labels[0])
            x0, x1, y0 = labels[i - 1], labels[i], curve[i - 1]
            return float(x0 + (x1 - x0) * (target - y0) / (y - y0))
    return None


def _area(labels: Any, curve: Any) -> float:
    """Mean accuracy over the label range (trapezoids): a strategy that is ahead everywhere has the larger area."""
    return float(np.trapezoid(curve, labels) / (labels[-1] - labels[0]))


def _ci(values: np.ndarray) -> list[float | None]:
    """Percentile 95 % interval; an upper end that is infinite (never reached) is None."""
    # inverted_cdf picks observed values: interpolating next to an infinite ratio would give NaN.
    lo, hi = np.quantile(values, [0.025, 0.975], method="inverted_cdf")
    return [round(float(lo), 3) if np.isfinite(lo) else None, round(float(hi), 3) if np.isfinite(hi) else None]


# An interval drawn from fewer than half of the resamples describes the few seed draws where random happens to reach
# the target, not the ratio: it is dropped (None, None), and the share left out says why.
MAX_UNDEFINED_SHARE = 0.5


def bootstrap_ratio(acc: np.ndarray, base: np.ndarray, full: np.ndarray, labels: np.ndarray, pct: int, n: int,
                    seed: int = 0) -> tuple[list[float | None], float]:
    """Paired bootstrap over seeds of labels-to-pct % (strategy) / labels-to-pct % (random): each resample draws
    seeds with replacement and takes the strategy's, random's and the full-data run's values of the same seeds.
    A resample where the strategy never reaches the target counts as an infinite ratio; one where random never
    reaches it has no ratio and is left out (the fraction left out is returned); when more than
    MAX_UNDEFINED_SHARE of them are left out, there is no interval."""
    rng = np.random.default_rng(seed)
    s = len(acc)
    ratios, undefined = [], 0
    for idx in rng.integers(0, s, size=(n, s)):
        target = pct / 100 * full[idx].mean()
        lb = labels_to(list(labels), list(base[idx].mean(0)), target)
        if lb is None:
            undefined += 1
            continue
        ls = labels_to(list(labels), list(acc[idx].mean(0)), target)
        ratios.append(np.inf if ls is None else ls / lb)
    share = round(undefined / n, 3)
    if not ratios or share > MAX_UNDEFINED_SHARE:
        return [None, None], share
    return _ci(np.array(ratios)), share


def bootstrap_ratio_to_final(acc: np.ndarray, base: np.ndarray, labels: np.ndarray, n: int,
                             seed: int = 0) -> list[float | None]:
    """Paired bootstrap over seeds of labels to reach random's final value, strategy / random (random's mean curve
    may get there before its last step): a target that needs no full-data reference. A resample where the strategy
    never gets there is an infinite ratio."""
    rng = np.random.default_rng(seed)
    s = len(acc)
    ratios = []
    for idx in rng.integers(0, s, size=(n, s)):
        base_mean = base[idx].mean(0)
        lb = labels_to(list(labels), list(base_mean), float(base_mean[-1]))
        ls = labels_to(list(labels), list(acc[idx].mean(0)), float(base_mean[-1]))
        ratios.append(np.inf if ls is None else ls / lb)
    return _ci(np.array(ratios))


def summarize(curves: dict[str, list[dict[str, Any]]], full: list[float], baseline: str, *, bootstrap: int = 2000,
              rarest: list[str] | None = None) -> dict[str, Any]:
    """Per strategy: mean/std curve over seeds, area with its interval, labels to 90 / 95 % of full-data, the ratio
    to random with its paired bootstrap interval, the area difference to random paired by seed; the final labeled
    set's class balance; with `rarest` (the rarest class of each seed), that class's recall at the last round."""
    out: dict[str, Any] = {}
    full_arr = np.asarray(full, dtype=np.float64)
    full_acc = float(full_arr.mean())
    rng = np.random.default_rng(0)
    base_runs = curves[baseline]
    for name, runs in curves.items():
        acc = np.array([r["accuracy"] for r in runs], dtype=np.float64)
        labels = np.array([r["labels"] for r in runs], dtype=np.float64).mean(0)
        mean, std = acc.mean(0), acc.std(0, ddof=1) if len(acc) > 1 else np.zeros(acc.shape[1])
        areas = np.array([_area(r["labels"], r["accuracy"]) for r in runs])
        boot_idx = rng.integers(0, len(runs), size=(bootstrap, len(runs)))
        s: dict[str, Any] = {
            "labels": [round(x, 1) for x in labels], "mean": [round(x, 4) for x in mean],
            "std": [round(x, 4) for x in std], "per_seed": [r["accuracy"] for r in runs],
            "auc": round(_area(labels, mean), 4), "auc_ci": _ci(areas[boot_idx].mean(1)),
            "seconds": round(sum(r["seconds"] for r in runs), 1)}
        band = np.percentile(acc[boot_idx].mean(1), [2.5, 97.5], axis=0)
        s["mean_ci"] = [[round(float(a), 4) for a in band[0]], [round(float(b), 4) for b in band[1]]]
        for pct in (90, 95):
            x = labels_to(list(labels), list(mean), pct / 100 * full_acc)
            s[f"labels_to_{pct}"] = None if x is None else round(x, 1)
        if name != baseline and len(runs) == len(base_runs):
            base = np.array([r["accuracy"] for r in base_runs], dtype=np.float64)
            s["ratio_to_random_95_ci"], s["ratio_95_bootstrap_undefined"] = bootstrap_ratio(
                acc, base, full_arr, labels, 95, bootstrap)
            s["ratio_to_random_90_ci"], _ = bootstrap_ratio(acc, base, full_arr, labels, 90, bootstrap)
            s["ratio_to_random_final_ci"] = bootstrap_ratio_to_final(acc, base, labels, bootstrap)
            d = areas - np.array([_area(r["labels"], r["accuracy"]) for r in base_runs])
            s["auc_minus_random"] = {"mean": round(float(d.mean()), 4), "ci": _ci(d[boot_idx].mean(1)),
                                     "per_seed": [round(float(x), 4) for x in d], "seeds_ahead": int((d > 0).sum())}
        counts = [r.get("class_counts") or {} for r in runs]
        classes = sorted({c for cc in counts for c in cc})
        if classes:
            per_class = {c: float(np.mean([cc.get(c, 0) for cc in counts])) for c in classes}
            s["final_class_counts"] = {c: round(v, 1) for c, v in per_class.items()}
            s["final_min_max_class"] = [round(min(per_class.values()), 1), round(max(per_class.values()), 1)]
        if rarest is not None:
            rec = [r["recall"][-1].get(c) for r, c in zip(runs, rarest, strict=True)]
            s["rarest_class_recall"] = round(float(np.mean(rec)), 4)
            s["rarest_class_recall_per_seed"] = rec
        if runs and all("agreement" in r for r in runs):
            s["agreement_per_seed"] = [[round(a, 4) for a in r["agreement"]] for r in runs]
        if runs and "phases" in runs[0]:
            s["phases"] = runs[0]["phases"]
        out[name] = s
    random_final = out[baseline]["mean"][-1]
    random_labels = labels_to(out[baseline]["labels"], out[baseline]["mean"], random_final)
    for s in out.values():
        for pct in (90, 95):
            mine, base = s[f"labels_to_{pct}"], out[baseline][f"labels_to_{pct}"]
            s[f"ratio_to_random_{pct}"] = None if mine is None or base is None else round(mine / base, 3)
        # Labels to reach what random has at the last step, over the labels random's own mean curve needs for it:
        # the full-data reference plays no part, so this ratio still reads when that reference is weak (the
        # open-answer benchmark).
        x = labels_to(s["labels"], s["mean"], random_final)
        s["labels_to_random_final"] = None if x is None else round(x, 1)
        s["ratio_to_random_final"] = None if x is None or not random_labels else round(x / random_labels, 3)
    return out


def best_ratio(strategies: dict[str, Any], baseline: str, pct: int | str) -> tuple[str | None, float | None]:
    found = [(s[f"ratio_to_random_{pct}"], n) for n, s in strategies.items()
             if n != baseline and s[f"ratio_to_random_{pct}"] is not None]
    return (min(found)[1], min(found)[0]) if found else (None, None)


def headline(strategies: dict[str, Any], baseline: str, full: list[float]) -> dict[str, Any]:
    best95, ratio95 = best_ratio(strategies, baseline, 95)
    best90, ratio90 = best_ratio(strategies, baseline, 90)
    best_final, ratio_final = best_ratio(strategies, baseline, "final")
    random_final = strategies[baseline]["mean"][-1]
    return {"full_data_accuracy": round(float(np.mean(full)), 4),
            # A reference below what random reaches makes every "% of full data" target trivial (ratios near 1).
            "full_data_below_random_final": bool(np.mean(full) < random_final),
            "best_strategy_random_final": best_final, "best_ratio_random_final": ratio_final,
            "best_ratio_random_final_ci": strategies[best_final].get("ratio_to_random_final_ci") if best_final
            else None,
            "full_data_accuracy_std": round(float(np.std(full, ddof=1)), 4) if len(full) > 1 else 0.0,
            "strategies": strategies, "best_strategy_95": best95, "best_ratio_95": ratio95,
            "best_ratio_95_ci": strategies[best95].get("ratio_to_random_95_ci") if best95 else None,
            "best_strategy_90": best90, "best_ratio_90": ratio90}


def plot(panels: list[tuple[str, dict[str, Any], float]], baseline: str, chance: float | None, title: str,
         out_png: Path, metric: str = "accuracy") -> Path:
    """One panel per (title, strategies, full-data accuracy): mean curves with bootstrap 95 % bands, random
    dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.3 * rows), dpi=100, squeeze=False)
    try:
        for ax, (name, summary, full_acc) in zip(axes.flat, panels, strict=False):
            for sname, s in sorted(summary.items()):
                x, m = np.array(s["labels"]), np.array(s["mean"])
                lo, hi = (np.array(b) for b in s["mean_ci"])
                # The labels ratio to random: to 95 % of full data, or to random's final value when random meets
                # that target within its first two steps (a weak reference: every strategy meets it at once).
                base = summary[baseline]
                weak_reference = base["labels_to_95"] is None or base["labels_to_95"] <= base["labels"][1]
                ratio = s.get("ratio_to_random_final" if weak_reference else "ratio_to_random_95")
                target = "random's last" if weak_reference else "95 %"
                label = f"{sname} (×{ratio:.2f} to {target})" if ratio is not None and sname != baseline else sname
                ls = "--" if sname == baseline else "-"
                line, = ax.plot(x, m, ls=ls, marker="o", ms=2.5, lw=1.6 if sname == baseline else 1.2, label=label,
                                color="k" if sname == baseline else None)
                ax.fill_between(x, lo, hi, alpha=0.12, color=line.get_color())
            ax.axhline(full_acc, color="grey", lw=1, label=f"full data ({full_acc:.3f})")
            ax.axhline(0.95 * full_acc, color="grey", lw=0.8, ls=":", label="95 % of full data")
            if chance is not None:
                ax.axhline(chance, color="lightgrey", lw=0.8, ls=":")
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("labeled samples")
            ax.set_ylabel(f"test {metric.replace('_', ' ')} (mean, 95 % band)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=6.5, loc="lower right")
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        fig.suptitle(title, fontsize=9)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", metadata={"Software": None}, bbox_inches="tight")
    finally:
        plt.close(fig)
    return atomic_write_bytes(out_png, buf.getvalue())
