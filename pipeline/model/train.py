"""Supervised fine-tuning of a LoRA adapter (or the full model) on (image, question, answer) rows.

A plain torch loop rather than HF Trainer, to own resume and out-of-memory recovery:
- The data order is a function of the optimizer step alone (seeded epoch permutations cut into effective batches),
  so a resumed run, or one whose micro-batch was halved after an OOM, sees exactly the same samples per step.
- The loss is the mean over the answer tokens of the whole optimizer step, whatever the micro-batch split.
- Checkpoints (trainable weights, optimizer, scheduler, scaler and RNG states; safetensors + JSON) are written every
  `train.checkpoint_every` steps with atomic_dir; re-running with the same out_dir continues from the last one.
- With `train.num_processes` > 1 (pipeline.model.distributed) each rank trains on its contiguous share of every
  step's samples, with the step's global token count and its gradients summed across ranks: the same arithmetic as
  one process. Only rank 0 writes checkpoints (with every rank's RNG state), the adapter and the manifest.
"""

from __future__ import annotations

import io
import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from PIL import Image

from pipeline.codeversion import stage_version
from pipeline.config import ModelConfig, TrainConfig
from pipeline.errors import DataError, ModelError
from pipeline.model.distributed import Comm, Rank, init_rank, launch, launched_rank, shard
from pipeline.model.hardware import TrainSettings
from pipeline.model.loading import Loaded, load_model
from pipeline.model.optim import build_optimizer, optimizer_state, optimizer_state_bytes, optimizer_tensors
from pipeline.model.utilisation import UtilisationWatch
from pipeline.schema import sample_chat
from pipeline.store import (
    Manifest,
    atomic_dir,
    atomic_write_json,
    digest_bytes,
    digest_json,
    digest_path,
    find_valid_manifest,
    stage_key,
    write_manifest,
)

log = logging.getLogger(__name__)
TRAIN_VERSION = stage_version("1", "pipeline.model.train_stage")
KEEP_CHECKPOINTS = 2

OomHook = Callable[[int, int], None]  # (optimizer step, micro-batch size) → may raise torch.cuda.OutOfMemoryError
StepHook = Callable[[int, int, float], None]  # (optimizer steps done, the run's total steps, loss) after each step


@dataclass
class TrainResult:
    out_dir: Path
    adapter_dir: Path | None  # None when stopped early (stop_after_steps)
    steps: int
    total_steps: int
    losses: list[float]
    settings: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)
    manifest: Manifest | None = None

    @property
    def finished(self) -> bool:
        return self.adapter_dir is not None


# ------------------------------------------------------------------------------------------------------ data
def _row_image(row: dict[str, Any]) -> bytes:
    data = row.get("prepared") or row.get("image")
    if isinstance(data, dict):  # an HF `Image` feature: {"bytes": ..., "path": ...}
        data = data.get("bytes")
    return data


def check_rows(rows: Sequence[dict[str, Any]]) -> str:
    """Validate every training row up front and return a digest of their content (image, question, answer)."""
    if len(rows) == 0:
        raise DataError("no labeled rows to train on: label some samples (tamis import-labels) or add a train split")
    parts = []
    for i in range(len(rows)):
        row = rows[i]
        rid = row.get("sample_id", f"#{i}")
        image = _row_image(row)
        if not isinstance(image, (bytes, bytearray)) or not image:
            raise DataError(f"training row {i} (sample {rid}): no image bytes in 'prepared' or 'image'; "
                            "run the prepare stage first")
        for key in ("question", "answer"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise DataError(f"training row {i} (sample {rid}): field {key!r} is {row.get(key)!r}; "
                                f"a non-empty string is needed (only labeled rows can be trained on)")
        # A sample's later pictures and turns join its part only when it has them: one-image rows digest as before.
        more = [[digest_bytes(bytes(m)) for m in row.get("more_prepared") or []], row.get("context") or []]
        parts.append((digest_bytes(bytes(image)), row["question"], row["answer"], *(more if any(more) else ())))
    return digest_json(parts)


def step_indices(step: int, n_rows: int, effective: int, seed: int) -> list[int]:
    """Row indices of optimizer step `step`: consecutive slices of a stream of seeded epoch permutations."""
    out: list[int] = []
    pos = step * effective
    while len(out) < effective:
        epoch, offset = divmod(pos, n_rows)
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        perm = torch.randperm(n_rows, generator=g).tolist()
        take = perm[offset: offset + effective - len(out)]
        out += take
        pos += len(take)
    return out


def _decode(data: bytes, where: str) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data)).convert("RGB")
    except Exception as exc:  # noqa: BLE001 - any decode failure is the same user-facing fault
        raise DataError(f"{where}: image bytes do not decode ({exc.__class__.__name__}: {exc}); "
                        "re-run the prepare stage") from None


def _row_inputs(chunk: Sequence[dict[str, Any]], at: Sequence[int]) -> tuple[list[Any], list[Any]]:
    """Each training row's pictures (one image, or the list of a sample of several) and what it asks (its question,
    or a Question with its earlier turns: pipeline.schema.sample_chat), as the family's encode takes them."""
    chats = [sample_chat({**r, "prepared": _row_image(r)}) for r in chunk]
    pics = [[_decode(p, f"training row {j} (sample {r.get('sample_id', j)})") for p in pngs]
            for j, r, (pngs, _) in zip(at, chunk, chats, strict=True)]
    return [p[0] if len(p) == 1 else p for p in pics], [q for _, q in chats]


# -------------------------------------------------------------------------------------------------- schedule
def lr_lambda(kind: str, warmup: int, total: int) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if kind == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 1.0 - progress) if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


# ------------------------------------------------------------------------------------------------ checkpoints
def _trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    root = out_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        # atomic_dir only renames a folder into place once it is complete, so a visible step-N is whole.
        if p.name.startswith("step-") and p.name[5:].isdigit() and (p / "state.json").is_file():
            found.append((int(p.name[5:]), p))
    return sorted(found)


def _rng_states(comm: Comm | None) -> dict[str, torch.Tensor]:
    """This process's RNG states; with several ranks every rank's, gathered (a collective: all ranks call it)."""
    if comm is None:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
        return rng
    rng = {f"cpu.rank{r}": t for r, t in enumerate(comm.gather(torch.get_rng_state()))}
    if comm.device.type == "cuda":
        rng.update({f"cuda.rank{r}": t for r, t in enumerate(comm.gather(torch.cuda.get_rng_state()))})
    return rng


def _save_checkpoint(out_dir: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
                     scaler: Any, state: dict[str, Any], comm: Comm | None = None) -> Path | None:
    """Write checkpoint step-N (rank 0 only; every rank must call it, for the RNG states)."""
    from safetensors.torch import save_file

    rng = _rng_states(comm)
    if comm is not None and not comm.rank.is_main:
        comm.barrier()  # continue once rank 0's checkpoint is in place: a rank killed later cannot cut it short
        return None
    path = out_dir / "checkpoints" / f"step-{step}"
    with atomic_dir(path) as tmp:
        save_file({n: p.detach().cpu().contiguous() for n, p in _trainable(model).items()}, tmp / "trainable.safetensors")
        tensors, meta = optimizer_tensors(opt)
        save_file(tensors, tmp / "optimizer.safetensors")
        save_file(rng, tmp / "rng.safetensors")
        atomic_write_json(tmp / "optimizer.json", meta)
        atomic_write_json(tmp / "state.json", {**state, "step": step, "scheduler": sched.state_dict(),
                                               "scaler": scaler.state_dict() if scaler is not None else None})
    for old_step, old in _checkpoints(out_dir)[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old, ignore_errors=True)
        log.debug("removed old checkpoint %s (step %d)", old, old_step)
    if comm is not None:
        comm.barrier()
    return path


def _load_checkpoint(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
                     scaler: Any, rank: Rank | None = None) -> dict[str, Any]:
    from safetensors.torch import load_file

    state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    params = _trainable(model)
    saved = load_file(path / "trainable.safetensors")
    if set(saved) != set(params):
        raise ModelError(f"{path}: checkpoint holds {len(saved)} trainable tensors but the model has {len(params)}; "
                         f"delete {path.parent} to start training over")
    with torch.no_grad():
        for name, tensor in saved.items():
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))
    meta = json.loads((path / "optimizer.json").read_text(encoding="utf-8"))
    devices = [p.device for g in opt.param_groups for p in g["params"]]
    opt.load_state_dict(optimizer_state(load_file(path / "optimizer.safetensors"), meta, devices))
    sched.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    rng = load_file(path / "rng.safetensors")
    if rank is not None:
        # Each rank continues its own random stream; a checkpoint from another process count has none for it.
        if f"cpu.rank{rank.rank}" in rng:
            torch.set_rng_state(rng[f"cpu.rank{rank.rank}"])
            if f"cuda.rank{rank.rank}" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng[f"cuda.rank{rank.rank}"])
        else:
            log.info("%s holds no RNG state for rank %d of %d: continuing with a fresh stream", path, rank.rank,
                     rank.world)
        return state
    if "cpu" not in rng:
        log.info("%s was written by several processes: continuing with a fresh random stream", path)
        return state
    torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available():
        cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda."))]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    return state


# ---------------------------------------------------------------------------------------------------- training
def _autocast(device: str, precision: str) -> Any:
    if precision == "fp32":
        return torch.autocast(device_type=device, enabled=False)
    return torch.autocast(device_type=device, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def _offload(on: bool) -> Any:
    """Activation offload: every tensor autograd saves in the forward (outside checkpointed layers, whose own hooks
    win) goes to pinned host memory and comes back for backward. Only the forward is wrapped: the recomputation
    of checkpointed layers in backward stays on the GPU. The caller passes False on the CPU (nothing to move)."""
    import contextlib

    return torch.autograd.graph.save_on_cpu(pin_memory=True) if on else contextlib.nullcontext()


def _to(enc: Any, device: torch.device) -> dict[str, Any]:
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in enc.items()}


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(p for p in model.parameters()).device


def _enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute activations in the backward pass instead of keeping them (non-reentrant checkpoints)."""
    kwargs = {"use_reentrant": False}
    # transformers 5 renamed gradient_checkpointing_enable to activation_checkpointing_enable; the old name is now an
    # alias that warns on every call. Older releases (down to the 4.57 we support) only have the old name.
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]


class _TrainSections(Protocol):
    """Anything holding the sections training reads: a ProjectConfig, a CheckSpec of the label check."""

    model: ModelConfig
    train: TrainConfig
    seed: int


@dataclass(frozen=True)
class TrainSpec:
    """What training reads of a project, and nothing else: the model and train sections and the seed. The train
    stage's manifest is keyed on `sections()`."""

    model: ModelConfig
    train: TrainConfig
    seed: int

    @classmethod
    def of(cls, project: _TrainSections) -> TrainSpec:
        return cls(project.model, project.train, project.seed)

    def sections(self) -> dict[str, Any]:
        return {"model": self.model.model_dump(mode="json"), "train": self.train.model_dump(mode="json"),
                "seed": self.seed}


def _fingerprint(spec: TrainSpec, rows_digest: str, init_digest: str) -> str:
    """What a checkpoint must match to be resumed: same rows, same model/train config, seed and initial adapter."""
    sections = spec.sections()
    # The micro-batch may be lowered after an OOM, and checkpointing changes nothing numerically; nor does the number
    # of processes the same effective batch is spread over (a run killed on 2 GPUs may resume on 1).
    for k in ("checkpoint_every", "batch_size", "gradient_checkpointing", "num_processes"):
        sections["train"].pop(k, None)
    return digest_json({"rows": rows_digest, **sections, "init": init_digest,
                        "version": TRAIN_VERSION})  # another code's checkpoints: start over


def train_adapter(
    spec: TrainSpec,
    rows: Sequence[dict[str, Any]],
    out_dir: str | Path,
    *,
    init_adapter: str | Path | None = None,
    hw: Any = None,
    progress: bool = True,
    stop_after_steps: int | None = None,
    oom_hook: OomHook | None = None,
    on_step: StepHook | None = None,
) -> TrainResult:
    """Train an adapter on `rows` (dicts with `prepared` or `image` bytes, `question`, `answer`) into out_dir.

    Writes out_dir/adapter (PEFT `save_pretrained`; the whole model in full mode) and out_dir/manifest.json (stage
    "train"). Re-running with the same out_dir resumes from out_dir/checkpoints, or returns at once when the
    manifest already matches. `stop_after_steps` stops after that many optimizer steps without saving the adapter
    (tests of resume); `oom_hook` is called before each micro-batch and may raise an OOM error (tests of recovery).

    `train.num_processes` > 1 (or auto on a machine with several GPUs) trains data-parallel: this call spawns one
    process per device and waits for them. In a process that `accelerate launch` / torchrun started, every rank calls
    this function and joins as its rank. With several processes, `oom_hook` runs on every rank and `on_step` on
    rank 0, so both must be picklable when this call spawns them.
    """
    from pipeline.model.hardware import detect_hardware, resolve_num_processes

    out_dir, train = Path(out_dir), spec.train
    hw = hw if hw is not None else detect_hardware()
    rows_digest = check_rows(rows)
    if train.init == "warm" and init_adapter is None:
        log.info("train.init is warm but there is no previous adapter (first round): starting a fresh one")
    init = Path(init_adapter) if train.init == "warm" and init_adapter is not None else None
    init_digest = digest_path(init) if init is not None else ""
    config = spec.sections()
    inputs = {"rows": rows_digest, "init_adapter": init_digest}
    key = stage_key("train", TRAIN_VERSION, inputs, config)
    done = find_valid_manifest(out_dir, key)
    if done is not None:
        log.info("training in %s is already complete (manifest matches); reusing it", out_dir)
        return _result_from_manifest(out_dir, done)

    job = _Job(spec, rows, out_dir, init, init_digest, rows_digest, inputs, config, hw, progress, stop_after_steps,
               oom_hook, on_step)
    rank = launched_rank()
    if rank is not None:
        if train.num_processes not in ("auto", rank.world):
            log.warning("train.num_processes is %s but the launcher started %d processes: using %d",
                        train.num_processes, rank.world, rank.world)
        return _train(job, rank)
    nproc = resolve_num_processes(train.num_processes, hw)
    if nproc == 1:
        return _train(job, None)
    _check_picklable(oom_hook=oom_hook, on_step=on_step)
    messages = launch(_spawned_rank, (job,), nproc)
    done = find_valid_manifest(out_dir, key)
    if done is not None:
        return _result_from_manifest(out_dir, done)
    stopped = next((m for m in messages if m.get("stopped")), None)
    if stopped is None:
        raise ModelError(f"training in {out_dir} ended without an adapter or a stop report; re-run to resume")
    return TrainResult(out_dir, None, stopped["steps"], stopped["total_steps"], stopped["losses"],
                       stopped["settings"], stopped["info"])


@dataclass
class _Job:
    """Everything a training rank needs (picklable: spawned ranks receive it)."""

    spec: TrainSpec
    rows: Sequence[dict[str, Any]]
    out_dir: Path
    init: Path | None
    init_digest: str
    rows_digest: str
    inputs: dict[str, Any]
    config: dict[str, Any]
    hw: Any
    progress: bool
    stop_after_steps: int | None
    oom_hook: OomHook | None
    on_step: StepHook | None


def _check_picklable(**hooks: Any) -> None:
    import pickle

    for name, hook in hooks.items():
        if hook is None:
            continue
        try:
            pickle.dumps(hook)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise ModelError(f"{name} must be picklable (a module-level function or object) to reach the spawned "
                             f"training processes of train.num_processes > 1; {hook!r} is not ({exc})") from None


def _result_from_manifest(out_dir: Path, m: Manifest) -> TrainResult:
    return TrainResult(out_dir, out_dir / m.outputs["adapter"].path, m.info["steps"], m.info["total_steps"],
                       m.info["losses"], m.info["settings"], m.info, m)


def _spawned_rank(job: _Job, queue: Any) -> None:
    rank = launched_rank()
    assert rank is not None, "launch sets WORLD_SIZE > 1"
    result = _train(job, rank)
    if rank.is_main and not result.finished:
        queue.put({"stopped": True, "steps": result.steps, "total_steps": result.total_steps,
                   "losses": result.losses, "settings": result.settings, "info": result.info})


@dataclass
class _Run:
    """One process's training run: what the loop steps, and what each checkpoint saves to resume it."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    scaler: Any  # a GradScaler for fp16 on CUDA, else None
    rank: Rank | None
    comm: Comm | None
    fingerprint: str
    total_steps: int
    effective: int  # samples per optimizer step, all processes together
    micro: int  # micro-batch × accumulation: halved / doubled after an OOM, restored on resume
    accum: int
    step: int = 0
    losses: list[float] = field(default_factory=list)
    ooms: list[dict[str, int]] = field(default_factory=list)
    resumed_from: int | None = None

    @property
    def world(self) -> int:
        return self.rank.world if self.rank is not None else 1

    @property
    def main(self) -> bool:
        return self.rank is None or self.rank.is_main


def planned_train_steps(max_steps: int | None, epochs: float, n_rows: int, effective_batch: int) -> int:
    """The number of optimizer steps train_adapter runs (train.max_steps, else epochs over the rows at the effective
    batch): the loop's total, and the train stage's progress total before it starts."""
    return max_steps or max(1, math.ceil(epochs * n_rows / max(1, effective_batch)))


def _train(job: _Job, rank: Rank | None) -> TrainResult:
    """The training loop of one process: the only one, or rank `rank` of several."""
    from pipeline.model.hardware import choose_train_settings

    spec, hw = job.spec, job.hw
    comm = init_rank(rank, hw.device)[0] if rank is not None else None
    world = rank.world if rank is not None else 1
    settings = choose_train_settings(spec.train, spec.model, hw, num_processes=world)
    effective = settings.micro_batch * settings.grad_accum * world
    total_steps = planned_train_steps(spec.train.max_steps, spec.train.epochs, len(job.rows), effective)
    warmup = math.ceil(spec.train.warmup_ratio * total_steps)
    fingerprint = _fingerprint(spec, job.rows_digest, job.init_digest)

    loaded = _load_for_training(job, settings.gradient_checkpointing)
    opt, sched, scaler = _optimizer(loaded.model, job, settings, comm, total_steps, warmup)
    run = _Run(loaded.model, opt, sched, scaler, rank, comm, fingerprint, total_steps, effective,
               settings.micro_batch, settings.grad_accum)
    _resume(run, job.out_dir, settings.optimizer)
    log.info("training %s (%s) on %d rows: %d steps × %d samples (micro-batch %d × accumulation %d%s), %s, "
             "gradient checkpointing %s, optimizer %s, activation offload %s", loaded.family.name, spec.model.mode,
             len(job.rows), total_steps, effective, run.micro, run.accum, f" × {world} processes" if world > 1 else "",
             settings.precision, "on" if settings.gradient_checkpointing else "off", settings.optimizer,
             "on" if settings.activation_offload else "off")
    started = time.monotonic()
    util = _loop(run, job, loaded, settings)
    if comm is not None:
        util = _per_process(util, comm)
    settings_info = {**asdict(settings), "micro_batch": run.micro, "grad_accum": run.accum}
    info = {
        "steps": run.step, "total_steps": total_steps, "losses": run.losses, "settings": settings_info,
        "ooms": run.ooms, "utilisation": util, "rows": len(job.rows), "effective_batch": effective,
        "warmup_steps": warmup, "seconds": round(time.monotonic() - started, 2), "model": loaded.info,
        "num_processes": world, "resumed_from_step": run.resumed_from,
        "optimizer_state_mb": round(optimizer_state_bytes(opt) / 2**20, 2),
    }
    if run.step < total_steps:
        log.info("stopped after %d of %d steps (stop_after_steps); the last checkpoint can be resumed", run.step,
                 total_steps)
        return TrainResult(job.out_dir, None, run.step, total_steps, run.losses, settings_info, info)
    return _save_adapter(run, job, loaded, settings_info, info)


def _load_for_training(job: _Job, checkpointing: bool) -> Loaded:
    """The model with its adapter (fresh, seeded, or the warm start's), ready for backward."""
    if job.hw.device == "cpu":
        from pipeline.model.hardware import bound_cpu_allocator

        bound_cpu_allocator()  # resident memory = live tensors, as planned (see its docstring)
    torch.manual_seed(job.spec.seed)  # the LoRA initialisation
    loaded: Loaded = load_model(job.spec.model, adapter=job.init, trainable=True, hw=job.hw)
    model = loaded.model
    if checkpointing:
        _enable_activation_checkpointing(model)
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    if hasattr(model, "config"):
        model.config.use_cache = False
    return loaded


def _optimizer(model: torch.nn.Module, job: _Job, settings: TrainSettings, comm: Comm | None, total_steps: int,
               warmup: int) -> tuple[torch.optim.Optimizer, Any, Any]:
    """(optimizer, LR schedule, grad scaler or None) over the trainable parameters, the same on every rank."""
    train, device_type = job.spec.train, job.hw.device
    params = list(_trainable(model).values())
    if not params:
        raise ModelError(f"model.mode={job.spec.model.mode}: nothing to train (no parameter requires a gradient)")
    if comm is not None:
        comm.broadcast_(params)
    opt = build_optimizer(settings.optimizer, params, train.learning_rate, train.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(train.scheduler, warmup, total_steps))
    scaler = torch.amp.GradScaler(device_type) if settings.precision == "fp16" and device_type == "cuda" else None
    return opt, sched, scaler


def _resume(run: _Run, out_dir: Path, optimizer: str) -> None:
    """Continue from the last checkpoint in out_dir when it was made for this run; else remove them all."""
    ckpts = _checkpoints(out_dir)
    if not ckpts:
        return
    _, last = ckpts[-1]
    meta = json.loads((last / "state.json").read_text(encoding="utf-8"))
    same = (meta.get("fingerprint") == run.fingerprint and meta.get("effective_batch", run.effective) == run.effective
            and meta.get("optimizer", "adamw") == optimizer)
    if not same:
        if run.comm is not None:
            run.comm.barrier()  # every rank has read the state before rank 0 removes it
        if run.main:
            log.warning("checkpoints in %s were made for other rows or settings: starting over", last.parent)
            shutil.rmtree(last.parent, ignore_errors=True)
        return
    state = _load_checkpoint(last, run.model, run.opt, run.sched, run.scaler, run.rank)
    run.step, run.losses, run.ooms = state["step"], state["losses"], state.get("ooms", [])
    run.resumed_from = run.step
    if state.get("num_processes", 1) == run.world:
        run.micro, run.accum = state["micro_batch"], state["grad_accum"]
    log.info("resuming training from %s (step %d of %d)", last, run.step, run.total_steps)


def _loop(run: _Run, job: _Job, loaded: Loaded, settings: TrainSettings) -> dict[str, Any]:
    """Optimizer steps until total_steps (or stop_after_steps), checkpointing on the way; the utilisation summary."""
    from tqdm.auto import tqdm

    spec, device_type, device = job.spec, job.hw.device, _model_device(run.model)
    bar = tqdm(total=run.total_steps, initial=run.step, disable=not (job.progress and run.main), desc="train",
               unit="step")
    run.model.train()
    with UtilisationWatch(device_type) as watch:
        while run.step < run.total_steps:
            if job.stop_after_steps is not None and run.step >= job.stop_after_steps:
                break
            idx = step_indices(run.step, len(job.rows), run.effective, spec.seed)
            if run.rank is not None:
                idx = shard(idx, run.rank.rank, run.world)
            try:
                loss = _optimizer_step(run.model, loaded.processor, loaded.family, job.rows, idx, run.micro, device,
                                       device_type, settings.precision, run.opt, run.scaler, spec.train.max_grad_norm,
                                       run.step, job.oom_hook, comm=run.comm, offload=settings.activation_offload)
            except torch.cuda.OutOfMemoryError as exc:
                _halve_micro_batch(run, exc, device_type)
                continue
            run.sched.step()
            run.step += 1
            run.losses.append(loss)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
            if job.on_step is not None and run.main:
                job.on_step(run.step, run.total_steps, loss)
            if run.step % spec.train.checkpoint_every == 0 and run.step < run.total_steps:
                _save_checkpoint(job.out_dir, run.step, run.model, run.opt, run.sched, run.scaler,
                                 {"fingerprint": run.fingerprint, "losses": run.losses, "ooms": run.ooms,
                                  "micro_batch": run.micro, "grad_accum": run.accum, "total_steps": run.total_steps,
                                  "num_processes": run.world, "effective_batch": run.effective,
                                  "optimizer": settings.optimizer}, run.comm)
    bar.close()
    run.model.eval()
    return watch.summary()


def _halve_micro_batch(run: _Run, exc: torch.cuda.OutOfMemoryError, device_type: str) -> None:
    """After an OOM: the same step again with half the micro-batch and twice the accumulation."""
    run.opt.zero_grad(set_to_none=True)
    if device_type == "cuda":
        torch.cuda.empty_cache()
    if run.micro == 1:
        raise ModelError(f"out of GPU memory at step {run.step} even with micro-batch 1 ({exc}); use "
                         "model.mode qlora, train.gradient_checkpointing true, or smaller images "
                         "(preprocess.size)") from None
    run.micro, run.accum = run.micro // 2, run.accum * 2
    run.ooms.append({"step": run.step, "micro_batch": run.micro, "grad_accum": run.accum})
    log.warning("out of memory at step %d: retrying with micro-batch %d × accumulation %d (same "
                "effective batch %d)", run.step, run.micro, run.accum, run.effective)


def _save_adapter(run: _Run, job: _Job, loaded: Loaded, settings_info: dict[str, Any],
                  info: dict[str, Any]) -> TrainResult:
    """Rank 0 writes the adapter and the stage manifest, then drops the checkpoints; the other ranks wait."""
    out_dir, losses = job.out_dir, run.losses
    adapter_dir = out_dir / "adapter"
    manifest = None
    if run.main:
        with atomic_dir(adapter_dir) as tmp:
            run.model.save_pretrained(tmp)
            if job.spec.model.mode == "full":
                loaded.processor.save_pretrained(tmp)
        manifest = write_manifest(out_dir, stage="train", stage_version=TRAIN_VERSION, inputs=job.inputs,
                                  config=job.config, outputs={"adapter": adapter_dir}, info=info)
        # The adapter is recorded; the checkpoints only served to get here.
        shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
        log.info("trained %d steps in %.1fs: loss %.4f → %.4f; adapter %s (digest %s…)", run.step, info["seconds"],
                 losses[0] if losses else float("nan"), losses[-1] if losses else float("nan"), adapter_dir,
                 manifest.outputs["adapter"].digest[:12])
    if run.comm is not None:
        run.comm.barrier()  # the other ranks return once the adapter and manifest are in place
    return TrainResult(out_dir, adapter_dir, run.step, run.total_steps, losses, settings_info, info, manifest)


def _per_process(util: dict[str, Any], comm: Comm) -> dict[str, Any]:
    """Rank 0's utilisation summary plus every rank's peak memory (a collective)."""
    key = "peak_rss_mb" if "peak_rss_mb" in util else "peak_allocated_mb"
    peaks = comm.gather(torch.tensor([float(util.get(key) or 0.0)], dtype=torch.float64))
    return {**util, "per_process": {key: [round(float(p.item()), 1) for p in peaks]}}


def _optimizer_step(model: torch.nn.Module, processor: Any, family: Any, rows: Sequence[dict[str, Any]],
                    idx: list[int], micro: int, device: torch.device, device_type: str, precision: str,
                    opt: torch.optim.Optimizer, scaler: Any, max_grad_norm: float, step: int,
                    oom_hook: OomHook | None, comm: Comm | None = None, offload: bool = False) -> float:
    """One optimizer step over rows `idx` in micro-batches; returns the step's mean answer-token loss.

    With `comm` (several ranks) `idx` is this rank's share: the token count that weighs each micro-batch and the
    gradients are summed over all ranks, so the step equals one process's over the whole effective batch."""
    batches = []
    for i in range(0, len(idx), micro):
        chunk = [rows[j] for j in idx[i: i + micro]]
        images, questions = _row_inputs(chunk, idx[i: i + micro])
        enc = family.encode(processor, images, questions, [r["answer"] for r in chunk])
        enc = dict(enc)
        enc.pop("answer_start")
        batches.append(enc)
    # Each micro-batch's mean is weighted by its share of the step's answer tokens: the step's loss is the mean over
    # all its tokens, whatever the split (and so unchanged when an OOM halves the micro-batch).
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    total = sum(counts) if comm is None else int(comm.sum([sum(counts)])[0])
    opt.zero_grad(set_to_none=True)
    step_loss = 0.0
    oom: torch.cuda.OutOfMemoryError | None = None
    try:
        for enc, count in zip(batches, counts, strict=True):
            if oom_hook is not None:
                oom_hook(step, micro)
            with _autocast(device_type, precision), _offload(offload and device_type == "cuda"):
                out = model(**_to(enc, device))
            loss = out.loss.float() * (count / total)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            step_loss += float(loss.detach())
    except torch.cuda.OutOfMemoryError as exc:
        if comm is None:
            raise
        oom = exc
    params = [p for p in model.parameters() if p.requires_grad]
    if comm is not None:
        # Every rank retries the step with half the micro-batch when any one ran out of memory.
        if comm.any(oom is not None):
            raise oom or torch.cuda.OutOfMemoryError("another rank ran out of memory")
        comm.sum_grads(params)
        step_loss = comm.sum([step_loss])[0]
    if scaler is not None:
        scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    return step_loss
