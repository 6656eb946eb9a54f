"""Annotation cost (pipeline/strategies/cost.py): the cost model, gain per predicted second in every selector, the
fall-back to cost-blind ranking, and rounds.budget_hours."""

import numpy as np
import pytest

from pipeline.annotation.ledger import Ledger, ledger_path
from pipeline.config import SelectConfig, parse_config
from pipeline.round.stop import recorded_hours, stop_reason
from pipeline.scoring import ScoreResult
from pipeline.selection import labeled_seconds, select_round
from pipeline.store import read_jsonl
from pipeline.strategies import SELECTORS, Candidates, select_batch
from pipeline.strategies.cost import fit_cost_model, seconds_per_sample


def planted(n, seed, predictable=True):
    """Features and seconds: seconds = 20·exp(0.8·x0)·noise when predictable, else independent of x."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6))
    noise = np.exp(rng.normal(0, 0.2, n))
    base = np.exp(0.8 * x[:, 0]) if predictable else np.exp(0.8 * rng.normal(size=n))
    return x, 20.0 * base * noise


def test_the_cost_model_recovers_a_planted_time_dependence():
    x, s = planted(200, 0)
    m = fit_cost_model(x, s, min_timed=20)
    assert m.usable and m.report["status"] == "predicted"
    assert m.report["cv_r2"] > 0.8
    assert m.report["cv_mae_s"] < 0.5 * m.report["median_mae_s"]
    # On fresh samples the predictions order the seconds.
    x2, s2 = planted(200, 1)
    assert np.corrcoef(np.log(m.predict(x2)), np.log(s2))[0, 1] > 0.9


def test_the_cost_model_says_no_gain_on_random_times():
    x, s = planted(200, 0, predictable=False)
    m = fit_cost_model(x, s, min_timed=20)
    assert not m.usable and m.report["status"] == "cost-blind"
    assert m.report["cv_r2"] < 0.05 and "do not predict the seconds" in m.report["reason"]
    assert np.ptp(m.predict(x)) == 0  # one guess for every sample: ranking stays cost-blind


def test_too_few_timed_labels_leave_the_model_unfitted():
    x, s = planted(12, 0)
    m = fit_cost_model(x, s, min_timed=20)
    assert not m.usable and m.report["reason"] == "12 timed labels < select.cost_min_timed = 20"
    assert m.predict(x[:3]).tolist() == [pytest.approx(float(np.median(s)))] * 3


def twins(m=12, d=8, seed=0):
    """m well-separated points, each twice (a cheap and a dear copy, 1e-3 apart): every gain ties within a pair."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(m, d)) * 10
    emb = np.concatenate([centers, centers + 1e-3]).astype(np.float32)
    ids = [f"c{i:02d}" for i in range(m)] + [f"d{i:02d}" for i in range(m)]
    costs = np.r_[np.full(m, 5.0), np.full(m, 50.0)]
    return ids, emb, costs


@pytest.mark.parametrize("diversity", sorted(SELECTORS))
def test_cost_aware_selection_picks_the_cheaper_sample_at_equal_gain(diversity):
    ids, emb, costs = twins()
    probs = np.tile([0.5, 0.3, 0.2], (len(ids), 1))  # equal uncertainty everywhere
    predicted = np.r_[np.arange(12) % 3, np.arange(12) % 3]
    arrays = dict(probs=probs, embeddings=emb, predicted=predicted, labeled_embeddings=emb[:1] + 100.0)
    kw = dict(k=4, strategy="margin", diversity=diversity, seed=0)
    if diversity == "probcover":
        kw["options"] = {"radius": 1.0}
    if diversity == "class_balanced":  # box projects' selector: each answer's predicted boxes per class
        kw["options"] = {"box_labels": ["a", "b", "c"]}
        arrays["predicted"] = np.eye(3, dtype=int)[predicted]
    aware = select_batch(Candidates(ids, costs=costs, **arrays), **kw)
    if SELECTORS[diversity].cost_use == "none":
        assert aware.ids == select_batch(Candidates(ids, **arrays), **kw).ids  # no gain to divide: cost-blind, as its info says
        assert aware.info["cost_use"] == "none"
        return
    assert all(i.startswith("c") for i in aware.ids), aware.ids
    # Cost-blind, the same call has no reason to prefer the cheap copies: at least one dear one is picked somewhere.
    blind = [select_batch(Candidates(ids, **arrays), **{**kw, "seed": s}).ids for s in range(6)]
    assert any(i.startswith("d") for b in blind for i in b)


def test_every_selector_says_how_it_uses_costs():
    assert {cls.cost_use for cls in SELECTORS.values()} <= {"scores", "own", "none"}


def pool_scores(n=120, seed=0):
    rng = np.random.default_rng(seed)
    emb = rng.normal(size=(n, 6)).astype(np.float32)
    probs = np.tile([0.5, 0.3, 0.2], (n, 1))
    ids = [f"s{i:03d}" for i in range(n)]
    seconds = 20.0 * np.exp(1.0 * emb[:, 0]) * np.exp(rng.normal(0, 0.1, n))
    return ScoreResult(ids, emb, probs=probs), dict(zip(ids, seconds.tolist(), strict=True))


def run_round(cost, labeled, seconds, scores):
    sel = SelectConfig(batch_size=10, strategy="margin", diversity="top_k", cost=cost, cost_min_timed=20)
    return select_round(sel, candidate_ids=scores.sample_ids, scores=scores, space=None, labeled=labeled, exclude=(),
                        answers=["a", "b", "c"], history=[], cold_start=False, seed=0,
                        seconds={s: seconds[s] for s in labeled})


def test_select_round_ranks_by_gain_per_predicted_second():
    scores, seconds = pool_scores()
    labeled = scores.sample_ids[:40]
    aware = run_round("predicted", labeled, seconds, scores)
    blind = run_round("none", labeled, seconds, scores)
    cost = aware.info["cost"]
    assert cost["status"] == "predicted" and cost["cv_r2"] > 0.8 and cost["next_batch"] == 10
    picked = [seconds[r["sample_id"]] for r in aware.rows]
    assert np.mean(picked) < 0.5 * np.mean([seconds[r["sample_id"]] for r in blind.rows])
    assert cost["next_batch_hours"] == pytest.approx(sum(picked) / 3600, rel=0.3)
    assert "cost" not in blind.info


def test_select_round_falls_back_to_cost_blind_below_the_minimum():
    scores, seconds = pool_scores()
    labeled = scores.sample_ids[:10]
    aware = run_round("predicted", labeled, seconds, scores)
    blind = run_round("none", labeled, seconds, scores)
    assert aware.info["cost"]["status"] == "cost-blind"
    assert aware.info["cost"]["reason"] == "10 timed labels < select.cost_min_timed = 20"
    assert [r["sample_id"] for r in aware.rows] == [r["sample_id"] for r in blind.rows]


def times_ledger(art, seconds_by_sample):
    ledger = Ledger(ledger_path(art))
    ledger.append_times({"sample_id": s, "annotator": a, "seconds": t, "round": 0, "source_digest": f"f{a}"}
                        for s, ts in seconds_by_sample.items() for a, t in zip("xyz", ts, strict=False))


def test_budget_hours_stops_a_round(tmp_path):
    c = parse_config({"paths": {"artifacts": "a"}, "rounds": {"max_rounds": 10, "budget_hours": 1.0}}, root=tmp_path)
    times_ledger(c.artifacts, {f"s{i}": [60.0] for i in range(50)})  # 50 minutes
    assert recorded_hours(c.artifacts) == pytest.approx(50 / 60)
    assert stop_reason(c.rounds, 1, 50, [], 10, hours=recorded_hours(c.artifacts)) is None
    times_ledger(c.artifacts, {f"t{i}": [60.0] for i in range(10)})  # 60 minutes
    assert stop_reason(c.rounds, 1, 60, [], 10, hours=recorded_hours(c.artifacts)) == ("hours budget spent: 1.00 annotator-hours recorded ≥ "
                                             "rounds.budget_hours = 1.0")
    assert stop_reason(c.rounds, 1, 60, [], 10, hours=0.5) is None  # the hours the caller gives


def test_labeled_seconds_are_the_median_per_labeled_sample(tmp_path):
    art = tmp_path / "a"
    times_ledger(art, {"s1": [10.0, 30.0, 50.0], "s2": [7.0], "s3": [9.0]})
    ref = labeled_seconds(art, tmp_path, ["s1", "s2", "s4"])
    assert seconds_per_sample(Ledger(ledger_path(art)).times())["s1"] == 30.0
    assert read_jsonl(ref["path"]) == [{"sample_id": "s1", "seconds": 30.0}, {"sample_id": "s2", "seconds": 7.0}]


def test_the_round_summary_reports_the_cost_model_and_the_forecast():
    from dataclasses import replace

    from pipeline.report import summary_markdown
    from pipeline.round_state import RoundState

    scores, seconds = pool_scores()
    state = RoundState(round=2, labeled=40, pool=80, strategy="margin+top_k", selected=10)
    for labeled, expect in ((scores.sample_ids[:40], "ranked by gain per predicted second"),
                            (scores.sample_ids[:10], "cost-blind ranking: 10 timed labels < select.cost_min_timed")):
        info = run_round("predicted", labeled, seconds, scores).info["cost"]
        md = summary_markdown(replace(state, cost=info), [])
        line = next(x for x in md.splitlines() if x.startswith("- cost model"))
        assert expect in line and f"forecast for this batch of 10: {info['next_batch_hours']:.2f} h" in line
