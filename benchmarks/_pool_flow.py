"""pool_scale.py --part flow: rounds through the real flow on pools of distinct digit PNGs on disk (issue #23).

Per pool size (--flow-pools, e.g. 10000,100000 or 1000000): a folder of N distinct 28×28 PNGs (ingest_scale's
generator: a digit upscaled, shifted and noised; the ground truth keyed by file name), the tiny 4-bit Idefics3, pixel
selection embeddings, `select.candidates: restrict`, a held-out test split of 100 shipped digits, MaxHerding cold start, batch 100. Each round runs in a fresh
process against one shared `prefect server` (benchmarks/_round_driver.py), in this order:

1. first     round 0: ingest, prepare, quality, embeddings, cold-start selection, export; the simulated annotator
             answers the batch into the inbox;
2. steady    round 1: import those labels, train, evaluate, candidates, score them, select, export;
3. unchanged the same round again through the flow (a replay: no stage body runs; key unchanged_flow_replay_s_*),
             then `tamis round` as a user types it (the CLI sees nothing changed before any flow or server starts;
             key unchanged_round_s_*, the measure resume.json reports for the demo);
4. add       --flow-add new images (10,000) written to the folder, then a round: what it executed, and its time.

Per run: wall seconds, the stage bodies it executed (artifacts/executions.jsonl, with the seconds from each body's
start to the next one's or to the flow's end: what runs between bodies, e.g. the summary after export, counts to
the body before it) and the process's peak RSS.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from benchmarks import _round_driver as driver
from benchmarks.ingest_scale import write_pool
from pipeline.data.demo import write_digits

QUESTION = "Which digit is shown in the image?"


def _ground_truth(path: Path, start: int, stop: int) -> None:
    """Answers of images start..stop-1, keyed by file name as the simulated annotator reads them (appended)."""
    from sklearn.datasets import load_digits

    target = load_digits().target
    with path.open("a", encoding="utf-8") as f:
        for i in range(start, stop):
            f.write(json.dumps({"image": f"{i:07d}.png", "answer": str(int(target[i % len(target)]))}) + "\n")


def _project(root: Path, n: int, add: int, model: Path, seed: int) -> Path:
    """The project folder, fresh: its n images (written once, kept between runs), no added ones, no artifacts."""
    pool, truth, marker = root / "pool", root / "ground_truth.jsonl", root / "images.txt"
    if not marker.is_file() or marker.read_text() != str(n):
        write_pool(pool, 0, n, seed)
        marker.write_text(str(n))
    for i in range(n, n + add):
        (pool / f"{i:07d}.png").unlink(missing_ok=True)
    truth.unlink(missing_ok=True)
    _ground_truth(truth, 0, n)
    shutil.rmtree(root / "artifacts", ignore_errors=True)
    # Held-out labeled rows every round evaluates on: the test split of 400 of the shipped digits.
    digits = write_digits(root / "digits", limit=400)
    test = [r for r in map(json.loads, (digits / "manifest.jsonl").open()) if r["split"] == "test"]
    (digits / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    cfg = {
        "seed": seed,
        "paths": {"artifacts": str(root / "artifacts")},
        "data": {"sources": [{"kind": "folder", "path": str(pool)}, {"kind": "jsonl", "path": str(digits / "test.jsonl")}],
                 "answers": [str(d) for d in range(10)],
                 "question": QUESTION, "ground_truth": str(truth)},
        "preprocess": {"size": 32, "pad": "square", "num_proc": 1},
        "model": {"name_or_path": str(model), "family": "idefics3", "mode": "qlora"},
        "train": {"batch_size": 4, "effective_batch_size": 4, "max_steps": 10, "learning_rate": 0.002,
                  "checkpoint_every": 5},
        "select": {"batch_size": 100, "strategy": "margin", "diversity": "k_center", "cold_start": "maxherding",
                   "embeddings": {"source": "pixels"}, "candidates": {"method": "restrict"}},
        "labelcheck": {"method": "heldout"},
        "rounds": {"max_rounds": 50, "simulate_annotator": False},
    }
    path = root / "tamis.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _summary(run: driver.RoundRun) -> dict[str, Any]:
    if run.error or run.returncode:
        raise SystemExit(f"pool_scale flow: a round failed ({run.returncode}):\n{run.error}")
    # A body runs from its start to the next one's start (or to the flow's end, for the last).
    times = [e["time"] for e in run.executed] + [run.flow_end or 0.0]
    per_stage: Counter[str] = Counter()
    for e, nxt in zip(run.executed, times[1:], strict=False):
        per_stage[e["stage"]] += nxt - e["time"]
    return {"wall_s": round(run.wall_s, 1), "import_s": run.import_s, "flow_s": run.flow_s, "rss_mb": run.rss_mb,
            "cpu_s": run.cpu_s,
            "stages_executed": dict(Counter(run.stages)),
            "stage_s": {k: round(v, 1) for k, v in per_stage.items()},
            "round": (run.state or {}).get("round"), "selected": (run.state or {}).get("selected")}


def run_pool_flow(args: Any) -> dict[str, Any]:
    from pipeline.model.tiny import make_tiny_model

    work = Path(args.work_dir or "/tmp/tamis-pool-scale") / "flow"
    model = work / "model"
    if not (model / "config.json").is_file():
        make_tiny_model("idefics3", model)
    pools = [int(p) for p in args.flow_pools.split(",")]
    out: dict[str, Any] = {"flow_pools": pools, "flow_add": args.flow_add, "flow_runs": {}}
    with driver.prefect_server(work / "server") as api:
        for n in pools:
            root = work / f"pool-{n}"
            t = time.perf_counter()
            config = _project(root, n, args.flow_add, model, args.seed)
            runs: dict[str, Any] = {"write_pool_s": round(time.perf_counter() - t, 1)}
            runs["first"] = _summary(driver.run_round(config, api_url=api, simulate=True, timeout_s=7200))
            runs["steady"] = _summary(driver.run_round(config, api_url=api, simulate=False, timeout_s=7200))
            runs["unchanged_flow"] = _summary(driver.run_round(config, api_url=api, simulate=False, timeout_s=7200))
            runs["unchanged_cli"] = driver.cli_round(config, api)
            t = time.perf_counter()
            write_pool(root / "pool", n, n + args.flow_add, args.seed)
            _ground_truth(root / "ground_truth.jsonl", n, n + args.flow_add)
            runs["add_write_s"] = round(time.perf_counter() - t, 1)
            runs["add"] = _summary(driver.run_round(config, api_url=api, simulate=False, timeout_s=7200))
            out["flow_runs"][str(n)] = runs
            label = _label(n)
            out[f"first_round_s_{label}"] = runs["first"]["wall_s"]
            out[f"steady_round_s_{label}"] = runs["steady"]["wall_s"]
            # An unchanged round as a user runs it: `tamis round`, which knows before any flow that it would only
            # replay (the demo's figure in resume.json is the same measure); the flow's own replay beside it.
            out[f"unchanged_round_s_{label}"] = runs["unchanged_cli"]["total_s"]
            out[f"unchanged_flow_replay_s_{label}"] = runs["unchanged_flow"]["wall_s"]
            out[f"add_{_label(args.flow_add)}_s_{label}"] = runs["add"]["wall_s"]
    if len(pools) > 1:
        big, small = _label(pools[-1]), _label(pools[-2])
        out[f"rss_ratio_{big}_{small}"] = round(out["flow_runs"][str(pools[-1])]["steady"]["rss_mb"]
                                                / out["flow_runs"][str(pools[-2])]["steady"]["rss_mb"], 3)
    return out


def _label(n: int) -> str:
    """10000 → 10k, 1000000 → 1m: the suffixes of the result keys."""
    if n % 1_000_000 == 0:
        return f"{n // 1_000_000}m"
    return f"{n // 1000}k" if n % 1000 == 0 else str(n)
