"""benchmarks/label_efficiency.py: config loading, the curve arithmetic, and (slow) one tiny run end to end."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from benchmarks import _curves as curves
from benchmarks import label_efficiency as le
from pipeline.annotation.ledger import Ledger
from pipeline.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parent.parent


def _write(tmp_path: Path, mutate) -> Path:
    data = yaml.safe_load((ROOT / "configs" / "label_efficiency.yaml").read_text(encoding="utf-8"))
    mutate(data)
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def test_shipped_config_loads_and_quick_overrides_apply():
    cfg, bench = le.load_bench_config(le.DEFAULT_CONFIG)
    assert {"random", "margin", "typiclust", "probcover", "maxherding", "tcm"} <= set(bench.strategies)
    assert bench.baseline == "random" and bench.strategies["random"].cold_start == "random"
    assert len(bench.seeds) >= 5 and bench.batch == 20 and bench.initial + bench.rounds * bench.batch >= 200
    assert cfg.select.embeddings.source == "pool" and bench.longtail.imbalance == 20 and cfg.train.max_steps
    qcfg, quick = le.load_bench_config(le.DEFAULT_CONFIG, quick=True)
    q = yaml.safe_load(le.DEFAULT_CONFIG.read_text(encoding="utf-8"))["benchmark"]["quick"]
    assert set(quick.strategies) == set(q["strategies"]) and quick.seeds == q["seeds"]
    assert qcfg.train.max_steps == q.get("train_steps", cfg.train.max_steps) and quick.rounds == q["rounds"]
    # --strategies: a subset, the random baseline kept for the ratios; a name the config lacks is refused.
    _, sub = le.load_bench_config(le.DEFAULT_CONFIG, strategies=["uncertainty_herding", "maxherding_margin"])
    assert set(sub.strategies) == {"random", "uncertainty_herding", "maxherding_margin"}
    with pytest.raises(ConfigError, match=r"--strategies \['nope'\]: not in"):
        le.load_bench_config(le.DEFAULT_CONFIG, strategies=["nope"])


@pytest.mark.parametrize(("mutate", "fragment"), [
    (lambda d: d["benchmark"]["strategies"].update(oops={"strategy": "confusion"}), "benchmark.strategies.oops"),
    (lambda d: d["benchmark"]["strategies"].pop("random"), "needs the baseline"),
    (lambda d: d["benchmark"]["strategies"]["random"].update(cold_start="typiclust"), "needs the baseline"),
    (lambda d: d["benchmark"]["strategies"]["tcm"]["schedule"].update(coverage="nope"), "strategies.tcm.schedule"),
    (lambda d: d["benchmark"].update(rounds=0), "benchmark.rounds"),
    (lambda d: d.update(extra={}), "only 'project' and 'benchmark'"),
    (lambda d: d["benchmark"]["quick"].update(strategies=["nope"]), "quick.strategies names ['nope']"),
    (lambda d: d["project"]["train"].pop("max_steps"), "max_steps is not set"),
    (lambda d: d["project"]["model"].update(lora_rank=4), "(project): invalid config\n  model.lora_rank: unknown key"),
])
def test_bad_configs_name_the_field(tmp_path, mutate, fragment):
    path = _write(tmp_path, mutate)
    with pytest.raises(ConfigError) as err:
        le.load_bench_config(path, quick="quick" in fragment)
    assert fragment in str(err.value) and str(path) in str(err.value)


def test_labels_to_interpolates_between_rounds():
    labels, curve = [40, 80, 120], [0.5, 0.6, 0.8]
    assert curves.labels_to(labels, curve, 0.4) == 40  # reached at the first point
    assert curves.labels_to(labels, curve, 0.7) == pytest.approx(100)  # halfway between 0.6 and 0.8
    assert curves.labels_to(labels, curve, 0.81) is None


def test_summarize_ratios_against_random():
    runs = {
        "random": [{"labels": [10, 20, 30], "accuracy": [0.5, 0.7, 0.95], "seconds": 1.0},
                   {"labels": [10, 20, 30], "accuracy": [0.5, 0.9, 0.95], "seconds": 1.0}],
        "margin": [{"labels": [10, 20, 30], "accuracy": [0.5, 0.95, 1.0], "seconds": 1.0,
                    "class_counts": {"a": 20, "b": 10}}] * 2,
    }
    s = curves.summarize(runs, [1.0, 1.0], "random", bootstrap=200)
    assert s["random"]["mean"] == [0.5, 0.8, 0.95] and s["random"]["std"][1] == pytest.approx(0.1414, abs=1e-4)
    assert s["margin"]["final_min_max_class"] == [10, 20]
    assert s["random"]["labels_to_95"] == pytest.approx(30) and s["margin"]["labels_to_95"] == pytest.approx(20)
    assert s["margin"]["ratio_to_random_95"] == pytest.approx(20 / 30, abs=1e-3)
    # Mean accuracy over the label range (trapezoids): random (0.5+0.8)/2 and (0.8+0.95)/2 averaged.
    assert s["random"]["auc"] == pytest.approx(((0.5 + 0.8) / 2 + (0.8 + 0.95) / 2) / 2, abs=1e-4)
    assert curves.best_ratio(s, "random", 95) == ("margin", s["margin"]["ratio_to_random_95"])
    # Paired by seed: margin's area minus random's, seed by seed.
    per_seed = [((0.5 + 0.95) / 2 + (0.95 + 1.0) / 2) / 2 - ((0.5 + a) / 2 + (a + 0.95) / 2) / 2 for a in (0.7, 0.9)]
    assert s["margin"]["auc_minus_random"]["per_seed"] == pytest.approx(per_seed, abs=1e-4)
    assert s["margin"]["auc_minus_random"]["seeds_ahead"] == 2 and "auc_minus_random" not in s["random"]
    # Random reaches 95 % of 1.0 at 30 labels on both seeds; margin at 20 (seed 0: 0.95) on both: every resample
    # gives 2/3. Its mean band brackets the mean curve.
    assert s["margin"]["ratio_to_random_95_ci"] == [pytest.approx(0.667, abs=1e-3)] * 2
    lo, hi = s["random"]["mean_ci"]
    assert all(a <= m <= b for a, m, b in zip(lo, s["random"]["mean"], hi, strict=True))


def test_ratio_to_random_final_needs_no_full_data_reference():
    # Random ends at 0.95 (mean of 0.9 and 1.0) with 30 labels; margin gets there between 10 and 20 labels.
    runs = {"random": [{"labels": [10, 20, 30], "accuracy": [0.5, 0.7, 0.9], "seconds": 1.0},
                       {"labels": [10, 20, 30], "accuracy": [0.5, 0.8, 1.0], "seconds": 1.0}],
            "margin": [{"labels": [10, 20, 30], "accuracy": [0.55, 1.0, 1.0], "seconds": 1.0}] * 2}
    weak_reference = [0.3, 0.3]  # below every curve: the % of full-data targets are all reached at once
    s = curves.summarize(runs, weak_reference, "random", bootstrap=200)
    assert s["random"]["ratio_to_random_final"] == 1.0
    expected = (10 + 10 * (0.95 - 0.55) / (1.0 - 0.55)) / 30
    assert s["margin"]["ratio_to_random_final"] == pytest.approx(expected, abs=1e-3)
    lo, hi = s["margin"]["ratio_to_random_final_ci"]
    assert lo <= s["margin"]["ratio_to_random_final"] <= hi < 1.0
    head = curves.headline(s, "random", weak_reference)
    assert head["full_data_below_random_final"] is True
    assert (head["best_strategy_random_final"], head["best_ratio_random_final"]) == ("margin", s["margin"]["ratio_to_random_final"])
    assert s["margin"]["ratio_to_random_95"] == 1.0  # the weak reference hides the difference


def test_bootstrap_ratio_is_paired_and_counts_never_reached():
    labels = np.array([10.0, 20.0, 30.0])
    base = np.array([[0.2, 0.5, 1.0], [0.2, 0.5, 1.0], [0.2, 0.5, 1.0]])
    same = curves.bootstrap_ratio(base, base, np.ones(3), labels, 95, 300)
    assert same == ([1.0, 1.0], 0.0)
    never = curves.bootstrap_ratio(np.full((3, 3), 0.3), base, np.ones(3), labels, 95, 300)
    assert never == ([None, None], 0.0)  # infinite ratio in every resample: no finite end
    undefined = curves.bootstrap_ratio(base, np.full((3, 3), 0.3), np.ones(3), labels, 95, 300)
    assert undefined == ([None, None], 1.0)


def test_an_interval_resting_on_a_few_resamples_is_dropped():
    # Random reaches 95 % of full data in one seed of four: a resample's mean curve gets there only when it draws
    # that seed four times (0.4 % of resamples), so the "interval" would describe those few draws.
    labels = np.array([10.0, 20.0, 30.0])
    base = np.array([[0.2, 0.5, 1.0]] + [[0.2, 0.3, 0.3]] * 3)
    ci, share = curves.bootstrap_ratio(np.ones((4, 3)), base, np.ones(4), labels, 95, 2000)
    assert share > curves.MAX_UNDEFINED_SHARE
    assert ci == [None, None]
    # One seed of four just short of the target: only resamples drawing it twice or more miss it, the interval stays.
    base3 = np.array([[0.2, 0.5, 1.0]] * 3 + [[0.2, 0.9, 0.9]])
    ci3, share3 = curves.bootstrap_ratio(np.ones((4, 3)), base3, np.ones(4), labels, 95, 2000)
    assert share3 < curves.MAX_UNDEFINED_SHARE and ci3[0] is not None


def test_longtail_pool_decays_geometrically_with_a_seeded_order():
    answers = [str(i) for i in range(10)]
    pool = [f"s{c}-{i}" for c in range(10) for i in range(100)]
    truth = {s: s[1] for s in pool}
    lt = le.longtail_pool(pool, truth, answers, 20.0, seed=3)
    sizes = sorted(Counter(truth[s] for s in lt).values(), reverse=True)
    assert sizes[0] == 100 and sizes[-1] == 5 and len(sizes) == 10
    assert all(a >= b for a, b in zip(sizes, sizes[1:], strict=False))
    assert lt == le.longtail_pool(pool, truth, answers, 20.0, seed=3)
    order = [Counter(truth[s] for s in le.longtail_pool(pool, truth, answers, 20.0, seed=k)).most_common(1)[0][0]
             for k in range(6)]
    assert len(set(order)) > 1  # the most frequent class changes with the seed


@pytest.mark.slow
def test_tiny_run_goes_through_export_annotator_and_ledger(tmp_path):
    def tiny(d):
        d["project"]["paths"]["artifacts"] = str(tmp_path / "work")
        d["project"]["model"]["name_or_path"] = str(tmp_path / "tiny-idefics3")
        d["project"]["select"]["embeddings"] = {"source": "pool", "encoder": {"epochs": 1, "batch_size": 32}}
        d["benchmark"]["quick"] = {"seeds": [0, 1], "rounds": 1, "initial": 8, "batch": 6, "test_size": 20,
                                   "pool_size": 80, "train_steps": 2, "bootstrap": 100,
                                   "strategies": ["random", "margin", "probcover"]}

    out = tmp_path / "res.json"
    result = le.main(["--config", str(_write(tmp_path, tiny)), "--quick", "--json-out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert Path(result["png"]).read_bytes()[:4] == b"\x89PNG"
    assert result["data"]["pool"] == 80 and result["data"]["test"] == 20
    assert result["baseline_cold_start"] == "random" and result["seeds"] == [0, 1]
    for part in (result, result["longtail"], result["reference_learner"], result["longtail"]["reference_learner"]):
        for name in ("random", "margin", "probcover"):
            assert part["strategies"][name]["labels"] == [8, 14]
        assert {"best_ratio_95", "best_strategy_95", "best_ratio_95_ci"} <= set(part)
    assert "ratio_to_random_95_ci" in result["strategies"]["probcover"]
    assert "rarest_class_recall" in result["longtail"]["strategies"]["margin"]
    assert len(result["full_data_runs"][0]["curve"]) == 2  # warm: one training per round
    runs = sorted((tmp_path / "work" / "runs").iterdir())
    assert len(runs) == 2 * 2 * 4  # (main, longtail) × seeds × (full data + 3 strategies)
    for run in runs:
        ledger = Ledger(run / "labels.jsonl").entries()  # committed entries, not the batch records
        tasks = [t for f in sorted(run.glob("rounds/*/export/label_studio_tasks.json"))
                 for t in json.loads(f.read_text())]
        assert sorted(e["sample_id"] for e in ledger) == sorted(t["data"]["sample_id"] for t in tasks)
    # Where it came from: the commit and tree, the config digest, the machine, the time spent and reused.
    assert result["commit"] and isinstance(result["dirty"], bool) and len(result["config_digest"]) == 64
    assert result["machine"]["cores"] and result["machine"]["torch_threads"] == 1 and result["wall_s"] > 0
    assert result["mixed_code_versions"] is False and len(result["code_versions"]) == 1
    # A second run resumes every finished seed from its file.
    again = le.main(["--config", str(_write(tmp_path, tiny)), "--quick"])
    assert again["timings"]["seed"]["computed"] == 0 and again["timings"]["seed"]["reused"] == 4
    assert "train" not in again["timings"] and again["reused_s"] > 0
    assert again["config_digest"] == result["config_digest"]
    # Without the seed files it reuses every embedding, adapter, evaluation and score from the content cache.
    for f in (tmp_path / "work" / "seeds").iterdir():
        f.unlink()
    again = le.main(["--config", str(_write(tmp_path, tiny)), "--quick"])
    assert again["timings"]["train"]["computed"] == 0 and again["timings"]["embeddings"]["computed"] == 0
    for name, s in result["strategies"].items():
        assert again["strategies"][name]["per_seed"] == s["per_seed"]


def _digits_config(tmp_path: Path, *, keyed_by: str, **bench) -> Path:
    """A manifest data set (a slice of the digits) whose ground truth is keyed by sample_id or by image path only."""
    from pipeline.data.demo import write_digits

    digits = write_digits(tmp_path / "digits", limit=60)
    gt = digits / "ground_truth.jsonl"
    rows = [json.loads(line) for line in gt.read_text(encoding="utf-8").splitlines()]
    keep = {"sample_id": ("sample_id", "answer"), "image": ("image", "answer")}[keyed_by]
    gt.write_text("".join(json.dumps({k: r[k] for k in keep}) + "\n" for r in rows), encoding="utf-8")

    def mutate(d):
        d["project"]["paths"]["artifacts"] = str(tmp_path / "work")
        d["project"]["model"]["name_or_path"] = str(tmp_path / "tiny-idefics3")
        d["project"]["data"]["sources"] = [{"kind": "jsonl", "path": str(digits / "manifest.jsonl")}]
        d["project"]["data"]["ground_truth"] = str(gt)
        d["project"]["select"]["embeddings"] = {"source": "pixels", "pca_dim": 8}
        d["benchmark"].update(build_demo_digits=False, initial=4, batch=4, rounds=1, bootstrap=100, **bench)

    return _write(tmp_path, mutate)


def test_ground_truth_keyed_by_image_path_gives_every_pool_sample_its_answer(tmp_path):
    by_id_cfg = _digits_config(tmp_path / "by-id", keyed_by="sample_id")
    by_path_cfg = _digits_config(tmp_path / "by-path", keyed_by="image")
    cfg_id, bench_id = le.load_bench_config(by_id_cfg)
    cfg, bench = le.load_bench_config(by_path_cfg)
    reference = le.prepare_data(cfg_id, bench_id)
    data = le.prepare_data(cfg, bench)
    assert data.pool and set(data.pool) <= set(data.truth)
    assert data.truth == reference.truth  # the same answers, matched by image file name instead of sample_id
    # The reference learner reads every pool sample's answer (it ended the run with a KeyError on a pool sample).
    work = le.Work(cfg, data)
    space, _ = le.selection_space(cfg, data, data.pool, work)
    full = le.probe_full(cfg, data, data.pool, space)
    assert full["labels"] == len(data.pool) and 0.0 <= full["accuracy"] <= 1.0


def test_pool_samples_without_ground_truth_are_refused_before_any_work(tmp_path):
    cfg, bench = le.load_bench_config(_digits_config(tmp_path, keyed_by="image"))
    data = le.prepare_data(cfg, bench)
    paths = dict(zip(data.prepared["sample_id"], data.prepared["image_path"], strict=True))
    dropped = Path(paths[data.pool[0]]).name
    gt = Path(cfg.data.ground_truth)
    lines = gt.read_text(encoding="utf-8").splitlines()
    gt.write_text("".join(x + "\n" for x in lines if Path(json.loads(x)["image"]).name != dropped), encoding="utf-8")
    with pytest.raises(DataError) as err:
        le.prepare_data(cfg, bench)
    msg = str(err.value)
    assert str(gt) in msg and f"no answer for 1 of {len(data.pool)} pool samples" in msg and dropped in msg


@pytest.mark.slow
def test_a_crash_late_in_a_run_keeps_the_finished_seeds_and_the_rerun_resumes(tmp_path, monkeypatch):
    path = _digits_config(tmp_path, keyed_by="image", seeds=[0, 1], train_steps=1, test_size=10, pool_size=30,
                          longtail=None, strategies={"random": {"cold_start": "random", "strategy": "random",
                                                                "diversity": "top_k"},
                                                     "typiclust": {"cold_start": "typiclust",
                                                                   "diversity": "typiclust"}})
    real_probe_full = le.probe_full

    def crash_on_seed_1(cfg, *args):
        if cfg.seed == 1:
            raise RuntimeError("killed in seed 1's reference learner")
        return real_probe_full(cfg, *args)

    monkeypatch.setattr(le, "probe_full", crash_on_seed_1)
    with pytest.raises(RuntimeError, match="seed 1"):
        le.main(["--config", str(path)])
    seeds = tmp_path / "work" / "seeds"
    assert [f.name.split("-")[:2] for f in sorted(seeds.iterdir())] == [["main", "seed0"]]
    monkeypatch.undo()

    resumed = le.main(["--config", str(path)])
    assert resumed["timings"]["seed"]["computed"] == 1 and resumed["timings"]["seed"]["reused"] == 1
    assert len(list(seeds.iterdir())) == 2 and resumed["reused_s"] > 0
    # The same result as a run that never crashed (its own work folder: nothing shared but the tiny model).
    fresh_cfg = tmp_path / "fresh.yaml"
    fresh_cfg.write_text(path.read_text().replace(str(tmp_path / "work"), str(tmp_path / "fresh-work")))
    fresh = le.main(["--config", str(fresh_cfg)])
    assert fresh["timings"]["seed"]["reused"] == 0
    for got, want in ((resumed, fresh), (resumed["reference_learner"], fresh["reference_learner"])):
        for name in ("random", "typiclust"):
            assert got["strategies"][name]["per_seed"] == want["strategies"][name]["per_seed"]
