"""Resume benchmark (issue #7): what a re-run costs after a finished round, and after a SIGKILL in training or scoring.

    python benchmarks/resume.py --json-out benchmarks/results/resume.json
    python benchmarks/resume.py --quick                    # 60 digits, 8 steps: a few minutes
    python benchmarks/resume.py --steps 40                 # a smaller round than the demo's 100 steps

Each round runs in its own Python process against one shared local `prefect server` (PREFECT_API_URL), as a
deployment or `tamis round` with a server would. Four projects read the same digits and tiny 4-bit Idefics3 model:
1. cold: a fresh project (some seed labels, so the first round trains), then the same round again with nothing
   changed (simulated annotator off, so the labeled set stays the same);
2. the same cold round, SIGKILLed during training (a little after a mid-way checkpoint), then re-run;
3. the same cold round, SIGKILLed during pool scoring (after half the shards), then re-run.
4. (full mode) the re-run of 1 once more, with Prefect's ephemeral server instead of the shared one.
5. `tamis round` on project 1 as a user runs it (a fresh CLI process): unchanged (`unchanged_cli_server_s`, and
   `unchanged_cli_no_server_s` without PREFECT_API_URL: the CLI sees nothing changed before any flow or server
   starts; targets 8 s and 15 s), and `--full` against the server (`replay_cli_server`: the flow's replay).

Per run: `total_s` (the whole process: interpreter, imports, flow), `import_s` (importing flows.round and the
libraries its stages load lazily: torch, transformers, peft, datasets, matplotlib, prefect), `flow_s` (the
labeling_round call alone: Prefect orchestration, cache look-ups, digest checks, the work), the stage bodies it
executed (artifacts/executions.jsonl) and the stage outputs it wrote (manifests new or rewritten: the work it really
did). `rerun_ratio` = re-run flow_s ÷ cold flow_s (target ≤ 0.05): start-up and imports are the same fixed cost for
any command and say nothing about caching; `rerun_ratio_total` is the same ratio on total_s, and
`rerun_ephemeral_server` is the re-run without a server (Prefect starts one inside the flow call: 20-60 s here).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import _round_driver as driver  # noqa: E402
from benchmarks._results import CacheFolder, write_result  # noqa: E402

# Full mode: one round of the demo's size (configs/demo.yaml: its LoRA, batch, step budget and label check) on 300
# digits with 40 seed labels so that the first round trains; the pool is scored in 32-sample shards (the unit a kill
# resumes at).
FULL = {"digits": 300, "seed_labels": 40, "shard_size": 32, "select_batch": 40, "demo": True}
QUICK = {"digits": 60, "seed_labels": 12, "shard_size": 8, "select_batch": 6, "demo": False,
         "train": {"max_steps": 8, "checkpoint_every": 2, "batch_size": 4, "effective_batch_size": 4}}
DEMO_MODEL = ("lora_r", "lora_alpha", "lora_dropout", "target_modules")
DEMO_TRAIN = ("batch_size", "effective_batch_size", "max_steps", "learning_rate", "checkpoint_every")


def manifests(artifacts: Path) -> dict[str, int]:
    return {str(m.relative_to(artifacts)): m.stat().st_mtime_ns for m in artifacts.rglob("manifest.json")}


def written(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Stage outputs (manifests) a run wrote, by kind: the work it really did. An executed body may only find its
    outputs complete on disk (killed before Prefect recorded its result) and write nothing."""
    kinds = [k.rsplit("/", 1)[0] if k.startswith("rounds/") else k.split("/", 1)[0]
             for k, t in after.items() if before.get(k) != t]
    return dict(Counter(kinds))


def summary(run: driver.RoundRun, before: dict[str, int] | None = None, after: dict[str, int] | None = None
            ) -> dict[str, Any]:
    out = {"total_s": round(run.wall_s, 2), "import_s": run.import_s, "flow_s": run.flow_s,
           "stages_executed": dict(Counter(run.stages))}
    if after is not None:
        out["outputs_written"] = written(before or {}, after)
    if run.kill:
        out["killed_at"] = run.kill
    if run.error:
        out["error"] = run.error[-2000:]
    return out


def resumed_from(run: driver.RoundRun) -> int | None:
    for line in run.log.read_text(errors="replace").splitlines():
        if "resuming training from " in line and "(step " in line:
            return int(line.rsplit("(step ", 1)[1].split()[0])
    return None


def redone(killed: driver.RoundRun, rerun: driver.RoundRun) -> list[str]:
    """Stage bodies (same cache key) the killed run had started and the re-run executed again."""
    started = {e["key"] for e in killed.executed}
    return [e["stage"] for e in rerun.executed if e["key"] in started]


def check(run: driver.RoundRun, what: str) -> driver.RoundRun:
    if run.error or (run.state is None and not run.killed):
        raise SystemExit(f"{what} failed:\n{run.error}")
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="60 digits, 8 training steps (a few minutes)")
    ap.add_argument("--digits", type=int, help="digits in the project (default 300; quick 60)")
    ap.add_argument("--steps", type=int, help="training steps of the round (default: the demo's; quick 8)")
    ap.add_argument("--no-ephemeral", action="store_true", help="skip the re-run with an ephemeral Prefect server")
    ap.add_argument("--work-dir", type=Path, help="where the projects go (default: a new temp folder)")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    started = time.time()

    p = dict(QUICK if args.quick else FULL)
    p["digits"] = args.digits or p["digits"]
    model_cfg: dict[str, Any] = {}
    if p.pop("demo"):
        import yaml

        demo = yaml.safe_load((driver.ROOT / "configs" / "demo.yaml").read_text())
        model_cfg = {k: demo["model"][k] for k in DEMO_MODEL if k in demo["model"]}
        p["train"] = {k: demo["train"][k] for k in DEMO_TRAIN if k in demo["train"]}
        p["labelcheck"] = demo.get("labelcheck", {})
    if args.steps:
        p["train"]["max_steps"] = args.steps
    steps, every = p["train"]["max_steps"], p["train"]["checkpoint_every"]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="tamis-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    # Re-runs inside the benchmark reuse what its own cold runs made (that is the measurement); only outputs already
    # in --work-dir before it started count as reused from a cache.
    cache = CacheFolder(work)

    from pipeline.data.demo import write_digits
    from pipeline.model.tiny import make_tiny_model

    model = work / "model"
    if not (model / "config.json").is_file():
        make_tiny_model("idefics3", model)
    digits = write_digits(work / "digits", limit=p["digits"])
    overrides = {
        "model": model_cfg,
        "train": p["train"],
        "select": {"shard_size": p["shard_size"], "batch_size": p["select_batch"]},
        "rounds": {"simulate_annotator": False},
        # The demo's label check (heldout) has nothing to check in a first round; k-fold would add 3 trainings.
        "labelcheck": p.get("labelcheck", {"method": "heldout"}),
    }

    def project(name: str) -> Path:
        return driver.write_project(work / name, model_dir=model, digits_dir=digits, seed_labels=p["seed_labels"],
                                    **overrides)

    mid = max(every, steps // 2 // every * every)
    load = os.getloadavg()[0]
    out: dict[str, Any] = {}
    with driver.prefect_server(work / "server") as api:
        def pair(name: str, kill: driver.Kill | None, what: str) -> tuple[driver.RoundRun, driver.RoundRun, dict]:
            """A first run (killed or not), then the same round again; summaries with the outputs each wrote."""
            cfg = project(name)
            art = cfg.parent / "artifacts"
            first = check(driver.run_round(cfg, api_url=api, kill=kill), what)
            m1 = manifests(art)
            second = check(driver.run_round(cfg, api_url=api), f"re-run after: {what}")
            return first, second, {"first": summary(first, {}, m1), "rerun": summary(second, m1, manifests(art))}

        cold, rerun, s = pair("cold", None, "cold round")
        shards = Counter(cold.stages)["score_shard"]
        out["cold"], out["rerun"] = s["first"], s["rerun"]

        # The same unchanged round as a user runs it: the CLI knows it has nothing to do before any flow.
        out["unchanged_cli_server"] = driver.cli_round(work / "cold" / "tamis.yaml", api)
        out["replay_cli_server"] = driver.cli_round(work / "cold" / "tamis.yaml", api, "--full")

        killed, again, s = pair("kill-train", driver.Kill(path=f"train/*/checkpoints/step-{mid}", delay=2.0),
                                "round killed in training")
        out["killed_in_training"] = {
            "killed_run": s["first"], "rerun": s["rerun"], "redone_stages": redone(killed, again),
            "resumed_from_step": resumed_from(again), "total_steps": steps,
        }

        killed, again, s = pair("kill-score", driver.Kill(path="scores/*/manifest.json", nth=max(1, shards // 2)),
                                "round killed in scoring")
        out["killed_in_scoring"] = {
            "killed_run": s["first"], "rerun": s["rerun"], "redone_stages": redone(killed, again),
            "shards_total": shards, "shards_scored_on_rerun": s["rerun"]["outputs_written"].get("scores", 0),
        }

    if not args.no_ephemeral and not args.quick:
        eph = check(driver.run_round(work / "cold" / "tamis.yaml", api_url=None), "re-run, ephemeral server")
        out["rerun_ephemeral_server"] = summary(eph)
        out["unchanged_cli_no_server"] = driver.cli_round(work / "cold" / "tamis.yaml", None)

    ratio = out["rerun"]["flow_s"] / out["cold"]["flow_s"]
    result = {
        "benchmark": "resume",
        "mode": "quick" if args.quick else "full",
        "rerun_ratio": round(ratio, 4),
        "rerun_ratio_basis": "flow_s (the labeling_round call) of the unchanged re-run / of the cold round; "
                             "process start-up and imports excluded (see total_s / import_s)",
        "rerun_ratio_total": round(out["rerun"]["total_s"] / out["cold"]["total_s"], 4),
        "target_rerun_ratio": 0.05,
        "meets_target": ratio <= 0.05,
        "unchanged_cli_server_s": out["unchanged_cli_server"]["total_s"],
        "unchanged_cli_no_server_s": out.get("unchanged_cli_no_server", {}).get("total_s"),
        "unchanged_cli_targets_s": {"server": 8, "no_server": 15},
        "resume_after_training_kill_ratio": round(
            out["killed_in_training"]["rerun"]["flow_s"] / out["cold"]["flow_s"], 4),
        "resume_after_scoring_kill_ratio": round(
            out["killed_in_scoring"]["rerun"]["flow_s"] / out["cold"]["flow_s"], 4),
        **out,
        "params": {**p, "model": model_cfg, "pool_shards": shards, "kill_training_after_checkpoint": mid},
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_at_start": round(load, 2), "python": platform.python_version()},
        "work_dir": str(work),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    write_result(result, args.json_out, cache=cache, started=started, config={"params": result["params"],
                                                                          "ephemeral": not args.no_ephemeral})


if __name__ == "__main__":
    main()
