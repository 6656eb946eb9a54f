"""Scheduler memory across rounds on one external Dask cluster (issue #23, item 4).

    python benchmarks/dask_cluster.py --json-out benchmarks/results/dask_cluster.json
    python benchmarks/dask_cluster.py --rounds 3 --pool 16          # a quick look

One `dask scheduler` and `--workers` single-threaded `dask worker` processes on 127.0.0.1
(`pipeline.model.distributed.process_cluster`), one `prefect server` (as a deployment would have), and this process
as the flow: it runs `--rounds` flow runs of the sharded scoring stage (`flows.select.score_pool`, the code a round
runs) with `select.runner: dask` and `dask_address` pointing at the scheduler. Each round uses a new seed, which is
part of every shard's key, so every round scores all its shards again (pool / shard_size tasks a round) with the
tiny 4-bit Idefics3. After each round: the scheduler's RSS (psutil), the tasks it still holds, the workers' RSS.

What is reported: `scheduler_rss_mb` per round, `scheduler_growth_mb_per_round` (least-squares slope over rounds
2..N: round 1 pays one-off imports and connections) and the same per task, `scheduler_tasks_held` (a scheduler
that forgets finished tasks holds 0 between rounds), the workers' totals the same way, and which of tamis'
heavy modules the scheduler process imported (it unpickles the tasks it is sent).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import _round_driver as driver  # noqa: E402
from benchmarks._results import write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "Which digit is shown in the image?"
WATCHED_MODULES = ("prefect", "flows.select", "pipeline.scoring", "torch", "transformers")


def build_pool(out_dir: Path, n: int, *, seed: int = 0) -> dict[str, str]:
    """A prepared pool of n generated images, as the select tests build one."""
    return driver.build_prepared_pool(out_dir, n, seed=seed, question=QUESTION)


def slope(ys: list[float]) -> float | None:
    """Least-squares growth per step of ys (None for fewer than 2 points)."""
    if len(ys) < 2:
        return None
    return float(np.polyfit(np.arange(len(ys), dtype=float), np.asarray(ys, dtype=float), 1)[0])


def _object_counts() -> dict[str, int]:
    """Live objects by type in the process this runs in (the scheduler, through run_on_scheduler)."""
    import gc
    from collections import Counter

    gc.collect()
    return dict(Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects()))


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import psutil

    from flows.settings import prefect_env
    from pipeline.model.distributed import process_cluster
    from pipeline.model.tiny import make_tiny_model

    artifacts = work / "project" / "artifacts"
    model_dir = make_tiny_model("idefics3", work / "model")
    prepared = build_pool(work / "prepared", args.pool)
    (artifacts / "prefect").mkdir(parents=True, exist_ok=True)  # Prefect makes its home without parents
    with driver.prefect_server(work / "server") as api:
        os.environ.update({**driver.OFFLINE_ENV, **prefect_env(artifacts), "PREFECT_API_URL": api,
                           "PREFECT_LOGGING_LEVEL": "WARNING"})
        # Prefect reads its settings on import: only now, with the server's URL in the environment.
        from prefect import flow

        from flows.select import score_pool
        from pipeline.config import ProjectConfig, parse_config
        from pipeline.preprocess import load_prepared
        from pipeline.store import executions

        @flow(name="bench-score-pool")
        def bench_round(cfg_data: dict, prepared: dict, pool_ids: list[str], round_dir: str) -> int:
            cfg = ProjectConfig.model_validate(cfg_data)
            return len(score_pool(cfg, prepared=prepared, adapter=None, pool_ids=pool_ids, round_dir=Path(round_dir)))

        ids = sorted(load_prepared(prepared["dir"])["sample_id"])
        worker_env = {"PYTHONPATH": str(ROOT), **driver.OFFLINE_ENV}
        with process_cluster(work / "cluster", n_workers=args.workers, env=worker_env, cwd=ROOT) as cluster, \
                cluster.client() as client:
            sched = psutil.Process(cluster.scheduler.pid)

            def workers_rss_mb() -> float:
                procs = [c for w in cluster.workers for c in psutil.Process(w.pid).children(recursive=True)]
                return sum(p.memory_info().rss for p in procs if p.is_running()) / 2**20

            rounds, rss0, counts = [], sched.memory_info().rss / 2**20, []
            for r in range(args.rounds):
                cfg = parse_config({
                    "seed": r,  # part of every shard's key: each round scores its whole pool again
                    "data": {"answers": [str(d) for d in range(10)], "question": QUESTION},
                    "model": {"name_or_path": str(model_dir), "family": "idefics3", "mode": "qlora"},
                    "select": {"shard_size": args.shard_size, "score_batch_size": args.shard_size, "runner": "dask",
                               "dask_address": cluster.address},
                    "paths": {"artifacts": str(artifacts)},
                })
                before = len(executions(artifacts))
                t = time.perf_counter()
                shards = bench_round(cfg.model_dump(mode="json"), prepared, ids,
                                     str(artifacts / "rounds" / f"{r:03d}"))
                wall = time.perf_counter() - t
                ran = sum(1 for e in executions(artifacts)[before:] if e["stage"] == "score_shard")
                held = client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks))
                rounds.append({"round": r, "wall_s": round(wall, 2), "shards": shards, "shards_executed": ran,
                               "scheduler_rss_mb": round(sched.memory_info().rss / 2**20, 1),
                               "scheduler_tasks_held": held, "workers_rss_mb": round(workers_rss_mb(), 1)})
                if args.probe:
                    counts.append(client.run_on_scheduler(_object_counts))
                print(rounds[-1], flush=True)
            listening = sorted({ip for socks in cluster.listening().values() for ip, _ in socks})
            # The scheduler unpickles each task it is sent: what that made it import, and so what it must have.
            imported = client.run_on_scheduler(lambda: sorted(m for m in WATCHED_MODULES if m in sys.modules))

    sched_mb = [x["scheduler_rss_mb"] for x in rounds]
    workers_mb = [x["workers_rss_mb"] for x in rounds]
    tasks_per_round = rounds[0]["shards"] if rounds else 0
    growth = slope(sched_mb[1:])
    probe = {}
    if len(counts) >= 2:  # what the scheduler holds more of after the last round than after the first
        diff = {k: counts[-1].get(k, 0) - counts[0].get(k, 0) for k in counts[-1]}
        probe = {"scheduler_objects_growth_first_to_last_round": dict(sorted(
            ((k, v) for k, v in diff.items() if v > 0), key=lambda kv: -kv[1])[:15])}
    return {
        "rounds": len(rounds), "pool": args.pool, "shard_size": args.shard_size, "workers": args.workers,
        "tasks_per_round": tasks_per_round, "tasks_total": sum(x["shards_executed"] for x in rounds),
        "scheduler_rss_start_mb": round(rss0, 1), "scheduler_rss_mb": sched_mb,
        "scheduler_rss_first_mb": sched_mb[0] if sched_mb else None,
        "scheduler_rss_last_mb": sched_mb[-1] if sched_mb else None,
        "scheduler_growth_mb_per_round": None if growth is None else round(growth, 3),
        "scheduler_growth_kib_per_task": (None if growth is None or not tasks_per_round
                                          else round(growth * 1024 / tasks_per_round, 2)),
        "scheduler_tasks_held": [x["scheduler_tasks_held"] for x in rounds],
        "workers_rss_mb": workers_mb,
        "workers_growth_mb_per_round": None if len(workers_mb) < 3 else round(slope(workers_mb[1:]), 3),
        "round_wall_s": [x["wall_s"] for x in rounds],
        "every_shard_scored_each_round": all(x["shards_executed"] == x["shards"] for x in rounds),
        "cluster_listens_on": listening,
        "scheduler_imported": imported,
        **probe,
        "per_round": rounds,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--pool", type=int, default=128)
    p.add_argument("--shard-size", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--probe", action="store_true",
                   help="count the scheduler's live objects by type after each round (gc; slower)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="tamis-dask-cluster-") as tmp:
        result = run(args, Path(tmp))
    config = {k: getattr(args, k) for k in ("rounds", "pool", "shard_size", "workers")}
    return write_result({"benchmark": "dask_cluster", "config": config, **result}, args.json_out, config=config,
                        started=started)


if __name__ == "__main__":
    main()
