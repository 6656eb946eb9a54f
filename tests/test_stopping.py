"""Stopping without labels: agreement of successive adapters on a never-selected stop set (pipeline/stopping.py)."""

import json

import datasets
import pytest
from sklearn.metrics import cohen_kappa_score

from pipeline.config import parse_config
from pipeline.rounds import PoolData, eligible_pool, plan_round, stop_reason
from pipeline.stopping import (
    STOPSET_FILE,
    agreement,
    cohen_kappa,
    forecast,
    record_stop_set,
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
    eligible, exclude = eligible_pool(tmp_path, pool, plan_round(tmp_path, {}), set(), stop=stop)
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
    off = parse_config({"rounds": {"max_rounds": 50, "stop_set": 20}})
    assert stop_reason(off.rounds, 3, 10, [], 5, {"history": [1.0, 1.0, 1.0]}) is None  # measured, but not a stop rule
