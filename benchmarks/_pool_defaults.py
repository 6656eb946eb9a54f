"""pool_scale.py --part defaults: a pool of --defaults-pool distinct PNGs (100,000) with the config `tamis init` writes
for it, untouched (issue 34): what a team's own large pool costs with the defaults.

The project: the pool folder (ingest_scale's generator, as --part flow), a test folder of 400 shipped digits with a
`labels.csv` (file,category), the tiny 4-bit Idefics3 passed as `--model`. `tamis init` writes tamis.yaml (the
benchmark edits nothing in it); then, each in a fresh process against one shared `prefect server`:

1. first     round 0: ingest, prepare, quality, embeddings, cold-start selection, export;
2. labels    an annotator's answers: round 0's export CSV with its label column filled from the ground truth
             (matched by the `original_image` file name), dropped into artifacts/inbox/;
3. steady    round 1: import, train, evaluate, candidates (select.candidates: auto, recorded with its reason),
             scoring, selection, export;
4. no-op     `tamis ingest` as a user types it, with nothing new (its wall time, whether a flow started); then
             `tamis round` twice: the first replays round 1 through the flow (round 1 imported labels, so its inputs
             changed), the second is the no-op.
"""

from __future__ import annotations

import csv
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import _round_driver as driver
from benchmarks._pool_flow import _label, _summary
from benchmarks._results import code_version, cpu_seconds
from benchmarks.ingest_scale import write_pool
from pipeline.data.demo import write_digits


def _tamis(*args: str, cwd: Path, art: Path, api: str | None) -> tuple[float, str, float]:
    """(wall seconds, output, CPU seconds) of `tamis ARGS` as a user types it."""
    t, cpu = time.perf_counter(), cpu_seconds(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([str(Path(sys.executable).with_name("tamis")), *args], cwd=cwd, capture_output=True,
                          text=True, env=driver.child_env(art, api), timeout=3600, check=False)
    if proc.returncode:
        raise SystemExit(f"tamis {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return (round(time.perf_counter() - t, 2), proc.stdout + proc.stderr,
            round(cpu_seconds(resource.RUSAGE_CHILDREN) - cpu, 2))


def _test_folder(root: Path) -> Path:
    """400 shipped digits' test split as images + labels.csv (file,category), outside the pool folder."""
    digits = write_digits(root / "digits", limit=400)
    rows = [r for r in map(json.loads, (digits / "manifest.jsonl").open()) if r["split"] == "test"]
    truth = {r["image"]: r["answer"] for r in map(json.loads, (digits / "ground_truth.jsonl").open())}
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["file", "category"])
    for r in rows:
        w.writerow([r["image"], r.get("answer") or truth[r["image"]]])
    (digits / "labels.csv").write_text(buf.getvalue())
    return digits / "labels.csv"


def _label_export(export: Path, inbox: Path, answer_of: Any) -> int:
    """The annotator: round 0's annotate.csv with every label filled in, by original file name, into the inbox."""
    with (export / "annotate.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["label"] = answer_of(r["original_image"])
    inbox.mkdir(parents=True, exist_ok=True)
    with (inbox / "round-000.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return len(rows)


FIRST_COPY = "after-round-0"  # beside the project: its artifacts as round 0 left them (--defaults-keep-first)


def copy_project(src: Path, dst: Path, *, link_above: int = 1 << 20) -> None:
    """A copy of `src` (artifacts) at `dst` whose files over `link_above` bytes are hard links: the stages write
    their outputs once (new files renamed into place), never in place, so a link stays what round 0 wrote; the
    small files (ledgers and records that are appended to) are real copies. Seconds for a 10⁶-image project."""
    shutil.rmtree(dst, ignore_errors=True)
    for folder, _, files in os.walk(src):
        out = dst / Path(folder).relative_to(src)
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            f = Path(folder) / name
            if f.is_symlink() or f.stat().st_size <= link_above:
                shutil.copy2(f, out / name, follow_symlinks=False)
            else:
                os.link(f, out / name)


def _init_project(root: Path, model: Path, art: Path) -> dict[str, Any]:
    shutil.rmtree(art, ignore_errors=True)
    (root / "tamis.yaml").unlink(missing_ok=True)
    labels = _test_folder(root)
    init_s, init_out, _ = _tamis("init", "pool", "--test", str(labels.relative_to(root)), "--model", str(model),
                              "--out", "tamis.yaml", cwd=root, art=art, api=None)
    return {"defaults_init_s": init_s, "defaults_config": (root / "tamis.yaml").read_text(),
            "defaults_init_output": init_out}


def _first_round(args: Any, root: Path, config: Path, art: Path, api: str, init: dict[str, Any]) -> dict[str, Any]:
    """Round 0, run, or restored from the copy an earlier run kept (--defaults-from-first): a 10⁶ pool's round 0
    takes 40+ min on 2 shared cores, and what a steady round and a no-op ingest cost does not depend on who ran it."""
    keep = root / FIRST_COPY
    if args.defaults_from_first:
        if not (keep / "first.json").is_file():
            raise SystemExit(f"--defaults-from-first: no {keep}/first.json; run once with --defaults-keep-first")
        copy_project(keep / "artifacts", art)
        return {**json.loads((keep / "first.json").read_text()), "defaults_first_restored_from": str(keep)}
    first = driver.run_round(config, api_url=api, simulate=False, timeout_s=7200)
    out = {"defaults_first": _summary(first), "defaults_first_export": first.state["export_dir"],
           "defaults_first_commit": code_version()}
    if args.defaults_keep_first:
        copy_project(art, keep / "artifacts")
        (keep / "first.json").write_text(json.dumps({**init, **out}))  # what a restored run reports of them
    return out


def run_pool_defaults(args: Any) -> dict[str, Any]:
    from sklearn.datasets import load_digits

    from pipeline.model.tiny import make_tiny_model

    n = args.defaults_pool
    work = Path(args.work_dir or "/tmp/tamis-pool-scale") / "defaults"
    model = work / "model"
    if not (model / "config.json").is_file():
        make_tiny_model("idefics3", model)
    root = work / f"pool-{n}"
    pool, marker = root / "pool", root / "images.txt"
    t = time.perf_counter()
    # A pool already on disk is kept between runs (writing 10⁶ PNGs takes 10-30 min here): keyed by count and seed.
    if not marker.is_file() or marker.read_text() != f"{n} seed {args.seed}":
        write_pool(pool, 0, n, args.seed)
        marker.write_text(f"{n} seed {args.seed}")
    write_s = round(time.perf_counter() - t, 1)
    art, config = root / "artifacts", root / "tamis.yaml"
    out: dict[str, Any] = {"defaults_pool": n, "defaults_write_pool_s": write_s}
    if not args.defaults_from_first:
        out.update(_init_project(root, model, art))
    target = load_digits().target
    with driver.prefect_server(work / "server") as api:
        out.update(_first_round(args, root, config, art, api,
                                init={k: v for k, v in out.items() if k.startswith(("defaults_init", "defaults_config"))}))
        out["defaults_labeled"] = _label_export(Path(out["defaults_first_export"]), art / "inbox",
                                                lambda name: str(int(target[int(Path(name).stem) % len(target)])))
        out.update(_after_labels(root, config, art, api))
    label = _label(n)
    out[f"steady_round_s_{label}_defaults"] = out["defaults_steady"]["wall_s"]
    out[f"noop_ingest_s_{label}_defaults"] = out["defaults_noop_ingest"]["total_s"]
    out[f"noop_round_s_{label}_defaults"] = out["defaults_noop_round"]["total_s"]
    out[f"candidates_{label}_defaults"] = (out["defaults_steady"]["candidates"] or {}).get("method")
    return out


def _after_labels(root: Path, config: Path, art: Path, api: str) -> dict[str, Any]:
    """The steady round, a no-op `tamis ingest`, and `tamis round` twice (replay, then no-op)."""
    out: dict[str, Any] = {}
    steady = driver.run_round(config, api_url=api, simulate=False, timeout_s=7200)
    out["defaults_steady"] = {**_summary(steady), "candidates": steady.state.get("candidates"),
                              "strategy": steady.state.get("strategy")}
    ingest_s, ingest_out, ingest_cpu = _tamis("ingest", "--config", "tamis.yaml", cwd=root, art=art, api=api)
    out["defaults_noop_ingest"] = {"total_s": ingest_s, "cpu_s": ingest_cpu,
                                   "flow_started": "nothing changed since the last ingest" not in ingest_out}
    # Round 1 imported labels, so the next run goes through the flow (a replay of round 1); the one after
    # has nothing to do and says so without a flow.
    out["defaults_replay_round"] = driver.cli_round(config, api)
    out["defaults_noop_round"] = driver.cli_round(config, api)
    return out
