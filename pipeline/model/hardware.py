"""What this machine has, and the training settings (micro-batch, accumulation, checkpointing, precision) that fit it.

`choose_train_settings` keeps the configured effective batch (micro × accumulation × data-parallel processes) and lets
the memory planner pick the largest micro-batch that fits one device's memory with a safety margin. Without a model
config to plan from it falls back to fixed tiers by GPU memory.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pipeline.config import ModelConfig, TrainConfig
from pipeline.errors import ModelError

log = logging.getLogger(__name__)

GiB = 1 << 30
# Fraction of free memory a plan may use: the planner is an estimate, and allocator fragmentation is real.
SAFETY = 0.85
Precision = Literal["fp32", "bf16", "fp16"]


@dataclass(frozen=True)
class GPU:
    name: str
    total_memory_bytes: int
    compute_capability: tuple[int, int]
    bf16_supported: bool
    # None when unknown (an injected figure in tests): the total is used then.
    free_memory_bytes: int | None = None

    @property
    def available_bytes(self) -> int:
        return self.total_memory_bytes if self.free_memory_bytes is None else self.free_memory_bytes


@dataclass(frozen=True)
class Hardware:
    device: Literal["cuda", "cpu"]
    gpus: list[GPU] = field(default_factory=list)
    cpu_count: int = 1
    ram_bytes: int = 0
    # RAM not in use by others; the budget for training on CPU.
    ram_available_bytes: int | None = None

    @property
    def memory_budget_bytes(self) -> int:
        """Memory one training process may plan for: the first GPU's free memory, else available RAM."""
        return self.process_budget_bytes(1)

    def process_budget_bytes(self, num_processes: int) -> int:
        """Memory each of `num_processes` data-parallel processes may plan for: the least free of the GPUs they use
        (one each), or an equal share of the available RAM on a CPU."""
        if self.device == "cuda" and self.gpus:
            return min(g.available_bytes for g in self.gpus[:num_processes])
        ram = self.ram_bytes if self.ram_available_bytes is None else self.ram_available_bytes
        return ram // max(1, num_processes)

    @property
    def bf16_supported(self) -> bool:
        return self.device == "cuda" and bool(self.gpus) and self.gpus[0].bf16_supported

    def describe(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "gpus": [
                {"name": g.name, "total_memory_gib": round(g.total_memory_bytes / GiB, 2),
                 "free_memory_gib": None if g.free_memory_bytes is None else round(g.free_memory_bytes / GiB, 2),
                 "compute_capability": ".".join(map(str, g.compute_capability)), "bf16": g.bf16_supported}
                for g in self.gpus
            ],
            "cpu_count": self.cpu_count,
            "ram_gib": round(self.ram_bytes / GiB, 2),
            "ram_available_gib": None if self.ram_available_bytes is None else round(self.ram_available_bytes / GiB, 2),
        }


@dataclass(frozen=True)
class TrainSettings:
    micro_batch: int
    grad_accum: int
    gradient_checkpointing: bool
    precision: Precision
    quantize: bool
    reason: str
    num_processes: int = 1  # data-parallel processes, each with micro_batch × grad_accum samples per step
    optimizer: str = "adamw"  # train.optimizer resolved (resolve_optimizer)
    activation_offload: bool = False  # train.activation_offload, False on the CPU (a no-op there)
    liger: bool = False  # model.liger resolved: never on the CPU

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.num_processes


def detect_hardware() -> Hardware:
    """CUDA GPUs when torch sees any, else the CPU. Never fails: a broken CUDA set-up is logged and treated as CPU."""
    import psutil
    import torch

    vm = psutil.virtual_memory()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    gpus: list[GPU] = []
    try:
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                free, _ = torch.cuda.mem_get_info(i)
                cap = (props.major, props.minor)
                # Ampere (8.0) and newer have native bf16; older GPUs only emulate it, slowly.
                gpus.append(GPU(props.name, int(props.total_memory), cap, cap[0] >= 8, int(free)))
    except RuntimeError as exc:
        log.warning("CUDA is present but unusable (%s); using the CPU", exc)
        gpus = []
    return Hardware("cuda" if gpus else "cpu", gpus, cpus, int(vm.total), int(vm.available))


CPU_MMAP_THRESHOLD = 64 << 10  # bytes: allocations from this size on get their own mapping, returned when freed


def bound_cpu_allocator(threshold: int = CPU_MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold for CPU training; True when set.

    glibc raises the threshold to the size of each large block freed (up to 32 MiB), after which tensors of that
    size come from its heap, and freed ones stay resident there for reuse. A checkpointed step frees every layer's
    activations as it goes, so the process kept ~0.4 GB more resident than its live tensors on the SmolVLM-256M
    shape (benchmarks/memory.py). With the threshold fixed, a freed tensor's pages go back to the OS at once: the
    resident size tracks the live tensors, which is what the memory planner counts (and no slower here)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, int(threshold)))  # -3 = M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to fix
        return False


def resolve_num_processes(value: int | str, hw: Hardware) -> int:
    """`train.num_processes`: auto → one process per visible GPU (1 on a CPU-only machine); an integer is checked
    against the GPUs there are (on a CPU any count runs, as gloo processes sharing the cores)."""
    from pipeline.errors import ConfigError

    if value == "auto":
        return max(1, len(hw.gpus)) if hw.device == "cuda" else 1
    n = int(value)
    if hw.device == "cuda" and n > len(hw.gpus):
        raise ConfigError(f"train.num_processes is {n} but {len(hw.gpus)} GPU(s) are visible (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); lower it or set it to auto")
    return n


def choose_precision(train_cfg: TrainConfig, model_cfg: ModelConfig, hw: Hardware) -> Precision:
    """auto → bf16 where the GPU supports it, fp16 on older GPUs, fp32 on CPU (bf16 matmuls crawl on CPUs)."""
    if train_cfg.precision != "auto":
        return train_cfg.precision
    explicit = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(model_cfg.compute_dtype)
    if explicit is not None:
        return explicit  # type: ignore[return-value]
    if hw.device != "cuda":
        return "fp32"
    return "bf16" if hw.bf16_supported else "fp16"


def resolve_optimizer(train_cfg: TrainConfig, model_cfg: ModelConfig, hw: Hardware) -> str:
    """train.optimizer: auto → adamw_8bit for full training (fp32 Adam moments are 8 bytes per parameter, 8-bit
    ones ~2), paged_adamw for qlora on CUDA (the QLoRA recipe's paged optimizer), adamw otherwise (a LoRA's state
    is a few MB, and paging is a CUDA feature)."""
    if train_cfg.optimizer != "auto":
        return train_cfg.optimizer
    if model_cfg.mode == "full":
        return "adamw_8bit"
    return "paged_adamw" if model_cfg.mode == "qlora" and hw.device == "cuda" else "adamw"


def resolve_activation_offload(train_cfg: TrainConfig, hw: Hardware) -> bool:
    """train.activation_offload on CUDA only: on the CPU activations already sit in host memory (a no-op, logged)."""
    if train_cfg.activation_offload and hw.device != "cuda":
        log.info("train.activation_offload is a no-op on the CPU: activations already live in host memory")
        return False
    return train_cfg.activation_offload


def resolve_liger(model_cfg: ModelConfig, hw: Hardware) -> tuple[bool, str]:
    """(apply Liger's kernels?, why). Never on the CPU: they are Triton GPU kernels."""
    if model_cfg.liger is False:
        return False, "model.liger is false"
    if hw.device != "cuda":
        if model_cfg.liger is True:
            log.warning("model.liger is true but training runs on the CPU: Liger's Triton kernels need a CUDA GPU, "
                        "so the model is left unpatched")
        return False, "not applied on the CPU (Liger's kernels need CUDA)"
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        if model_cfg.liger is True:
            raise ModelError("model.liger is true but liger_kernel does not import; install the extra "
                             "(pip install 'tamis[liger]') or set model.liger: auto") from None
        return False, "liger_kernel is not installed (pip install 'tamis[liger]')"
    return True, "CUDA and liger_kernel present" + (" (model.liger: auto)" if model_cfg.liger == "auto" else "")


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def tier_micro_batch(hw: Hardware) -> tuple[int, bool]:
    """The fixed fallback when nothing can be planned: (micro-batch, gradient checkpointing) by device memory."""
    if hw.device != "cuda":
        return 1, False
    gib = hw.memory_budget_bytes / GiB
    if gib >= 24:
        return 8, False
    if gib >= 16:
        return 4, False
    if gib >= 8:
        return 2, True
    return 1, True


def _accum_for(effective: int, micro: int) -> int:
    return max(1, -(-effective // micro))


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def _shape(model_cfg: ModelConfig, model_config: Any) -> Any:
    """The planner's view of the model, or None when its config cannot be read (then the tiers decide)."""
    from pipeline.errors import TamisError
    from pipeline.model.planner import ModelShape, analyze

    if isinstance(model_config, ModelShape):
        return model_config
    source = model_config
    if source is None:
        path = Path(model_cfg.name_or_path)
        if path.is_absolute() or path.exists():
            if not (path / "config.json").is_file():
                log.info("%s has no config.json yet: batch settings from the memory tiers", path)
                return None
            source = str(path)
        else:
            source = model_cfg.name_or_path  # a hub ID: readable when it is in the local cache
    try:
        # Cache only: choosing batch settings must not wait on (or fail for) the network.
        return _analyze_cached(source) if isinstance(source, str) else analyze(source, local_only=True)
    except (TamisError, OSError, ValueError) as exc:
        log.warning("cannot plan memory for %s (%s): batch settings from the memory tiers", source, exc)
        return None


@functools.lru_cache(maxsize=8)
def _analyze_cached(source: str) -> Any:
    from pipeline.model.planner import analyze

    return analyze(source, local_only=True)


@dataclass(frozen=True)
class _Candidates:
    """What every candidate micro-batch is planned with: the model, one process's memory budget, the options
    resolved for this hardware, and one process's share of the effective batch."""
    model_cfg: ModelConfig
    hw: Hardware
    shape: Any  # a planner ModelShape, None when no model config can be read
    seq_len: int
    image_size: int | None
    nproc: int
    budget: int
    effective: int
    ckpt_options: list[bool]
    precision: Precision
    optimizer: str
    offload: bool
    liger: bool

    @property
    def where(self) -> str:
        return f"{self.hw.device} with {self.budget / GiB:.1f} GiB free" + (
            f" per process ({self.nproc} processes)" if self.nproc > 1 else "")

    def plan(self, micro: int, ckpt: bool) -> Any:
        from pipeline.model.planner import PlanInputs, plan

        m = self.model_cfg
        attention = "eager" if m.attn_implementation == "eager" else "sdpa"
        return plan(self.shape, PlanInputs(
            mode=m.mode, batch=micro, seq_len=self.seq_len, image_size=self.image_size, gpu_memory_bytes=self.budget,
            lora_r=m.lora_r, target_modules=m.target_modules, checkpointing=ckpt, precision=self.precision,
            device=self.hw.device, lora_dropout=m.lora_dropout, attention=attention, margin=SAFETY,
            processes=self.nproc, optimizer=self.optimizer, activation_offload=self.offload, train=m.train,
            liger=self.liger))

    def settings(self, micro: int, accum: int, ckpt: bool, reason: str) -> TrainSettings:
        if self.nproc > 1:
            reason += f"; × {self.nproc} processes = effective batch {micro * accum * self.nproc}"
        return TrainSettings(micro, accum, ckpt, self.precision, self.model_cfg.mode == "qlora", reason, self.nproc,
                             self.optimizer, self.offload, self.liger)


def choose_train_settings(
    train_cfg: TrainConfig,
    model_cfg: ModelConfig,
    hw: Hardware,
    model_config: Any = None,
    *,
    seq_len: int = 128,
    image_size: int | None = None,
    num_processes: int = 1,
) -> TrainSettings:
    """Micro-batch, accumulation, checkpointing, precision and quantization for this model on this hardware.

    The effective batch (micro × accumulation) stays `train.effective_batch_size`. `model_config` is a transformers
    config, a config.json / model folder / hub ID, or a planner `ModelShape`; None reads `model_cfg.name_or_path`.
    The memory planner then picks the largest micro-batch that fits within SAFETY × free memory, without gradient
    checkpointing unless checkpointing allows at least twice the micro-batch (or nothing fits without it). When no
    config can be read, fixed tiers by GPU memory decide. `seq_len` counts text tokens per sample; the image tokens
    of one `image_size` px image (default: the model's native size) are added. CPU training uses micro-batch 1.

    With `num_processes` > 1 every process trains on its own device with a share of the effective batch: the plan is
    per device (the least free of the GPUs used), and micro × accumulation covers effective / num_processes.
    """
    c = _candidates(train_cfg, model_cfg, hw, model_config, seq_len=seq_len, image_size=image_size,
                    num_processes=num_processes)
    if isinstance(train_cfg.batch_size, int):
        return _fixed_micro_batch(train_cfg.batch_size, c)
    if c.shape is None:
        micro, ckpt = tier_micro_batch(hw)
        micro = _largest_divisor_at_most(c.effective, micro)
        ckpt = c.ckpt_options[0] if len(c.ckpt_options) == 1 else ckpt
        reason = f"memory tier for {c.where} (no model config to plan from)"
        return c.settings(micro, c.effective // micro, ckpt, reason)
    return _planned(c)


def _candidates(train_cfg: TrainConfig, model_cfg: ModelConfig, hw: Hardware, model_config: Any, *, seq_len: int,
                image_size: int | None, num_processes: int) -> _Candidates:
    precision = choose_precision(train_cfg, model_cfg, hw)
    optimizer = resolve_optimizer(train_cfg, model_cfg, hw)
    offload = resolve_activation_offload(train_cfg, hw)
    liger = resolve_liger(model_cfg, hw)[0]
    nproc = max(1, num_processes)
    effective = -(-train_cfg.effective_batch_size // nproc)
    if effective * nproc != train_cfg.effective_batch_size:
        log.warning("train.effective_batch_size %d is not a multiple of %d processes; training with %d",
                    train_cfg.effective_batch_size, nproc, effective * nproc)
    ckpt_cfg = train_cfg.gradient_checkpointing
    ckpt_options = [ckpt_cfg] if isinstance(ckpt_cfg, bool) else [False, True]
    shape = _shape(model_cfg, model_config)
    return _Candidates(model_cfg, hw, shape, seq_len, image_size, nproc, hw.process_budget_bytes(nproc), effective,
                       ckpt_options, precision, optimizer, offload, liger)


def _fixed_micro_batch(batch_size: int, c: _Candidates) -> TrainSettings:
    """train.batch_size is set: accumulation makes up the effective batch; checkpointing only if it must."""
    micro, effective, nproc = batch_size, c.effective, c.nproc
    if nproc > 1 and micro > effective:
        # The micro-batch is per device; a device's share of the step is smaller here. Keeping it would silently
        # multiply the effective batch (and the epochs) by the number of processes.
        micro = _largest_divisor_at_most(effective, micro)
        log.info("train.batch_size %d is more than each of %d processes' share of the effective batch (%d): "
                 "micro-batch %d per process", batch_size, nproc, effective, micro)
    accum = _accum_for(effective, micro)
    if c.shape is None:
        ckpt = c.ckpt_options[0] if len(c.ckpt_options) == 1 else tier_micro_batch(c.hw)[1]
    else:
        ckpt = next((k for k in c.ckpt_options if c.plan(micro, k).fits), c.ckpt_options[-1])
    reason = f"train.batch_size={batch_size} is set"
    if micro != batch_size:
        reason += f", lowered to {micro} (each process's share of the effective batch)"
    reason += f"; accumulation {accum} for effective batch {effective}"
    if micro * accum != effective:
        reason += f" (becomes {micro * accum}: {effective} is not a multiple of {micro})"
        log.warning("effective batch %d is not a multiple of train.batch_size %d; training with %d",
                    effective, micro, micro * accum)
    return c.settings(micro, accum, ckpt, reason)


def _planned(c: _Candidates) -> TrainSettings:
    """The largest micro-batch the planner fits, with and without checkpointing; checkpointing only if it pays."""
    candidates = [1] if c.hw.device != "cuda" else _divisors_desc(c.effective)
    best: dict[bool, tuple[int, Any]] = {}
    for ckpt in c.ckpt_options:
        for micro in candidates:
            p = c.plan(micro, ckpt)
            if p.fits:
                best[ckpt] = (micro, p)
                break
    if not best:
        ckpt = c.ckpt_options[-1]
        p = c.plan(1, ckpt)
        reason = (f"does not fit: micro-batch 1 needs {p.total / GiB:.2f} GiB by the planner, "
                  f"{SAFETY:.0%} of {c.where} is {SAFETY * c.budget / GiB:.2f} GiB; "
                  + ("use model.mode: qlora, " if c.model_cfg.mode != "qlora" else "")
                  + "lower preprocess.size or the text length")
        log.warning("training settings: %s", reason)
        return c.settings(1, c.effective, ckpt, reason)
    no_ckpt, with_ckpt = best.get(False), best.get(True)
    # Checkpointing costs about a third more compute: worth it only for a much larger micro-batch on a GPU that is
    # not yet saturated (micro-batch ≥ 8 already is, for these models).
    if no_ckpt is not None and (with_ckpt is None or with_ckpt[0] < 2 * no_ckpt[0] or no_ckpt[0] >= 8):
        (micro, p), ckpt = no_ckpt, False
    else:
        assert with_ckpt is not None
        (micro, p), ckpt = with_ckpt, True
    reason = (f"planner: micro-batch {micro} × accumulation {c.effective // micro}, checkpointing "
              f"{'on' if ckpt else 'off'} needs {p.total / GiB:.2f} GiB of {c.where} "
              f"(limit {SAFETY:.0%})")
    return c.settings(micro, c.effective // micro, ckpt, reason)


_UNITS = {"": GiB, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": GiB, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_memory(text: str) -> int:
    """'16GiB', '24 GB', '8000MiB' → bytes; a bare number is GiB."""
    import re

    from pipeline.errors import ConfigError

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(f"memory size {text!r} is not understood; write it like 16GiB, 24GB or 8000MiB")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ConfigError(f"memory size {text!r} must be more than 0")
    return value
