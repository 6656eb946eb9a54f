"""Data-parallel training: one process per device, started from inside the library or by `accelerate launch`.

`launch` spawns `num_processes` fresh interpreters (spawn, not fork: a forked CUDA context or a Prefect thread pool
does not survive fork) with the torch.distributed environment set, so a round flow trains on several devices without
the user typing `accelerate launch`. A process that a launcher already started (`accelerate launch`, torchrun: the
WORLD_SIZE / RANK variables) is picked up by `launched_rank` and joins as that rank instead.

Every rank joins the process group through accelerate's PartialState (gloo on CPUs, NCCL on GPUs). The training loop
then needs only the few collectives of `Comm`: the gradients of an optimizer step are summed across ranks once, after
all micro-batches, in one flat buffer. For LoRA that buffer is a few MB; doing it once per step instead of through
DDP's per-backward hooks keeps gradient accumulation, an OOM retry on one rank and non-reentrant activation
checkpointing free of DDP's no_sync / find_unused_parameters / static-graph caveats, and makes the arithmetic the
one-process loop's: each rank weighs its micro-batch losses by the step's global answer-token count.

Pool scoring on Dask lives below the training part: the local cluster `select.runner: dask` starts (one pinned worker
per GPU, or CPU workers), and `process_cluster`, a scheduler and workers as separate `dask` processes on 127.0.0.1,
which is how the tests and benchmarks stand in for a real cluster.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.config import SelectConfig
from pipeline.errors import ModelError, TamisError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rank:
    rank: int
    world: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_rank() -> Rank | None:
    """This process's rank when a launcher started it as one of several (WORLD_SIZE > 1), else None."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return None
    rank = int(os.environ.get("RANK", "0"))
    return Rank(rank, world, int(os.environ.get("LOCAL_RANK", str(rank))))


def shard(indices: Sequence[int], rank: int, world: int) -> list[int]:
    """Rank `rank`'s contiguous share of one optimizer step's samples (len(indices) is a multiple of world).

    Rank r takes the r-th slice of the step's sample list, so the ranks together see exactly the samples one process
    would, and with a micro-batch that divides the share, in the same micro-batches."""
    if len(indices) % world:
        raise ValueError(f"{len(indices)} samples per step do not split evenly over {world} processes")
    per = len(indices) // world
    return list(indices[rank * per: (rank + 1) * per])


class Comm:
    """The collectives one data-parallel optimizer step needs, on an initialised process group."""

    def __init__(self, rank: Rank, device: torch.device):
        self.rank, self.device = rank, device

    @property
    def world(self) -> int:
        return self.rank.world

    def _dist(self) -> Any:
        import torch.distributed as dist

        return dist

    def sum(self, values: Sequence[float]) -> list[float]:
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        self._dist().all_reduce(t)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=self.device)
        self._dist().all_reduce(t, op=self._dist().ReduceOp.MAX)
        return bool(t.item())

    def sum_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient across ranks, in place; a gradient no rank produced stays None."""
        dist = self._dist()
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int64, device=self.device)
        dist.all_reduce(has)
        live = [p for p, h in zip(params, has.tolist(), strict=True) if h]
        if not live:
            return
        dtype = next((p.grad.dtype for p in live if p.grad is not None), torch.float32)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(self.device, dtype)
                          for p in live])
        dist.all_reduce(flat)
        offset = 0
        for p in live:
            n = p.numel()
            # A view into the summed buffer (no second copy) where dtype and device already match.
            p.grad = flat[offset: offset + n].view_as(p).to(p.device, p.dtype)
            offset += n

    def broadcast_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy rank 0's values into every rank's tensors (the same start, whatever each rank's RNG did)."""
        dist = self._dist()
        with torch.no_grad():
            for t in tensors:
                buf = t.detach().to(self.device).clone()
                dist.broadcast(buf, src=0)
                t.copy_(buf.to(t.device, t.dtype))

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (same shape and dtype on all ranks), in rank order, on the CPU."""
        t = t.to(self.device)
        out = [torch.empty_like(t) for _ in range(self.world)]
        self._dist().all_gather(out, t)
        return [o.cpu() for o in out]

    def barrier(self) -> None:
        self._dist().barrier()


def init_rank(rank: Rank, device_type: str) -> tuple[Comm, torch.device]:
    """Join the process group (through accelerate's PartialState) and pin this rank to its device."""
    from accelerate import PartialState

    if device_type == "cuda":
        torch.cuda.set_device(rank.local_rank)
        state = PartialState()
        device = torch.device("cuda", rank.local_rank)
    else:
        state = PartialState(cpu=True, backend="gloo")
        device = torch.device("cpu")
    if state.num_processes != rank.world or state.process_index != rank.rank:
        raise ModelError(f"process group mismatch: accelerate sees rank {state.process_index} of "
                         f"{state.num_processes}, the environment says {rank.rank} of {rank.world}")
    return Comm(rank, device), device


def close_rank(*, synchronize: bool = True) -> None:
    """Leave the process group; all ranks first meet at a barrier, as one tearing gloo down while another is still
    inside it can abort the other."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if synchronize:
            dist.barrier()
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(index: int, fn: Callable[..., Any], args: tuple, env: dict[str, str], threads: int, log_level: int,
           queue: Any) -> None:
    """What each spawned process runs: the rank's environment and logging, then fn(*args, queue)."""
    # torch's spawn wrapper asks Linux to send this rank SIGINT when its parent dies (PR_SET_PDEATHSIG). A process
    # started in the background (`nohup tamis run &`, a script's `&`) inherits SIGINT ignored, and an ignored death
    # signal does nothing: the ranks of a killed round trained on, writing into the folder its re-run resumes from.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.update({**env, "RANK": str(index), "LOCAL_RANK": str(index)})
    torch.set_num_threads(threads)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank {index}] %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    # Rank 0 speaks for the run; the others only warn.
    root.setLevel(log_level if index == 0 else max(log_level, logging.WARNING))
    try:
        fn(*args, queue)
    except TamisError as exc:
        # A clear error the parent re-raises as it is (the traceback of a spawned process says less).
        queue.put({"rank": index, "error": type(exc).__name__, "message": str(exc)})
        raise
    close_rank()


def launch(fn: Callable[..., Any], args: tuple, num_processes: int, *, what: str = "training") -> list[Any]:
    """Run fn(*args, queue) in `num_processes` spawned ranks and wait; returns what the ranks put on the queue.

    torch's spawn wrapper asks Linux to interrupt each rank when this process dies (PR_SET_PDEATHSIG), so a killed
    round flow leaves no rank behind to write into the folder its re-run resumes from.

    A rank that raised a tamis error is re-raised as that error; one that died (killed, out of host memory) or
    raised anything else ends the others and raises ModelError naming the rank."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

    import pipeline.errors as errors

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(num_processes),
           "LOCAL_WORLD_SIZE": str(num_processes)}
    threads = max(1, torch.get_num_threads() // num_processes)
    level = logging.getLogger().getEffectiveLevel()
    log.info("starting %d %s processes (spawn, %d torch thread(s) each)", num_processes, what, threads)
    failure: Exception | None = None
    messages: list[Any] = []

    def drain() -> None:
        # Read while the ranks run: a message larger than the pipe's buffer would otherwise block its sender forever.
        while not queue.empty():
            messages.append(queue.get())

    try:
        procs = mp.start_processes(_entry, args=(fn, args, env, threads, level, queue), nprocs=num_processes,
                                   start_method="spawn", join=False)
        while not procs.join(timeout=0.2):
            drain()
    except (ProcessExitedException, ProcessRaisedException) as exc:
        failure = exc
    drain()
    if failure is not None:
        raised = next((m for m in messages if "error" in m), None)
        if raised is not None:
            cls = getattr(errors, raised["error"], ModelError)
            raise cls(raised["message"]) from None
        raise ModelError(f"{what} process {failure.error_index} of {num_processes} failed "
                         f"({_describe(failure)}); re-running resumes from the last checkpoint") from failure
    return messages


def _describe(exc: Exception) -> str:
    sig = getattr(exc, "signal_name", None) or (
        signal.Signals(-exc.exit_code).name if getattr(exc, "exit_code", 0) and exc.exit_code < 0 else None)
    if sig:
        return f"killed by {sig}"
    code = getattr(exc, "exit_code", None)
    if code is not None:
        return f"exit code {code}"
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else exc.__class__.__name__


# ------------------------------------------------------------------------------------------ pool scoring
def scoring_devices(workers: int | str, hw: Any) -> list[str] | None:
    """The CUDA device each local scoring worker is pinned to (one worker per entry), or None for CPU workers.

    auto: one worker per visible GPU; an integer N: N workers over the visible GPUs in turn (more than one per GPU
    only when asked). Device ids are those CUDA_VISIBLE_DEVICES names, so a restricted parent stays restricted."""
    if hw.device != "cuda" or not hw.gpus:
        return None
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    ids = visible[: len(hw.gpus)] if visible else [str(i) for i in range(len(hw.gpus))]
    n = len(ids) if workers == "auto" else int(workers)
    return [ids[i % len(ids)] for i in range(n)]


def device_cluster(devices: Sequence[str], *, host: str = "127.0.0.1", dashboard_address: str = "127.0.0.1:8787",
                   asynchronous: bool = False, **kwargs: Any) -> Any:
    """A local Dask cluster of one single-threaded worker process per entry of `devices`, each seeing only that GPU.

    A worker runs one shard at a time, so the scheduler hands the next shard to whichever device is free. The
    worker's CUDA_VISIBLE_DEVICES is set by its nanny before the process starts, so torch inside sees one GPU,
    cuda:0, and `load_model` puts the model there."""
    from distributed import Nanny, Scheduler, SpecCluster

    scheduler = {"cls": Scheduler, "options": {"host": host, "dashboard_address": dashboard_address}}
    workers = {
        f"device-{i}-gpu{d}": {"cls": Nanny, "options": {"nthreads": 1, "host": host,
                                                          "env": {"CUDA_VISIBLE_DEVICES": d, "OMP_NUM_THREADS": "1"},
                                                          "resources": {"GPU": 1}}}
        for i, d in enumerate(devices)
    }
    return SpecCluster(workers=workers, scheduler=scheduler, asynchronous=asynchronous, name="tamis-devices",
                       **kwargs)


def dask_runner_options(select: SelectConfig, hw: Any) -> dict[str, Any]:
    """How `select.runner: dask` scores: {"address"} of an existing cluster, or the local cluster to start
    ({"cluster_class"?, "cluster_kwargs"}): one pinned worker process per GPU, else N single-threaded CPU workers."""
    if select.dask_address:
        return {"address": select.dask_address}
    # Dask binds the dashboard of ":8787" to every interface; keep the whole local cluster on loopback.
    local = {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:8787"}
    devices = scoring_devices(select.dask_workers, hw)
    if devices is not None:
        return {"cluster_class": device_cluster, "cluster_kwargs": {"devices": devices, **local}}
    workers = 2 if select.dask_workers == "auto" else select.dask_workers
    return {"cluster_kwargs": {"n_workers": workers, "threads_per_worker": 1, "processes": True, **local}}


# ------------------------------------------------------------------------------ a cluster of separate processes
@dataclass
class ProcessCluster:
    """A Dask scheduler and its workers running as separate `dask` CLI processes on this machine (what a real
    cluster is, minus the network): `address` for `select.dask_address`, the processes to watch or kill."""

    address: str
    scheduler: Any  # subprocess.Popen of `dask scheduler`
    workers: list[Any]  # subprocess.Popen of each `dask worker` (its nanny; the worker process is a child)
    folder: str

    def client(self, **kwargs: Any) -> Any:
        from distributed import Client

        return Client(self.address, **kwargs)

    def listening(self) -> dict[str, list[tuple[str, int]]]:
        """Every (ip, port) each process of the cluster listens on (scheduler, nannies, workers): where it can be
        reached from."""
        import psutil

        out = {}
        for name, p in [("scheduler", self.scheduler), *((f"worker-{i}", w) for i, w in enumerate(self.workers))]:
            for proc in [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]:
                out[f"{name}:{proc.pid}"] = sorted((c.laddr.ip, c.laddr.port) for c in proc.net_connections("inet")
                                                   if c.status == psutil.CONN_LISTEN)
        return out


def _stop_group(proc: Any, grace_s: float) -> None:
    """End a process started in its own session and everything it spawned (a nanny's worker, its spawned helpers)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue
    # The group leader is gone; a child it left behind in the group still gets the signal.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _scheduler_address(path: Path) -> str | None:
    """The address in a scheduler file, or None while it is missing or half-written (Dask writes it in place)."""
    try:
        return json.loads(path.read_text())["address"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _dask_command() -> list[str]:
    """The `dask` command of this interpreter's environment, so workers run the same packages as the flow."""
    beside = Path(sys.executable).with_name("dask")
    found = str(beside) if beside.is_file() else shutil.which("dask")
    if found is None:
        raise ModelError(f"no `dask` command beside {sys.executable} or on PATH; install distributed")
    return [found]


@contextlib.contextmanager
def process_cluster(folder: str | os.PathLike[str], *, n_workers: int = 2, env: dict[str, str] | None = None,
                    cwd: str | os.PathLike[str] | None = None, timeout_s: float = 180.0) -> Iterator[ProcessCluster]:
    """Start `dask scheduler` and `n_workers` `dask worker --nthreads 1` processes, all on 127.0.0.1 with no
    dashboard, and yield a ProcessCluster once every worker has joined; every process group is ended on exit.

    Each process runs in its own session, so ending its group also ends the worker process its nanny spawned;
    nothing is left behind, also when the body raises. Processes get `env` on top of this one's environment
    (PYTHONPATH: where `pipeline` and `flows` import from); logs go to `folder`."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    sched_file = root / "scheduler.json"
    sched_file.unlink(missing_ok=True)
    base_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    procs: list[subprocess.Popen] = []

    def start(args: list[str], log_name: str) -> subprocess.Popen:
        with open(root / log_name, "ab") as out:
            p = subprocess.Popen([*_dask_command(), *args], cwd=cwd, env=base_env, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        return p

    try:
        # --no-dashboard still serves Dask's HTTP routes (health, metrics) on the dashboard address, which is every
        # interface by default: pin it to loopback too.
        loopback = ["--host", "127.0.0.1", "--no-dashboard", "--dashboard-address", "127.0.0.1:0"]
        scheduler = start(["scheduler", *loopback, "--port", "0", "--scheduler-file", str(sched_file)],
                          "scheduler.log")
        deadline = time.monotonic() + timeout_s
        while (address := _scheduler_address(sched_file)) is None:
            if scheduler.poll() is not None or time.monotonic() > deadline:
                raise ModelError(f"dask scheduler did not start within {timeout_s:.0f} s (exit code "
                                 f"{scheduler.poll()}); see {root / 'scheduler.log'}")
            time.sleep(0.1)
        workers = [start(["worker", address, *loopback, "--nthreads", "1", "--nworkers", "1",
                          "--name", f"w{i}", "--local-directory", str(root / f"w{i}")],
                         f"worker-{i}.log") for i in range(n_workers)]
        cluster = ProcessCluster(address, scheduler, workers, str(root))
        with cluster.client(timeout=f"{int(timeout_s)}s") as client:
            client.wait_for_workers(n_workers, timeout=max(1.0, deadline - time.monotonic()))
        yield cluster
    finally:
        for p in reversed(procs):
            _stop_group(p, grace_s=10.0)
