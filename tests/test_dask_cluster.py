"""A real Dask cluster: scheduler and workers as separate `dask` processes on 127.0.0.1, artifacts in a shared folder.

The slow test scores a round's shards on it and checks the selection against the local runner's, that a worker
SIGKILLed mid-shard costs only that shard's re-run, and that no process of the cluster listens beyond loopback.
The fast tests hold the shard-size rule that keeps a 10⁷ pool at a few thousand tasks.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import psutil
import pytest

from pipeline.config import ConfigError, parse_config
from pipeline.model.distributed import dask_runner_options, process_cluster
from pipeline.score_stage import plan_pool_scoring, score_config, scored_on_disk, shard_params
from pipeline.scoring import plan_shards, pool_shard_size
from pipeline.store import executions, read_jsonl

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------- shard sizes
def test_pools_within_max_tasks_keep_the_configured_shard_size():
    assert pool_shard_size(0, 256, 2000) == 256
    assert pool_shard_size(1797, 256, 2000) == 256
    assert pool_shard_size(256 * 2000, 256, 2000) == 256  # the largest pool that keeps today's shards
    assert pool_shard_size(256 * 2000 + 1, 256, 2000) == 512
    assert pool_shard_size(14, 4, 2000) == 4


@pytest.mark.parametrize("pool", [512_001, 10**6, 3 * 10**6 + 7, 10**7, 10**8])
def test_large_pools_get_power_of_two_shards_within_max_tasks(pool):
    size = pool_shard_size(pool, 256, 2000)
    tasks = -(-pool // size)
    assert size > 256 and size & (size - 1) == 0
    assert tasks <= 2000
    assert tasks > 1000  # the smallest power of two that fits: half of it would need more than max_tasks shards
    assert pool_shard_size(pool, 256, 2000) == size  # one pool, one size


def test_ten_million_samples_are_a_few_thousand_tasks():
    assert pool_shard_size(10**7, 256, 2000) == 8192 and -(-10**7 // 8192) == 1221


def _parts(cfg):
    prepared = {"dir": "/nowhere/prepared", "digest": "p" * 64}
    scoring = score_config(cfg.select, cfg.model, answers=cfg.data.answers, seed=cfg.seed)
    return dict(model=cfg.section("model"), scoring=scoring, adapter={"dir": "/a", "digest": "a" * 64},
                prepared=prepared)


def test_a_pool_below_the_threshold_keeps_todays_shards_and_keys():
    """Same shard parameters (the stage's cache key is a function of them) as before the rule existed."""
    cfg = parse_config({"select": {"shard_size": 4, "max_tasks": 5}})
    ids = [f"s{i:04d}" for i in range(20)]  # 20 = 4 × 5: exactly at the threshold
    size = pool_shard_size(len(ids), cfg.select.shard_size, cfg.select.max_tasks)
    assert size == 4
    assert shard_params("/art", **_parts(cfg), pool_ids=ids, shard_size=size) == \
        shard_params("/art", **_parts(cfg), pool_ids=ids, shard_size=cfg.select.shard_size)
    ids.append("s9999")  # one more sample: 6 shards of 4 would exceed max_tasks, so 3 shards of 8
    size = pool_shard_size(len(ids), cfg.select.shard_size, cfg.select.max_tasks)
    assert size == 8 and [len(s) for s in plan_shards(ids, size)] == [8, 8, 5]


def test_an_existing_cluster_is_named_by_a_dask_address():
    cfg = parse_config({"select": {"runner": "dask", "dask_address": "tls://10.0.0.5:8786"}})
    assert dask_runner_options(cfg.select, hw=None) == {"address": "tls://10.0.0.5:8786"}
    with pytest.raises(ConfigError, match="names no Dask protocol"):
        parse_config({"select": {"runner": "dask", "dask_address": "10.0.0.5:8786"}})
    with pytest.raises(ConfigError, match="set runner: dask"):
        parse_config({"select": {"dask_address": "tcp://10.0.0.5:8786"}})


# ------------------------------------------------------------------------------------------- a real cluster
def test_a_process_cluster_leaves_no_process_behind_when_its_body_raises(tmp_path):
    """One scheduler and one worker (nanny + worker process), all on loopback, all gone after an error inside."""
    with pytest.raises(RuntimeError, match="inside"), process_cluster(tmp_path, n_workers=1) as cluster:
        procs = [psutil.Process(p.pid) for p in (cluster.scheduler, *cluster.workers)]
        procs += [c for p in list(procs) for c in p.children(recursive=True)]
        assert len(procs) >= 3  # scheduler, nanny, worker process
        with cluster.client() as client:
            workers = list(client.scheduler_info()["workers"])
        assert len(workers) == 1 and workers[0].startswith("tcp://127.0.0.1:")
        raise RuntimeError("a failure inside the body")
    assert not [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


class KillFirstShard(threading.Thread):
    """SIGKILL the first cluster worker process that starts a score shard, while the shard runs.

    The first shard a worker runs loads the model before any score is written (seconds), so a kill as soon as its
    execution is logged lands mid-shard; how many shards had finished by then is recorded to check that."""

    def __init__(self, artifacts: Path, worker_pids: set[int]):
        super().__init__(daemon=True)
        self.artifacts, self.worker_pids = artifacts, worker_pids
        self.stop, self.killed = threading.Event(), None

    def run(self) -> None:
        while not self.stop.is_set():
            started = [e for e in executions(self.artifacts) if e["stage"] == "score_shard"]
            hit = next((e for e in started if e["pid"] in self.worker_pids), None)
            if hit is not None:
                os.kill(hit["pid"], signal.SIGKILL)
                psutil.Process(hit["pid"]).wait(timeout=30) if psutil.pid_exists(hit["pid"]) else None
                finished = sum(1 for d in (self.artifacts / "scores").glob("*/manifest.json"))
                self.killed = {"pid": hit["pid"], "key": hit["key"], "started": len(started), "finished": finished}
                return
            time.sleep(0.01)


def _worker_pids(cluster) -> set[int]:
    return {c.pid for w in cluster.workers for c in psutil.Process(w.pid).children(recursive=True)}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_cluster_selects_as_locally_and_a_killed_worker_costs_one_shard(prefect_harness, tiny_models, tmp_path):
    from test_select_flow import make_adapter, make_prepared_pool, project, run_select

    from pipeline.preprocess import load_prepared

    t0 = time.time()
    model = tiny_models["idefics3"]
    prepared = make_prepared_pool(tmp_path / "prepared", 16)
    ids = sorted(load_prepared(prepared["dir"])["sample_id"])
    pool = {"prepared": prepared, "adapter": make_adapter(model, tmp_path / "adapter"), "ids": ids,
            "exclude": ids[:1]}
    ref_local, ran_local = run_select(project(tmp_path / "local", model), pool)
    assert ran_local == {"score_shard": 4, "select": 1}

    with process_cluster(tmp_path / "cluster", n_workers=2, env={"PYTHONPATH": str(ROOT)}, cwd=ROOT) as cluster:
        # (c) The scheduler, the nannies and the workers listen on loopback only.
        assert cluster.address.startswith("tcp://127.0.0.1:")
        listening = cluster.listening()
        assert any(listening.values()) and {ip for socks in listening.values() for ip, _ in socks} == {"127.0.0.1"}

        cfg = project(tmp_path / "shared", model, runner="dask", dask_address=cluster.address)
        assert cfg.select.shard_size == 4 and len(ids) == 16  # 4 shards over 2 workers
        killer = KillFirstShard(cfg.artifacts, _worker_pids(cluster))
        killer.start()
        try:
            ref, ran = run_select(cfg, pool)
        finally:
            killer.stop.set()
            killer.join(timeout=10)
        t_round = time.time()

        # (b) The kill landed mid-shard, and Dask ran that shard again on a live worker; every other shard ran once.
        killed = killer.killed
        assert killed is not None and killed["finished"] < killed["started"]
        runs = Counter(e["key"] for e in executions(cfg.artifacts) if e["stage"] == "score_shard")
        assert len(runs) == 4 and runs[killed["key"]] == 2
        assert all(n == 1 for key, n in runs.items() if key != killed["key"])
        assert ran == {"score_shard": 5, "select": 1}
        pids = {e["pid"] for e in executions(cfg.artifacts) if e["stage"] == "score_shard"}
        assert os.getpid() not in pids and killed["pid"] in pids
        plan = plan_pool_scoring(cfg, prepared=prepared, adapter=pool["adapter"], pool_ids=ids)
        assert plan.shard_size == 4  # keyed as the score stage keys them (the model's identity included)
        assert scored_on_disk(plan.shards) is not None  # all four shards have verified scores

        # The round's re-run finds every shard scored: nothing is executed again.
        _, ran_again = run_select(cfg, pool)
        assert ran_again == {}
        assert cluster.scheduler.poll() is None  # the scheduler lived through the kill

    # (a) The same selection as the local runner's.
    rows_local = read_jsonl(Path(ref_local["dir"]) / "selection.jsonl")
    rows = read_jsonl(Path(ref["dir"]) / "selection.jsonl")
    assert [r["sample_id"] for r in rows] == [r["sample_id"] for r in rows_local]
    np.testing.assert_allclose([r["score"] for r in rows], [r["score"] for r in rows_local], atol=1e-5)
    print(f"\nreal cluster: round with a killed worker {t_round - t0:.1f} s after start, whole test "
          f"{time.time() - t0:.1f} s")
