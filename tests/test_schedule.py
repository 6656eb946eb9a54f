"""select.schedule: coverage while labels are scarce, then uncertainty × diversity, switching where the rule says."""

from __future__ import annotations

import pytest

from pipeline.config import ScheduleConfig, parse_config
from pipeline.errors import ConfigError
from pipeline.strategies.schedule import accuracy_stopped_rising, choose_phase, newest_label_accuracy


def phase(labeled, schedule, *, n_classes=10, newest=()):
    return choose_phase(schedule, strategy="margin", diversity="cluster_margin", labeled=labeled,
                        n_classes=n_classes, newest_accuracy=newest)


def test_no_schedule_is_the_configured_pair_every_round():
    p = phase(5, ScheduleConfig())
    assert (p.name, p.strategy, p.diversity) == ("uncertainty", "margin", "cluster_margin")


@pytest.mark.parametrize(("labeled", "expected"), [(0, "coverage"), (99, "coverage"), (100, "uncertainty"),
                                                   (250, "uncertainty")])
def test_labels_per_class_switches_at_the_stated_count(labeled, expected):
    sch = ScheduleConfig(coverage="probcover", labels_per_class=10)
    p = phase(labeled, sch)
    assert p.name == expected
    if expected == "coverage":
        assert (p.strategy, p.diversity) == ("random", "probcover")
        assert f"{labeled} labels < 100 (10 per class × 10 classes)" in p.reason
    else:
        assert (p.strategy, p.diversity) == ("margin", "cluster_margin") and "≥ 100" in p.reason


def test_labels_per_class_counts_the_answer_set():
    sch = ScheduleConfig(coverage="maxherding", labels_per_class=4)
    assert phase(12, sch, n_classes=3).name == "uncertainty"
    assert phase(12, sch, n_classes=4).name == "coverage"


@pytest.mark.parametrize(("history", "patience", "stop"), [
    ([], 1, None), ([0.3], 1, None), ([0.3, 0.5, 0.7], 1, None),
    ([0.3, 0.5, 0.5], 1, 2),          # equal is not rising
    ([0.3, 0.6, 0.55, 0.7], 1, 2),
    ([0.3, 0.6, 0.55, 0.7], 2, None),  # one flat round is not enough with patience 2
    ([0.3, 0.6, 0.55, 0.58, 0.9], 2, 3),
])
def test_accuracy_stopped_rising(history, patience, stop):
    assert accuracy_stopped_rising(history, patience) == stop


def test_newest_accuracy_rule_switches_once_and_stays():
    sch = ScheduleConfig(coverage="typiclust", switch="newest_accuracy", patience=1)
    assert phase(40, sch, newest=[0.2, 0.4]).name == "coverage"
    switched = phase(60, sch, newest=[0.2, 0.4, 0.35])
    assert switched.name == "uncertainty" and "stopped rising after round 2" in switched.reason
    # A later rise does not switch back: the history still holds the flat step.
    assert phase(80, sch, newest=[0.2, 0.4, 0.35, 0.9]).name == "uncertainty"


def test_newest_label_accuracy_reads_pre_annotations():
    rows = [{"sample_id": "a", "prediction": "1"}, {"sample_id": "b", "prediction": "2"},
            {"sample_id": "c", "prediction": None}, {"sample_id": "d", "prediction": "4"}]
    assert newest_label_accuracy(rows, {"a": "1", "b": "3", "c": "5"}) == 0.5  # d not labeled yet, c no prediction
    assert newest_label_accuracy(rows[2:3], {"c": "5"}) is None


def test_schedule_and_embeddings_config_validate_with_field_names():
    cfg = parse_config({"select": {"embeddings": "pool", "schedule": {"coverage": "probcover"}}})
    assert cfg.select.embeddings.source == "pool" and cfg.select.schedule.coverage == "probcover"
    with pytest.raises(ConfigError, match=r"select.schedule.coverage: 'kmeans' is not allowed"):
        parse_config({"select": {"schedule": {"coverage": "kmeans"}}})
    with pytest.raises(ConfigError, match=r"select.embeddings.path: is required with source 'file'"):
        parse_config({"select": {"embeddings": "file"}})


def test_phase_label_names_the_coverage_selector_not_its_nominal_random_strategy():
    from pipeline.strategies.schedule import phase_label

    cfg = ScheduleConfig(coverage="maxherding", switch="labels_per_class", labels_per_class=10)
    coverage = phase(20, cfg)
    assert coverage.strategy == "random" and phase_label(coverage.as_dict()) == "coverage: maxherding"
    assert phase_label(phase(200, cfg).as_dict()) == "margin+cluster_margin"


def test_one_strategy_name_for_a_round_before_and_after_it_selects():
    """The name the round's metrics and table are booked under before it selects (rounds.round_strategy, from its
    phase) is the one its selection rows carry (select_round's round_strategy), for a coverage phase too."""
    import numpy as np

    from pipeline.config import SelectConfig
    from pipeline.round.params import round_strategy
    from pipeline.scoring import ScoreResult
    from pipeline.selection import Space, select_round

    sel_cfg = SelectConfig(batch_size=3, strategy="margin", diversity="top_k", cold_start="maxherding",
                           schedule={"coverage": "maxherding", "labels_per_class": 10}, embeddings="pixels")
    ids = [f"s{i}" for i in range(12)]
    space = Space(ids, np.random.default_rng(0).normal(size=(12, 4)).astype(np.float32), "pixels")
    coverage = choose_phase(sel_cfg.schedule, strategy="margin", diversity="top_k", labeled=2, n_classes=2,
                            newest_accuracy=[])
    rng = np.random.default_rng(1)
    probs = rng.dirichlet([1, 1], size=12).astype(np.float32)
    scores = ScoreResult(ids, space.emb, probs=probs)
    for cold, phase in ((True, None), (False, coverage)):
        out = select_round(sel_cfg, candidate_ids=ids, scores=None if cold else scores, space=space, labeled=set(),
                           exclude=set(), answers=["a", "b"], history=[], cold_start=cold, seed=0, phase=phase)
        phase = phase.as_dict() if phase is not None else None  # round.json's JSON form, as round_strategy reads it
        assert {r["round_strategy"] for r in out.rows} == {round_strategy(sel_cfg, cold=cold, phase=phase)}
    assert round_strategy(sel_cfg, cold=True) == "cold start: maxherding"
    assert round_strategy(sel_cfg, cold=False, phase=coverage.as_dict()) == "coverage: maxherding"
