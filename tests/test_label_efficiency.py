"""benchmarks/label_efficiency.py: config loading, the curve arithmetic, and (slow) one tiny run end to end."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("tamis_label_efficiency", ROOT / "benchmarks" / "label_efficiency.py")
le = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = le  # dataclasses look their module up while the file executes
_spec.loader.exec_module(le)


def _write(tmp_path: Path, mutate) -> Path:
    data = yaml.safe_load((ROOT / "configs" / "label_efficiency.yaml").read_text(encoding="utf-8"))
    mutate(data)
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def test_shipped_config_loads_and_quick_overrides_apply():
    cfg, bench = le.load_bench_config(le.DEFAULT_CONFIG)
    assert {"random", "entropy", "margin", "bald", "cluster_margin", "kcenter_margin"} <= set(bench.strategies)
    assert len(bench.seeds) >= 3 and cfg.select.mc_dropout_passes >= 2 and cfg.train.max_steps
    qcfg, quick = le.load_bench_config(le.DEFAULT_CONFIG, quick=True)
    q = yaml.safe_load(le.DEFAULT_CONFIG.read_text(encoding="utf-8"))["benchmark"]["quick"]
    assert set(quick.strategies) == set(q["strategies"]) and quick.seeds == q["seeds"]
    assert qcfg.train.max_steps == q.get("train_steps", cfg.train.max_steps) and quick.rounds == q["rounds"]


@pytest.mark.parametrize(("mutate", "fragment"), [
    (lambda d: d["benchmark"]["strategies"].update(oops={"strategy": "confusion"}), "benchmark.strategies.oops"),
    (lambda d: d["benchmark"]["strategies"].pop("random"), "needs the baseline"),
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
    assert le.labels_to(labels, curve, 0.4) == 40  # reached at the first point
    assert le.labels_to(labels, curve, 0.7) == pytest.approx(100)  # halfway between 0.6 and 0.8
    assert le.labels_to(labels, curve, 0.81) is None


def test_summarize_ratios_against_random():
    full = 1.0
    runs = {
        "random": [{"labels": [10, 20, 30], "accuracy": [0.5, 0.7, 0.95], "seconds": 1.0},
                   {"labels": [10, 20, 30], "accuracy": [0.5, 0.9, 0.95], "seconds": 1.0}],
        "margin": [{"labels": [10, 20, 30], "accuracy": [0.5, 0.95, 1.0], "seconds": 1.0,
                    "class_counts": {"a": 20, "b": 10}}] * 2,
    }
    s = le.summarize(runs, full, "random")
    assert s["random"]["mean"] == [0.5, 0.8, 0.95] and s["random"]["std"][1] == pytest.approx(0.1414, abs=1e-4)
    assert s["margin"]["final_min_max_class"] == [10, 20]
    assert s["random"]["labels_to_95"] == pytest.approx(30) and s["margin"]["labels_to_95"] == pytest.approx(20)
    assert s["margin"]["ratio_to_random_95"] == pytest.approx(20 / 30, abs=1e-3)
    # Mean accuracy over the label range (trapezoids): random (0.5+0.8)/2 and (0.8+0.95)/2 averaged.
    assert s["random"]["auc"] == pytest.approx(((0.5 + 0.8) / 2 + (0.8 + 0.95) / 2) / 2, abs=1e-4)
    assert le.best_ratio(s, "random", 95) == ("margin", s["margin"]["ratio_to_random_95"])
    # Paired by seed: margin's area minus random's, seed by seed.
    per_seed = [((0.5 + 0.95) / 2 + (0.95 + 1.0) / 2) / 2 - ((0.5 + a) / 2 + (a + 0.95) / 2) / 2 for a in (0.7, 0.9)]
    assert s["margin"]["auc_minus_random"]["per_seed"] == pytest.approx(per_seed, abs=1e-4)
    assert s["margin"]["auc_minus_random"]["seeds_ahead"] == 2 and "auc_minus_random" not in s["random"]


@pytest.mark.slow
def test_tiny_run_goes_through_export_annotator_and_ledger(tmp_path):
    def tiny(d):
        d["project"]["paths"]["artifacts"] = str(tmp_path / "work")
        d["project"]["model"]["name_or_path"] = str(tmp_path / "tiny-idefics3")
        d["project"]["select"]["mc_dropout_passes"] = 2
        d["benchmark"]["quick"] = {"seeds": [0], "rounds": 1, "initial": 8, "batch": 6, "test_size": 20,
                                   "pool_size": 60, "train_steps": 2, "full_data_seeds": [0],
                                   "strategies": ["random", "bald", "kcenter_margin"]}

    out = tmp_path / "res.json"
    result = le.main(["--config", str(_write(tmp_path, tiny)), "--quick", "--json-out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert Path(result["png"]).read_bytes()[:4] == b"\x89PNG"
    assert result["data"]["pool"] == 60 and result["data"]["test"] == 20
    for name in ("random", "bald", "kcenter_margin"):
        assert result["strategies"][name]["labels"] == [8, 14]
    # The cold-start round is trained once for all three strategies (the full-data reference once per round when
    # rounds continue the last adapter), and the ledgers hold exactly what was exported.
    warm = result["config"]["train"]["init"] == "warm"
    assert result["timings"]["train"]["computed"] == (2 if warm else 1) + 1 + 3
    assert len(result["full_data_runs"][0]["curve"]) == (2 if warm else 1)
    runs = sorted((tmp_path / "work" / "runs").iterdir())
    assert len(runs) == 4
    for run in runs:
        ledger = [json.loads(line) for line in (run / "labels.jsonl").read_text().splitlines()]
        tasks = [t for f in sorted(run.glob("rounds/*/export/label_studio_tasks.json"))
                 for t in json.loads(f.read_text())]
        assert sorted(e["sample_id"] for e in ledger) == sorted(t["data"]["sample_id"] for t in tasks)
    # A second run reuses every adapter, evaluation and score.
    again = le.main(["--config", str(_write(tmp_path, tiny)), "--quick"])
    assert again["timings"]["train"]["computed"] == 0
    for name, s in result["strategies"].items():
        assert again["strategies"][name]["per_seed"] == s["per_seed"]
