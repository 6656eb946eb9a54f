"""Pool scoring over several devices: one Dask worker per GPU, each pinned to its device, and the same selection."""

from __future__ import annotations

import os
import time

import pytest

from flows.select import make_task_runner
from pipeline.config import parse_config
from pipeline.model.distributed import device_cluster, scoring_devices
from pipeline.model.hardware import GPU, Hardware

GiB = 1 << 30
CPU = Hardware("cpu", [], 2, 24 * GiB, 20 * GiB)


def gpus(n: int) -> Hardware:
    return Hardware("cuda", [GPU(f"gpu{i}", 24 * GiB, (8, 6), True) for i in range(n)], 16, 64 * GiB)


def test_one_scoring_worker_per_visible_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert scoring_devices("auto", CPU) is None and scoring_devices(3, CPU) is None
    assert scoring_devices("auto", gpus(3)) == ["0", "1", "2"]
    assert scoring_devices(4, gpus(2)) == ["0", "1", "0", "1"]  # asked for: two workers share each GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")  # a restricted parent stays restricted
    assert scoring_devices("auto", gpus(2)) == ["4", "6"]


def test_dask_runner_is_built_per_device_on_a_gpu_machine(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = parse_config({"select": {"runner": "dask"}, "paths": {"artifacts": str(tmp_path)}})
    monkeypatch.setattr("pipeline.model.hardware.detect_hardware", lambda: gpus(2))
    runner = make_task_runner(cfg)
    assert runner.cluster_class is device_cluster and runner.cluster_kwargs["devices"] == ["0", "1"]
    monkeypatch.setattr("pipeline.model.hardware.detect_hardware", lambda: CPU)
    runner = make_task_runner(cfg)
    assert runner.cluster_kwargs["n_workers"] == 2 and runner.cluster_kwargs["threads_per_worker"] == 1
    cfg = parse_config({"select": {"runner": "dask", "dask_address": "tcp://sched:8786"}})
    assert make_task_runner(cfg).address == "tcp://sched:8786"


def _seen_devices(seconds: float) -> tuple[str, int]:
    time.sleep(seconds)
    return os.environ.get("CUDA_VISIBLE_DEVICES", ""), os.getpid()


def test_each_worker_sees_only_its_device_and_shards_spread_over_free_workers():
    from distributed import Client

    with device_cluster(["0", "1"], dashboard_address=":0") as cluster, Client(cluster) as client:
        pinned = client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES"))
        assert sorted(pinned.values()) == ["0", "1"]
        # Four one-second shards on two single-threaded workers: both devices work, two shards each at a time.
        seen = client.gather(client.map(_seen_devices, [1.0] * 4, pure=False))
        assert sorted({d for d, _ in seen}) == ["0", "1"] and len({p for _, p in seen}) == 2


@pytest.mark.slow
def test_device_pinned_workers_select_what_the_local_runner_selects(prefect_harness, tiny_models, tmp_path,
                                                                   monkeypatch):
    """The GPU layout (two pinned workers) on this CPU machine: workers see 'their' device id, torch finds no GPU and
    scores on the CPU, so the run checks placement and the selection, not GPU speed (benchmarks/gpu_check.py)."""
    import numpy as np
    from test_select_flow import make_adapter, make_prepared_pool, project, run_select

    from pipeline.preprocess import load_prepared
    from pipeline.store import executions, read_jsonl

    model = tiny_models["idefics3"]
    prepared = make_prepared_pool(tmp_path / "prepared", 16)
    ids = sorted(load_prepared(prepared["dir"])["sample_id"])
    pool = {"prepared": prepared, "adapter": make_adapter(model, tmp_path / "adapter"), "ids": ids,
            "exclude": ids[:1]}
    local = project(tmp_path / "local", model)
    ref_local, _ = run_select(local, pool)

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr("pipeline.model.hardware.detect_hardware", lambda: gpus(2))
    pinned = project(tmp_path / "pinned", model, runner="dask")
    ref_pinned, ran = run_select(pinned, pool)
    assert ran == {"score_shard": 4, "select": 1}
    assert os.getpid() not in {e["pid"] for e in executions(pinned.artifacts) if e["stage"] == "score_shard"}
    rows_local = read_jsonl(f"{ref_local['dir']}/selection.jsonl")
    rows_pinned = read_jsonl(f"{ref_pinned['dir']}/selection.jsonl")
    assert [r["sample_id"] for r in rows_pinned] == [r["sample_id"] for r in rows_local]
    np.testing.assert_allclose([r["score"] for r in rows_pinned], [r["score"] for r in rows_local], atol=1e-5)
