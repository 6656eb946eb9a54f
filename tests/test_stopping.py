"""Stopping without labels: agreement of successive adapters on a never-selected stop set (pipeline/stopping.py)."""

import json

import datasets
import pytest
from sklearn.metrics import cohen_kappa_score

from pipeline.config import parse_config
from pipeline.round.plan import PoolData, eligible_pool, plan_round
from pipeline.round.stop import stop_reason
from pipeline.stopping import (
    STOPSET_FILE,
    agreement,
    cohen_kappa,
    converged_reason,
    forecast,
    record_stop_set,
    remaining_change,
    stable_reason,
    stop_set,
)


@pytest.mark.parametrize("a,b", [
    ("1123412341", "1123412342"), ("aaaabbbbcc", "aaaabbbbcc"), ("ababababab", "babababababa"[:10]),
    ("0000000001", "0000000000"),
])
def test_kappa_is_cohens(a, b):
    assert cohen_kappa(list(a), list(b)) == pytest.approx(cohen_kappa_score(list(a), list(b)))


def test_agreement_closed_gives_kappa_and_the_f_change_bound_open_compares_normalised_answers():
    closed = agreement(list("1123412341"), list("1123412342"), closed=True)
    k = cohen_kappa_score(list("1123412341"), list("1123412342"))
    assert closed["kappa"] == pytest.approx(k, abs=1e-6) and closed["f_change_bound"] == pytest.approx(4 * (1 - k) / k,
                                                                                                      abs=1e-5)
    # Two adapters that each answer one class: kappa 0 and no bound, written as null (round.json is standard JSON).
    flat = agreement(list("1111"), list("2222"), closed=True)
    assert flat["kappa"] == 0 and flat["f_change_bound"] is None and "Infinity" not in json.dumps(flat)
    assert agreement(["A red bus.", "two", "cat"], ["a red bus", "Two", "dog"], closed=False) == {
        "agreement": pytest.approx(2 / 3, abs=1e-6)}


def test_forecast_follows_the_trend_of_the_disagreement():
    assert forecast([], 0.99)[0] is None and forecast([0.9], 0.99)[0] is None
    n, text = forecast([0.6, 0.8, 0.9], 0.99)  # disagreement 0.4 → 0.2 → 0.1: halves each round
    assert n == 4 and "stable in about 4 rounds" in text  # 0.1 → 0.05 → 0.025 → 0.0125 → 0.00625
    assert forecast([0.9, 0.85], 0.99) == (None, "no trend toward stability yet (agreement 0.8500, not rising)")
    assert forecast([0.8, 0.995], 0.99)[0] == 0


def test_the_stop_set_is_seeded_stable_and_never_selected(tmp_path):
    ids = [f"s{i:03d}" for i in range(50)]
    assert stop_set(ids, 10, 0) == stop_set(list(reversed(ids)), 10, 0) and len(stop_set(ids, 10, 0)) == 10
    assert stop_set(ids, 10, 0) != stop_set(ids, 10, 1) and stop_set(ids, 0, 0) == []
    pool = PoolData.of(datasets.Dataset.from_dict({"sample_id": ids, "split": ["pool"] * 49 + ["test"],
                                                   "answer": [None] * 50}))
    stop = pool.stop_set(10, 0)
    assert "s049" not in pool.stop_set(49, 0)  # test split samples never join it
    eligible, exclude, _ = eligible_pool(tmp_path, pool, plan_round(tmp_path, {}), set(), stop=stop)
    assert not set(eligible) & set(stop) and set(stop) <= exclude and len(eligible) == 39


def test_successive_rounds_build_the_agreement_history(tmp_path):
    ids = ["a", "b", "c", "d"]
    first = record_stop_set(tmp_path / "000", None, ids=ids, predictions=list("1122"), closed=True, target=0.99)
    assert first["history"] == [] and "agreement" not in first
    second = record_stop_set(tmp_path / "001", tmp_path / "000", ids=ids, predictions=list("1123"), closed=True,
                             target=0.99)
    third = record_stop_set(tmp_path / "002", tmp_path / "001", ids=ids, predictions=list("1123"), closed=True,
                            target=0.99)
    assert third["history"] == [second["agreement"], 1.0] and third["rounds_to_stable"] == 0
    assert json.loads((tmp_path / "002" / STOPSET_FILE).read_text())["predictions"] == list("1123")
    # A stop set that changed (the pool changed) starts a new history instead of comparing other samples.
    other = record_stop_set(tmp_path / "003", tmp_path / "002", ids=["a", "b", "c", "e"], predictions=list("1123"),
                            closed=True, target=0.99)
    assert other["history"] == []


def test_stop_when_stable_needs_window_rounds_at_the_target(tmp_path):
    cfg = parse_config({"rounds": {"max_rounds": 50, "stop_set": 20, "stop_when_stable": {"agreement": 0.98,
                                                                                           "window": 2}}})
    assert stable_reason({"history": [0.99]}, cfg.rounds.stop_when_stable) is None
    assert stable_reason({"history": [0.97, 0.99]}, cfg.rounds.stop_when_stable) is None
    assert stop_reason(cfg.rounds, 3, 10, [], 5, {"history": [0.9, 0.985, 0.99]}).startswith("stable predictions")
    assert stop_reason(cfg.rounds, 3, 10, [], 5, None) is None  # no adapter yet: no stability, no stop
    off = parse_config({"rounds": {"max_rounds": 50, "stop_set": 20, "stop_when_converged": None}})
    # measured, but not a stop rule
    assert stop_reason(off.rounds, 3, 10, [], 5, {"history": [1.0, 1.0, 1.0, 1.0], "n": 20}) is None


def test_remaining_change_sums_the_fitted_geometric_decay():
    # disagreement 0.2, 0.1, 0.05, 0.025: halves every round, so 0.025 · (1/2 + 1/4 + …) = 0.025 is left to change
    left, q = remaining_change([0.8, 0.9, 0.95, 0.975], n=1000)
    assert q == pytest.approx(0.5) and left == pytest.approx(0.025)
    assert remaining_change([0.8, 0.9], n=1000) == (None, None)  # two points are no trend
    # Agreement 1.0 on 500 samples counts as half an answer changed (0.001): a finite forecast, not log(0).
    left, q = remaining_change([0.99, 0.998, 1.0, 1.0], n=500)
    assert 0 < q < 1 and left == pytest.approx(0.001 * q / (1 - q))
    assert remaining_change([0.90, 0.88, 0.89, 0.87], n=150)[0] == float("inf")  # not falling
    # Falling, but by less than one standard error of a disagreement on 150 answers over the window: noise.
    assert remaining_change([0.86, 0.865, 0.87, 0.868, 0.875, 0.872], n=150)[0] == float("inf")


def test_stop_when_converged_is_the_default_and_reads_the_trend():
    cfg = parse_config({"rounds": {"max_rounds": 50, "stop_set": 150}})
    rule = cfg.rounds.stop_when_converged
    assert (rule.remaining_change, rule.window) == (0.06, 6)
    # Falling by half a round: 0.05 then 0.025 left; stops once the forecast is ≤ 0.06.
    assert converged_reason({"history": [0.6, 0.8, 0.9], "n": 150}, rule) is None
    why = stop_reason(cfg.rounds, 5, 100, [], 50, {"history": [0.6, 0.8, 0.9, 0.95], "n": 150})
    assert why.startswith("converged: forecast 0.050 of the stop set's answers left to change")
    # A VLM's retraining noise: agreement stuck near 0.87 never reaches a kappa target; the trend says stop, once
    # it has held for the whole window.
    noisy = {"history": [0.7, 0.86, 0.88, 0.86, 0.87, 0.88, 0.86], "n": 150}
    assert converged_reason({**noisy, "history": noisy["history"][:5]}, rule) is None
    assert "stopped falling over the last 6 rounds" in converged_reason(noisy, rule)
    assert stable_reason(noisy, parse_config({"rounds": {"stop_set": 150, "stop_when_stable": {}}})
                         .rounds.stop_when_stable) is None
    # Still falling fast from far away: no stop.
    assert converged_reason({"history": [0.3, 0.5, 0.65, 0.75], "n": 150}, rule) is None
    # Without a stop set there is no history and the default rule never acts.
    assert stop_reason(parse_config({"rounds": {"max_rounds": 50}}).rounds, 5, 100, [], 50, None) is None


def test_the_round_summary_shows_the_forecast_change(tmp_path):
    ids = [f"s{i}" for i in range(10)]
    preds = ["1"] * 10
    out = None
    for r, changed in enumerate([None, 6, 3, 2, 1]):
        if changed is not None:
            preds = [("2" if p == "1" else "1") if i < changed else p for i, p in enumerate(preds)]
        out = record_stop_set(tmp_path / f"{r:03d}", tmp_path / f"{r - 1:03d}" if r else None, ids=ids,
                              predictions=list(preds), closed=False, target=0.99)
    assert out["history"] == [0.4, 0.7, 0.8, 0.9]
    assert out["remaining_change"] == pytest.approx(remaining_change(out["history"], n=10)[0], abs=1e-4)
    assert "forecast change still to come" in out["forecast"]
