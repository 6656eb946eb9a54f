"""Annotators: time, agreement, stopping. Does ranking by gain per predicted second spend fewer annotator-hours, and
where does each stopping rule stop?

cost — accuracy against cumulative annotator-hours, cost-aware (`select.cost: predicted`) vs cost-blind for the
same strategy, on scikit-learn's digits (the demo's data) with the label-efficiency benchmark's reference learner:
logistic regression on the selection embeddings (here a PCA of the pool's pixels), fast enough for many seeds.
Seconds per label come from a stated time model and go through the label ledger's times file, as an import writes
them; the cost model is the library's (pipeline/strategies/cost.py), refitted every round on the labeled samples'
recorded seconds from the round's own features (the embeddings and the probe's confidence):
- predictable: seconds = 15 · exp(0.8 · z(ink)) · LogNormal(0, 0.3), ink = the image's summed pixel intensity (more
  strokes, longer to judge): the features see the image, so they can partly predict it;
- unpredictable: seconds = 15 · exp(0.8 · N(0, 1)) · LogNormal(0, 0.3), the same spread, independent of every
  feature: cost-aware selection must show no gain, not a fake one.
Protocol (as benchmarks/label_efficiency.py): paired seeds (within a seed both arms see the same split, pool, PCA,
seconds, first batch); per seed hours to reach 95 % of the full-data accuracy (linear between rounds); the ratio
aware / blind of the mean hours, with a paired bootstrap 95 % interval over seeds (target re-taken from the
resample's full-data runs); a seed that never reaches the target counts at its last round's hours (censored, counted).

consensus — from benchmarks/_annotators_consensus.py (`run(quick) -> dict`) when that module exists, else
{"status": "not run"}.

stopping — on the digits curve (the probe, margin sampling, re-run here with a stop set of up to 500 pool samples
that is never selected) and on the committed open-answer curves (benchmarks/results/label_efficiency_open.json, tiny
model, its best strategy; there the stop set is the 150 test rows, which no strategy can select, and the rules read
only the successive adapters' answers on them, never a reference): where each rule stops (rounds.stop_reason with one
rule set at a time; the label-free rules through pipeline.stopping), the curve's plateau (the first round within 0.01
of the seed's best), labels spent after it and accuracy given up against the best round. stop_when_converged is the
default rule (rounds.stop_when_converged); its remaining_change 0.06 was chosen on 20 other seeds of the digits probe
(100-119), its window 6 after window 4 (the row kept beside it) stopped 3.6 rounds early on the open answers: that
choice looked at the open-answer run's curves, every strategy's, so the open row is not out of sample for the window.

    python benchmarks/annotators.py --json-out benchmarks/results/annotators.json
    python benchmarks/annotators.py --quick   # 3 seeds, 6 rounds: 30 s of CPU
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks._results import write_result  # noqa: E402
from pipeline.annotation.ledger import Ledger  # noqa: E402
from pipeline.config import parse_config  # noqa: E402
from pipeline.round.stop import main_metric, stop_reason  # noqa: E402
from pipeline.selection import select_step  # noqa: E402
from pipeline.stopping import agreement  # noqa: E402
from pipeline.store import atomic_write_bytes  # noqa: E402
from pipeline.strategies.cost import features, round_costs, seconds_per_sample  # noqa: E402

TEST, DIM, INITIAL, BATCH, STOP_SET = 500, 32, 40, 20, 500
MIN_TIMED, MIN_R2 = 20, 0.05
STRATEGIES = {"margin": ("margin", "top_k", "random"), "maxherding": ("margin", "maxherding", "maxherding")}
RULES = {"label_budget": {"label_budget": 200}, "plateau_rounds": {"plateau_rounds": 3},
         "target_metric": {"target_metric": 0.9}, "stop_when_stable": {"stop_when_stable": {"agreement": 0.99,
                                                                                             "window": 3}},
         "stop_when_stable_0.97x2": {"stop_when_stable": {"agreement": 0.97, "window": 2}},
         "stop_when_converged": {"stop_when_converged": {"remaining_change": 0.06, "window": 6}},
         "stop_when_converged_window4": {"stop_when_converged": {"remaining_change": 0.06, "window": 4}}}
LABEL_FREE = ("stop_when_stable", "stop_when_converged")  # rules that read the stop set's agreement
PLATEAU_TOL = 0.01


# ------------------------------------------------------------------------------------------------ data and learner
class Seed:
    """One seed's split of the digits, its selection space (PCA of the pool) and both time models' seconds."""

    def __init__(self, seed: int):
        from sklearn.datasets import load_digits
        from sklearn.decomposition import PCA

        d = load_digits()
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(d.target))
        test, pool = order[:TEST], order[TEST:]
        self.ids = [f"d{i:04d}" for i in pool]
        self.index = {sid: i for i, sid in enumerate(self.ids)}
        pca = PCA(DIM, random_state=seed).fit(d.data[pool] / 16.0)
        self.x, self.test_x = pca.transform(d.data[pool] / 16.0), pca.transform(d.data[test] / 16.0)
        self.y, self.test_y = d.target[pool], d.target[test]
        ink = d.data[pool].sum(1)
        z = (ink - ink.mean()) / ink.std()
        noise = np.exp(rng.normal(0, 0.3, len(pool)))
        self.seconds = {"predictable": 15.0 * np.exp(0.8 * z) * noise,
                        "unpredictable": 15.0 * np.exp(0.8 * rng.normal(size=len(pool))) * noise}
        self.seed = seed

    def probe(self, rows: list[int]) -> Any:
        from sklearn.linear_model import LogisticRegression

        return LogisticRegression(C=10.0, max_iter=2000).fit(self.x[rows], self.y[rows])

    def proba(self, clf: Any, x: np.ndarray) -> np.ndarray:
        out = np.zeros((len(x), 10))
        out[:, clf.classes_] = clf.predict_proba(x)
        return out

    def accuracy(self, clf: Any) -> float:
        return float((clf.predict(self.test_x) == self.test_y).mean())


def first_batch(s: Seed, cold: str, candidates: list[str]) -> list[str]:
    """The cold start, cost-blind in both arms (no model, no recorded seconds yet)."""
    sel = select_step(candidates, k=INITIAL, strategy="random", diversity="top_k" if cold == "random" else cold,
                      seed=s.seed, embeddings=s.x[[s.index[c] for c in candidates]])
    return list(sel.ids)


# ------------------------------------------------------------------------------------------------ cost
def cost_run(s: Seed, strategy: str, time_model: str, aware: bool, rounds: int, folder: Path) -> dict[str, Any]:
    """One arm: labels, cumulative hours and accuracy per round; the seconds go through a ledger's times file."""
    heuristic, diversity, cold = STRATEGIES[strategy]
    ledger = Ledger(folder / f"{strategy}-{time_model}-{aware}" / "labels.jsonl")
    labeled = first_batch(s, cold, s.ids)
    secs = s.seconds[time_model]
    timed: set[str] = set()
    out: dict[str, Any] = {"labels": [], "hours": [], "accuracy": [], "cost_r2": [], "cost_status": []}
    for r in range(rounds + 1):
        new = [i for i in labeled if i not in timed]
        timed.update(new)
        ledger.append_times({"sample_id": i, "annotator": "sim", "seconds": float(secs[s.index[i]]), "round": r,
                             "source_digest": f"round-{r}"} for i in new)
        rows = [s.index[i] for i in labeled]
        clf = s.probe(rows)
        out["labels"].append(len(labeled))
        out["hours"].append(float(secs[rows].sum()) / 3600)
        out["accuracy"].append(s.accuracy(clf))
        if r == rounds:
            break
        probs = s.proba(clf, s.x)
        costs = None
        if aware:
            recorded = seconds_per_sample(ledger.times())
            costs, model = round_costs(s.ids, features(s.x, probs.max(1)), labeled, recorded, min_timed=MIN_TIMED,
                                       min_r2=MIN_R2, seed=s.seed)
            out["cost_r2"].append(model.report.get("cv_r2"))
            out["cost_status"].append(model.report["status"])
        sel = select_step(s.ids, k=BATCH, strategy=heuristic, diversity=diversity, seed=s.seed * 1000 + r + 1,
                          labeled=labeled, probs=probs, predicted=probs.argmax(1), embeddings=s.x, costs=costs)
        labeled = labeled + list(sel.ids)
    return out


def hours_to(hours: list[float], acc: list[float], target: float) -> tuple[float, bool]:
    """Hours at which the curve first reaches `target` (linear between rounds); (last hours, False) if never."""
    for i, a in enumerate(acc):
        if a >= target:
            if i == 0:
                return hours[0], True
            return hours[i - 1] + (hours[i] - hours[i - 1]) * (target - acc[i - 1]) / (a - acc[i - 1]), True
    return hours[-1], False


def cost_summary(runs: list[dict[str, Any]], full: np.ndarray, boot: int) -> dict[str, Any]:
    """Hours to 95 % of full data per arm, the ratio aware / blind with its paired bootstrap interval."""
    def reach(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        target = 0.95 * full[idx].mean()
        a = [hours_to(runs[i]["aware"]["hours"], runs[i]["aware"]["accuracy"], target) for i in idx]
        b = [hours_to(runs[i]["blind"]["hours"], runs[i]["blind"]["accuracy"], target) for i in idx]
        return (np.array([h for h, _ in a]), np.array([h for h, _ in b]), np.array([ok for _, ok in a]),
                np.array([ok for _, ok in b]))

    n = len(runs)
    ha, hb, oka, okb = reach(np.arange(n))
    rng = np.random.default_rng(0)
    ratios = [(lambda v: v[0].mean() / v[1].mean())(reach(idx)) for idx in rng.integers(0, n, size=(boot, n))]
    lo, hi = np.quantile(ratios, [0.025, 0.975])
    mean = {arm: {k: np.mean([r[arm][k] for r in runs], axis=0).round(4).tolist() for k in ("labels", "hours",
                                                                                            "accuracy")}
            for arm in ("aware", "blind")}
    r2 = [x for r in runs for x in r["aware"]["cost_r2"] if x is not None]
    statuses = [x for r in runs for x in r["aware"]["cost_status"]]
    return {
        "hours_to_95_aware": round(float(ha.mean()), 3), "hours_to_95_blind": round(float(hb.mean()), 3),
        "reached_95": {"aware": int(oka.sum()), "blind": int(okb.sum()), "seeds": n},
        "hours_ratio_95": round(float(ha.mean() / hb.mean()), 3), "hours_ratio_95_ci": [round(float(lo), 3),
                                                                                        round(float(hi), 3)],
        "hours_ratio_95_per_seed_median": round(float(np.median(ha / hb)), 3),
        "final_accuracy": {"aware": mean["aware"]["accuracy"][-1], "blind": mean["blind"]["accuracy"][-1]},
        "cost_model_cv_r2_median": round(float(np.median(r2)), 3) if r2 else None,
        "rounds_ranked_by_cost": f"{statuses.count('predicted')} of {len(statuses)}",
        "curves": mean,
    }


# ------------------------------------------------------------------------------------------------ stopping
def rule_config(tmp: Path, rule: dict[str, Any], open_answers: bool = False) -> Any:
    # One rule at a time: the default stop_when_converged is switched off unless it is the rule measured.
    rounds = {"max_rounds": 1000, "stop_when_converged": None, **rule}
    if any(k in rule for k in LABEL_FREE):
        rounds["stop_set"] = STOP_SET
    # The closed answer set makes accuracy the metric the rules read (open answers: token F1).
    data = {"answers": None} if open_answers else {"answers": [str(i) for i in range(10)]}
    return parse_config({"paths": {"artifacts": str(tmp / "a")}, "rounds": rounds, "data": data}, root=tmp)


def stop_round(cfg: Any, labels: list[int], curve: list[float], metric: str,
               history: list[float] | None, stop_n: int = STOP_SET) -> int | None:
    """The first round at which rounds.stop_reason says stop (None: never within the curve)."""
    for r in range(len(curve)):
        metrics = [{"round": i, "metric": metric, "value": v} for i, v in enumerate(curve[: r + 1])]
        # r agreements after round r, on a stop set of stop_n samples
        stability = {"history": history[:r], "n": stop_n} if history is not None else None
        if stop_reason(cfg.rounds, r, labels[r], metrics, pool_left=1, stability=stability,
                       main=main_metric(cfg.data.answers)) is not None:
            return r
    return None


def stopping_table(curves: list[dict[str, Any]], rules: dict[str, Any], tmp: Path, metric: str,
                   open_answers: bool = False) -> dict[str, Any]:
    """Per rule: mean stop round, rounds / labels after the plateau, accuracy given up, seeds where it fired."""
    out: dict[str, Any] = {}
    for name, rule in rules.items():
        cfg = rule_config(tmp, rule, open_answers)
        after, labels_after, given_up, fired, rounds_at, last_agreement = [], [], [], 0, [], []
        for c in curves:
            labels, acc, hist = c["labels"], c["accuracy"], c.get("agreement")
            if any(k in rule for k in LABEL_FREE) and hist is None:
                break
            best = max(acc)
            plateau = next(i for i, a in enumerate(acc) if a >= best - PLATEAU_TOL)
            r = stop_round(cfg, labels, acc, metric, hist, c.get("stop_n", STOP_SET))
            fired += r is not None
            r = len(acc) - 1 if r is None else r
            rounds_at.append(r)
            after.append(r - plateau)
            labels_after.append(labels[r] - labels[plateau])
            given_up.append(best - acc[r])
            if hist:
                last_agreement.append(hist[-1])
        if not rounds_at:
            out[name] = {"rule": rule, "status": "not evaluated: these curves hold no stop-set predictions"}
            continue
        out[name] = {"rule": rule, "fired": f"{fired} of {len(curves)}", "stop_round": round(float(np.mean(rounds_at)), 2),
                     "rounds_after_plateau": round(float(np.mean(after)), 2),
                     "labels_after_plateau": round(float(np.mean(labels_after)), 1),
                     "accuracy_given_up": round(float(np.mean(given_up)), 4)}
        if last_agreement and any(k in rule for k in LABEL_FREE):
            out[name]["last_round_kappa_mean"] = round(float(np.mean(last_agreement)), 4)
    return out


def digits_stopping_curves(seeds: list[int], rounds: int) -> list[dict[str, Any]]:
    """Margin sampling with the probe, a stop set the selection never picks, agreement of successive probes on it."""
    curves = []
    for seed in seeds:
        s = Seed(seed)
        rng = np.random.default_rng(seed + 7)
        stop = sorted(rng.choice(len(s.ids), min(STOP_SET, len(s.ids) // 3), replace=False).tolist())
        stop_ids = {s.ids[i] for i in stop}
        candidates = [i for i in s.ids if i not in stop_ids]
        labeled = first_batch(s, "random", candidates)
        labels, acc, agree, previous = [], [], [], None
        for r in range(rounds + 1):
            clf = s.probe([s.index[i] for i in labeled])
            labels.append(len(labeled))
            acc.append(s.accuracy(clf))
            pred = clf.predict(s.x[stop]).tolist()
            if previous is not None:
                agree.append(agreement(previous, pred, closed=True)["agreement"])
            previous = pred
            if r == rounds:
                break
            probs = s.proba(clf, s.x)
            sel = select_step(s.ids, k=BATCH, strategy="margin", diversity="top_k", seed=seed * 1000 + r + 1,
                              labeled=labeled, exclude=stop_ids, probs=probs, embeddings=s.x)
            labeled = labeled + list(sel.ids)
        # agreement[r-1] compares round r with round r-1: the history a round's stop_reason sees after round r.
        curves.append({"labels": labels, "accuracy": acc, "agreement": agree, "stop_n": len(stop)})
    return curves


def open_curves() -> tuple[list[dict[str, Any]], str | None, str | None]:
    """The open-answer benchmark's per-seed curves of its best strategy (to 95 % of full data), with the successive
    adapters' agreement on the test rows where the run recorded it: (curves, metric, strategy)."""
    path = ROOT / "benchmarks" / "results" / "label_efficiency_open.json"
    if not path.is_file():
        return [], None, None
    d = json.loads(path.read_text(encoding="utf-8"))
    name = d.get("best_strategy_95") if d.get("best_strategy_95") in d["strategies"] else "token_entropy"
    s = d["strategies"].get(name) or next(iter(d["strategies"].values()))
    labels = [int(x) for x in s["labels"]]
    agree = s.get("agreement_per_seed") or [None] * len(s["per_seed"])
    n = len(d.get("test_ids") or []) or int(d.get("config", {}).get("benchmark", {}).get("test_size") or 0)
    return ([{"labels": labels, "accuracy": list(c), "agreement": a, "stop_n": n}
             for c, a in zip(s["per_seed"], agree, strict=True)], d.get("metric", "token_f1"), name)


# ------------------------------------------------------------------------------------------------ figure, main
def plot(cost: dict[str, Any], out_png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.3), dpi=100, squeeze=False)
    try:
        for ax, model in zip(axes.flat, ("predictable", "unpredictable"), strict=True):
            for strategy, res in cost[model].items():
                if not isinstance(res, dict) or "curves" not in res:  # the model's summary keys
                    continue
                for arm, ls in (("blind", "--"), ("aware", "-")):
                    c = res["curves"][arm]
                    label = f"{strategy} cost-{arm}" + (f" (×{res['hours_ratio_95']:.2f} h to 95 %)" if arm == "aware"
                                                        else "")
                    ax.plot(c["hours"], c["accuracy"], ls=ls, marker="o", ms=2, lw=1.2, label=label)
            full = cost["full_data_accuracy"]
            ax.axhline(0.95 * full, color="grey", lw=0.8, ls=":", label=f"95 % of full data ({0.95 * full:.3f})")
            ax.set_title(f"{model} annotation time", fontsize=9)
            ax.set_xlabel("cumulative annotator-hours (mean over seeds)")
            ax.set_ylabel("test accuracy (mean over seeds)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=6.5, loc="lower right")
        fig.suptitle("digits, logistic-regression probe on PCA embeddings: cost-aware vs cost-blind", fontsize=9)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", metadata={"Software": None}, bbox_inches="tight")
    finally:
        plt.close(fig)
    return atomic_write_bytes(out_png, buf.getvalue())


def consensus_section(quick: bool) -> dict[str, Any]:
    try:
        from benchmarks import _annotators_consensus
    except ImportError:
        return {"status": "not run"}
    return _annotators_consensus.run(quick)


def run(*, quick: bool, seeds: list[int], rounds: int, boot: int) -> dict[str, Any]:
    cost: dict[str, Any] = {}
    full = []
    with tempfile.TemporaryDirectory() as tmp:
        per: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for seed in seeds:
            s = Seed(seed)
            full.append(s.accuracy(s.probe(list(range(len(s.ids))))))
            for model in ("predictable", "unpredictable"):
                for strategy in STRATEGIES:
                    per.setdefault((model, strategy), []).append(
                        {arm: cost_run(s, strategy, model, arm == "aware", rounds, Path(tmp) / str(seed))
                         for arm in ("aware", "blind")})
        full_a = np.array(full)
        for (model, strategy), runs in per.items():
            cost.setdefault(model, {"strategies": {}})["strategies"][strategy] = cost_summary(runs, full_a, boot)
        for model in cost:
            head = cost[model]["strategies"]["margin"]
            cost[model].update({k: head[k] for k in ("hours_ratio_95", "hours_ratio_95_ci")})
        digits = digits_stopping_curves(seeds, rounds)
        opened, open_metric, open_strategy = open_curves()
        stopping = {"digits": stopping_table(digits, RULES, Path(tmp), "accuracy"),
                    "digits_curve": "probe, margin sampling, the cost benchmark's seeds and batches",
                    "plateau": f"first round within {PLATEAU_TOL} of the seed's best",
                    "open_answers": (stopping_table(opened, RULES, Path(tmp), open_metric or "token_f1",
                                                    open_answers=True) if opened else {"status": "not run"}),
                    "open_answers_curve": f"benchmarks/results/label_efficiency_open.json, {open_strategy}, per seed; "
                                          "stop set: its test rows (predictions only)"}
    rap = {f"{curve}.{rule}": v["rounds_after_plateau"] for curve in ("digits", "open_answers")
           for rule, v in stopping[curve].items() if isinstance(v, dict) and "rounds_after_plateau" in v}
    return {
        "benchmark": "annotators", "quick": quick, "seeds": seeds, "rounds": rounds, "initial": INITIAL,
        "batch": BATCH, "learner": "logistic regression (C=10) on a 32-d PCA of the pool's pixels (the "
                                   "label-efficiency benchmark's reference learner); sklearn digits, 500 test",
        "cost": {"full_data_accuracy": round(float(full_a.mean()), 4), "strategy": "margin (top_k)",
                 "hours_ratio_95": cost["predictable"]["hours_ratio_95"],
                 "hours_ratio_95_ci": cost["predictable"]["hours_ratio_95_ci"],
                 # (the summary's two keys beside the per-strategy entries of the same model)
                 "unpredictable": {**cost["unpredictable"]["strategies"],
                                   **{k: cost["unpredictable"][k] for k in ("hours_ratio_95", "hours_ratio_95_ci")}},
                 "time_models": {"predictable": "15·exp(0.8·z(ink))·LogNormal(0,0.3) s",
                                 "unpredictable": "15·exp(0.8·N(0,1))·LogNormal(0,0.3) s"},
                 "cost_model": {"min_timed": MIN_TIMED, "min_r2": MIN_R2,
                                "features": "selection embeddings + probe confidence"},
                 "predictable": cost["predictable"]["strategies"]},
        "consensus": consensus_section(quick),
        "stopping": {"rounds_after_plateau": rap, **stopping},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 seeds, 6 rounds, 200 bootstrap resamples")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--png", default=None, help="default: beside --json-out")
    a = ap.parse_args(argv)
    started = time.time()
    seeds, rounds, boot = (list(range(3)), 6, 200) if a.quick else (list(range(a.seeds)), a.rounds, 2000)
    result = run(quick=a.quick, seeds=seeds, rounds=rounds, boot=boot)
    png = Path(a.png) if a.png else (Path(a.json_out).with_suffix(".png") if a.json_out else None)
    if png is not None:
        plot(result["cost"], png)
        result["png"] = png.name
    return write_result(result, a.json_out, config={"seeds": seeds, "rounds": rounds, "boot": boot,
                                                    "rules": RULES}, started=started)


if __name__ == "__main__":
    main()
