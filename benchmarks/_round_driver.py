"""Run one labeling round in a subprocess and SIGKILL it at a chosen point (shared by the fault-injection tests and
benchmarks/resume.py).

Two ways to kill, both outside the library (nothing here ships in `pipeline/` or `flows/`):
- from outside: the parent watches the artifacts folder (a stage body logging itself in executions.jsonl, a path
  appearing, e.g. a checkpoint or a score shard's manifest) and SIGKILLs the child's process group;
- from inside, for points too brief to catch by polling: the child (this file run as a script) wraps `os.replace`
  or listens to Python's `open` audit event and SIGKILLs itself when the destination / opened file matches a glob.

Every child talks to one shared `prefect server start` (PREFECT_API_URL): an ephemeral server per process takes
10-40 s to start here, which would swamp both the tests and a fair re-run timing.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import importlib
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
BIN = Path(sys.executable).parent
OFFLINE_ENV = {
    "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "NO_ALBUMENTATIONS_UPDATE": "1",
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
}


def is_temp_name(name: str) -> bool:
    """Names of atomic writes in progress (store.atomic_write_bytes / atomic_dir): readers must never use them."""
    return name.startswith(".") and (name.endswith(".tmp") or ".old-" in name)


def temp_leftovers(artifacts: Path) -> list[Path]:
    """Outermost temp files/folders under `artifacts` (a killed atomic write leaves these behind)."""
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(artifacts):
        for name in [*dirnames, *filenames]:
            if is_temp_name(name):
                out.append(Path(dirpath) / name)
        dirnames[:] = [d for d in dirnames if not is_temp_name(d)]
    return sorted(out)


# -------------------------------------------------------------------------------------------- shared server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else "<no log>"


def _kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


@contextlib.contextmanager
def prefect_server(home: Path, *, timeout_s: float = 240) -> Iterator[str]:
    """`prefect server start` on 127.0.0.1 with its own PREFECT_HOME → its API URL; stopped on exit."""
    import httpx

    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({**OFFLINE_ENV, "PREFECT_HOME": str(home / "home"), "PREFECT_UI_ENABLED": "false"})
    port = _free_port()
    log = home / "server.log"
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, cwd=home, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, start_new_session=True)
    api = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"prefect server exited with {server.returncode}:\n{_tail(log)}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{api}/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"prefect server not healthy after {timeout_s:.0f} s:\n{_tail(log)}")
            time.sleep(0.5)
        yield api
    finally:
        if server.poll() is None:
            _kill_group(server, signal.SIGTERM)
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                _kill_group(server)
                server.wait(timeout=20)


# --------------------------------------------------------------------------------------------- projects
def write_project(root: Path, *, model_dir: Path, digits_dir: Path, seed_labels: int = 0,
                  **overrides: dict[str, Any]) -> Path:
    """A tamis.yaml under `root` (artifacts in root/artifacts) over a digits folder (pipeline.data.demo.write_digits)
    and a tiny model folder. `seed_labels` pool rows become labeled train rows (answers from the ground truth), so
    the first round already trains. Projects sharing `model_dir` and `digits_dir` give byte-identical artifacts."""
    import yaml

    manifest = digits_dir / "manifest.jsonl"
    if seed_labels:
        truth = {r["image"]: r["answer"] for r in map(json.loads, (digits_dir / "ground_truth.jsonl").open())}
        rows, n = [], 0
        for r in map(json.loads, manifest.open()):
            if r["split"] == "pool" and n < seed_labels:
                r, n = {**r, "split": "train", "answer": truth[r["image"]]}, n + 1
            rows.append(r)
        manifest = digits_dir / f"manifest-seed{seed_labels}.jsonl"
        manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg: dict[str, Any] = {
        "seed": 0,
        "paths": {"artifacts": str(root / "artifacts")},
        "data": {"sources": [{"kind": "jsonl", "path": str(manifest)}], "answers": [str(d) for d in range(10)],
                 "question": "Which digit is shown in the image?",
                 "ground_truth": str(digits_dir / "ground_truth.jsonl")},
        "preprocess": {"size": 32, "pad": "square", "num_proc": 1},
        "model": {"name_or_path": str(model_dir), "family": "idefics3", "mode": "qlora"},
        "train": {"batch_size": 4, "effective_batch_size": 4, "max_steps": 6, "learning_rate": 0.002,
                  "checkpoint_every": 2},
        "select": {"batch_size": 6, "strategy": "margin", "diversity": "cluster_margin", "shard_size": 16},
        "rounds": {"max_rounds": 5, "simulate_annotator": True},
    }
    for section, values in overrides.items():
        cfg.setdefault(section, {}).update(values)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "tamis.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# ------------------------------------------------------------------------------------------------ kills
@dataclass
class Kill:
    """Where to SIGKILL a round. Exactly one of:
    stage:      after the n-th body of this stage starts in this run (a line in executions.jsonl), + `delay` s;
    path:       after a new path matching this glob (relative to artifacts) appears, + `delay` s;
    on_replace: inside the child, just before os.replace renames onto a matching path (an atomic write whose temp
                file or folder is complete but not yet in place), the n-th time;
    on_open:    inside the child, when it opens a matching file (the audit event fires before the open), n-th time.
    """

    stage: str | None = None
    path: str | None = None
    on_replace: str | None = None
    on_open: str | None = None
    nth: int = 1
    delay: float = 0.0

    def describe(self) -> str:
        what = next(f"{k}={v}" for k, v in (("stage", self.stage), ("path", self.path),
                                             ("on_replace", self.on_replace), ("on_open", self.on_open)) if v)
        return f"{what} #{self.nth}" + (f" +{self.delay:.2f}s" if self.delay else "")


@dataclass
class RoundRun:
    returncode: int
    killed: bool
    wall_s: float  # the whole subprocess: interpreter, imports, flow
    log: Path
    kill: str | None = None
    import_s: float | None = None  # importing flows.round and the libraries its stages load (torch, prefect …)
    flow_s: float | None = None  # the labeling_round call alone
    state: dict[str, Any] | None = None
    executed: list[dict[str, Any]] = field(default_factory=list)  # stage bodies this run started
    temp_reads: list[str] = field(default_factory=list)  # opens of temp leftovers that existed when it started
    error: str | None = None  # the log's tail when the round failed (neither finished nor killed)
    rss_mb: float | None = None  # the round process's peak RSS
    cpu_s: float | None = None  # CPU seconds (user + system) of the round process and the children it waited on
    flow_end: float | None = None  # time.time() when labeling_round returned

    @property
    def stages(self) -> list[str]:
        return [e["stage"] for e in self.executed]


def child_env(artifacts: Path, api_url: str | None) -> dict[str, str]:
    from flows.settings import prefect_env

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update({**OFFLINE_ENV, **prefect_env(artifacts), "PYTHONPATH": str(ROOT), "PREFECT_LOGGING_LEVEL": "WARNING"})
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def cli_round(config: Path, api_url: str | None, *extra: str) -> dict[str, Any]:
    """`tamis round` as a user types it (a fresh process, the CLI's own start-up): wall time, whether a flow ran,
    and the stage bodies it executed."""
    from pipeline.store import executions

    art = config.parent / "artifacts"
    from benchmarks._results import cpu_seconds

    runs = len(list(executions(art)))
    t, cpu = time.perf_counter(), cpu_seconds(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([str(Path(sys.executable).with_name("tamis")), "round", "--config", str(config), *extra],
                          env=child_env(art, api_url), cwd=config.parent, capture_output=True, text=True,
                          timeout=900, check=False)
    wall = time.perf_counter() - t
    if proc.returncode:
        raise SystemExit(f"tamis round {' '.join(extra)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return {"total_s": round(wall, 2), "cpu_s": round(cpu_seconds(resource.RUSAGE_CHILDREN) - cpu, 2),
            "flow_started": "nothing changed since it ran" not in proc.stdout,
            "stages_executed": len(list(executions(art))) - runs}


def _executions(artifacts: Path, pid: int) -> list[dict[str, Any]]:
    from pipeline.store import executions

    return [e for e in executions(artifacts) if e.get("pid") == pid]


def run_round(config: Path, *, api_url: str | None, kill: Kill | None = None, simulate: bool | None = None,
              disk_full: str | None = None, labelcheck_oracle: Path | None = None, timeout_s: float = 1200,
              log_dir: Path | None = None, poll_s: float = 0.02) -> RoundRun:
    """Run flows.round.labeling_round(config) in a fresh Python process, killed as `kill` says (or not).

    `disk_full`: a glob (relative to artifacts); opening a matching file for writing fails with ENOSPC in the child.
    `labelcheck_oracle`: a ground-truth JSONL (sample_id, answer); see _oracle_label_check.
    A run that exits with an error (not killed) returns with `error` set to the tail of its log."""
    from pipeline.config import load_config

    artifacts = load_config(config).artifacts
    artifacts.mkdir(parents=True, exist_ok=True)
    log_dir = log_dir or artifacts.parent / "runs"
    log_dir.mkdir(parents=True, exist_ok=True)
    n = len(list(log_dir.glob("run-*.json")))
    spec_path, result_path, log = (log_dir / f"run-{n:02d}.json", log_dir / f"result-{n:02d}.json",
                                   log_dir / f"run-{n:02d}.log")
    leftovers = [str(p) for p in temp_leftovers(artifacts)]
    spec = {"config": str(config), "simulate": simulate, "artifacts": str(artifacts), "result": str(result_path),
            "watch": leftovers, "disk_full": disk_full,
            "labelcheck_oracle": labelcheck_oracle and str(labelcheck_oracle), "kill": kill.__dict__ if kill and (kill.on_replace or kill.on_open) else None}
    spec_path.write_text(json.dumps(spec))
    before = {str(p) for p in artifacts.glob(kill.path)} if kill and kill.path else set()

    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(spec_path)],
                            env=child_env(artifacts, api_url), cwd=artifacts.parent, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    killed_by_us, fire_at = False, None
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if now - started > timeout_s:
                _kill_group(proc)
                proc.wait()
                raise TimeoutError(f"round did not finish in {timeout_s:.0f} s ({config}):\n{_tail(log)}")
            if kill and fire_at is None:
                if kill.stage and sum(e["stage"] == kill.stage for e in _executions(artifacts, proc.pid)) >= kill.nth:
                    fire_at = now + kill.delay
                elif kill.path and len({str(p) for p in artifacts.glob(kill.path)} - before) >= kill.nth:
                    fire_at = now + kill.delay
            if fire_at is not None and now >= fire_at:
                _kill_group(proc)
                killed_by_us = True
                proc.wait()
                break
            time.sleep(poll_s)
    finally:
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait()
    wall = time.monotonic() - started
    rc = proc.returncode
    run = RoundRun(rc, killed_by_us or rc == -signal.SIGKILL, wall, log, kill.describe() if kill else None,
                   executed=_executions(artifacts, proc.pid))
    if result_path.is_file():
        res = json.loads(result_path.read_text())
        run.import_s, run.flow_s, run.state, run.temp_reads = res["import_s"], res["flow_s"], res["state"], res["temp_reads"]
        run.rss_mb, run.flow_end, run.cpu_s = res.get("rss_mb"), res.get("flow_end"), res.get("cpu_s")
    elif not run.killed:
        run.error = _tail(log, 80)
    return run


def random_delay(rng: random.Random, hi: float) -> float:
    return round(rng.uniform(0.0, hi), 3)


# ------------------------------------------------------------------------------------------------- child
def _oracle_label_check(ground_truth: str) -> None:
    """In this child only: the label check's out-of-sample probabilities put 0.9 on each sample's true answer. The
    fold adapters are still trained and score their held-out folds (every file of the stage is written, and can be
    killed), but a fold adapter of a few steps is at chance and the check abstains, so without an accurate model
    standing in the relabel queue would never be exported, nor killed mid-export."""
    import dataclasses

    import numpy as np

    import pipeline.labelcheck.check as check

    truth = {r["sample_id"]: r["answer"] for r in map(json.loads, Path(ground_truth).open(encoding="utf-8"))}
    measured = check.out_of_sample_probs

    def oracle(rows: Any, work_dir: Any, spec: Any, **kw: Any) -> Any:
        oos = measured(rows, work_dir, spec, **kw)
        answers = list(spec.answers)
        probs = np.full(oos.probs.shape, 0.1 / (len(answers) - 1), dtype=np.float32)
        probs[np.arange(len(oos.sample_ids)), [answers.index(truth[s]) for s in oos.sample_ids]] = 0.9
        return dataclasses.replace(oos, probs=probs)

    check.out_of_sample_probs = oracle  # check_labels looks it up in its own module


def _child(spec_path: str) -> None:
    import logging

    spec = json.loads(Path(spec_path).read_text())
    artifacts = Path(spec["artifacts"]).resolve()
    watch = tuple(spec["watch"])
    temp_reads: list[str] = []
    kill, disk_full = spec["kill"], spec.get("disk_full")
    seen = {"n": 0}

    def rel(p: Any) -> str | None:
        try:
            return Path(os.fsdecode(p)).resolve().relative_to(artifacts).as_posix()
        except (TypeError, ValueError):
            return None

    def hit(pattern: str, p: Any) -> bool:
        r = rel(p)
        if r is None or not fnmatch.fnmatchcase(r, pattern):
            return False
        seen["n"] += 1
        return seen["n"] >= kill["nth"]

    def audit(event: str, args: tuple) -> None:
        if event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        p = os.fsdecode(args[0])
        mode, flags = args[1] or "", args[2] or 0
        writing = any(c in mode for c in "wax+") or bool(flags & (os.O_WRONLY | os.O_RDWR))
        if disk_full and writing and (r := rel(p)) is not None and fnmatch.fnmatchcase(r, disk_full):
            # Raised from the audit hook, the error aborts the open itself: a full disk as the writer sees it.
            raise OSError(errno.ENOSPC, "No space left on device (simulated)", p)
        # A leftover of a killed write is never to be read again (folders are opened only to be listed or removed).
        if watch and p.startswith(watch) and os.path.isfile(p):
            temp_reads.append(p)
        if kill and kill["on_open"] and hit(kill["on_open"], p):
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(audit)
    if kill and kill["on_replace"]:
        real_replace = os.replace

        def replace(src: Any, dst: Any, **kw: Any) -> None:
            if hit(kill["on_replace"], dst):
                os.kill(os.getpid(), signal.SIGKILL)
            real_replace(src, dst, **kw)

        os.replace = replace  # type: ignore[assignment]

    if spec.get("labelcheck_oracle"):
        _oracle_label_check(spec["labelcheck_oracle"])

    # Prefect's console handler prints them; the resume messages ("resuming training from …") are what we read.
    logging.getLogger("pipeline").setLevel(logging.INFO)

    t0 = time.perf_counter()
    import matplotlib

    matplotlib.use("Agg")
    # What any tamis process imports once; the stages import them lazily, so without this flow_s would count
    # seconds of imports as round work (and a cached re-run pays them as much as a cold round).
    for name in ("flows.round", "datasets", "matplotlib.pyplot", "transformers", "peft", "pipeline.model.loading",
                 "pipeline.scoring", "pipeline.strategies", "pipeline.strategies.outliers", "prefect.results",
                 "prefect.client.orchestration"):
        importlib.import_module(name)
    from flows.round import labeling_round

    t1 = time.perf_counter()
    state = labeling_round(spec["config"], simulate=spec["simulate"])
    t2 = time.perf_counter()
    from benchmarks._results import cpu_seconds, peak_rss_mb
    from pipeline.store import atomic_write_json

    atomic_write_json(spec["result"], {"state": state, "import_s": round(t1 - t0, 3), "flow_s": round(t2 - t1, 3),
                                       "temp_reads": temp_reads,
                                       "rss_mb": peak_rss_mb(), "cpu_s": cpu_seconds(),
                                       "flow_end": time.time()})


if __name__ == "__main__":
    _child(sys.argv[1])


def build_prepared_pool(out_dir: Path, n: int, *, seed: int = 0,
                        question: str = "Which digit is shown in the image?") -> dict[str, str]:
    """A real prepared pool of n generated images of varied sizes (preprocess_dataset at 32 px), as the select tests
    and benchmarks/dask_cluster.py score it; returns its reference ({dir, digest})."""
    import io

    import datasets
    import numpy as np
    from PIL import Image, ImageDraw

    from pipeline.config import PreprocessConfig
    from pipeline.preprocess import preprocess_dataset
    from pipeline.schema import sample_id_for

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        w, h = int(rng.integers(20, 60)), int(rng.integers(20, 60))
        im = Image.new("RGB", (w, h), tuple(int(c) for c in rng.integers(0, 256, 3)))
        ImageDraw.Draw(im).text((w // 3, h // 4), str(i % 10), fill=(255, 255, 255))
        buf = io.BytesIO()
        im.save(buf, "PNG")
        data = buf.getvalue()
        rows.append({"sample_id": sample_id_for(data, question), "image": data, "image_path": f"/pool/{i}.png",
                     "question": question, "answer": None, "split": "pool", "source": f"gen:{i}",
                     "sources": [f"gen:{i}"], "width": w, "height": h, "mode": "RGB"})
    m = preprocess_dataset(datasets.Dataset.from_list(rows), PreprocessConfig(size=32), out_dir, size=32,
                           max_pixels=1_000_000)
    return {"dir": str(out_dir), "digest": m.key}


CLI = "import sys; from flows.cli import run; sys.argv = ['tamis', *sys.argv[1:]]; run()"


def round_with_code(code: Path, config: Path, api_url: str | None, *args: str, artifacts: Path | None = None,
                    env: dict[str, str] | None = None, timeout: float = 900) -> None:
    """`tamis round --config config [args]` run by the library and flows in `code` (another revision's checkout, or
    an edited copy) instead of this checkout's; checks first that `code` is what the child imports."""
    full = {**child_env(artifacts or config.parent / "artifacts", api_url), "PYTHONPATH": str(code), **(env or {})}
    where = subprocess.run([sys.executable, "-c", "import pipeline, flows; print(pipeline.__file__, flows.__file__)"],
                           cwd=config.parent, env=full, capture_output=True, text=True, check=True).stdout.split()
    if not all(Path(w).is_relative_to(code) for w in where):
        raise AssertionError(f"the code in {code} is not what runs: {where}")
    done = subprocess.run([sys.executable, "-c", CLI, "round", "--config", str(config), *args], cwd=config.parent,
                          env=full, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"tamis round with the code in {code} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
