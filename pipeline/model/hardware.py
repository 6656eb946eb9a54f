"""What this machine has, and the training settings (micro-batch, accumulation, checkpointing, precision) that fit it.

`choose_train_settings` keeps the configured effective batch (micro × accumulation) and lets the memory planner pick
the largest micro-batch that fits the device's memory with a safety margin. Without a model config to plan from it
falls back to fixed tiers by GPU memory.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.config import ModelConfig, TrainConfig

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
        if self.device == "cuda" and self.gpus:
            return self.gpus[0].available_bytes
        return self.ram_bytes if self.ram_available_bytes is None else self.ram_available_bytes

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

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.grad_accum


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


def choose_train_settings(
    train_cfg: TrainConfig,
    model_cfg: ModelConfig,
    hw: Hardware,
    model_config: Any = None,
    *,
    seq_len: int = 256,
    image_size: int | None = None,
) -> TrainSettings:
    """Micro-batch, accumulation, checkpointing, precision and quantization for this model on this hardware.

    `model_config` is a transformers config (or a path / hub ID to read one from); None reads it from
    `model_cfg.name_or_path` when that is a local folder, and falls back to fixed tiers when it cannot.
    `seq_len` counts text tokens per sample; image tokens are added from `image_size`.
    """
    precision = choose_precision(train_cfg, model_cfg, hw)
    quantize = model_cfg.mode == "qlora"
    effective = train_cfg.effective_batch_size
    ckpt_cfg = train_cfg.gradient_checkpointing

    if isinstance(train_cfg.batch_size, int):
        micro = train_cfg.batch_size
        accum = _accum_for(effective, micro)
        ckpt = ckpt_cfg if isinstance(ckpt_cfg, bool) else _fits_or_checkpoint(
            model_cfg, hw, model_config, micro, precision, seq_len, image_size)
        reason = f"train.batch_size={micro} is set; accumulation {accum} for effective batch {effective}"
        if micro * accum != effective:
            reason += f" (becomes {micro * accum}: {effective} is not a multiple of {micro})"
            log.warning("effective batch %d is not a multiple of train.batch_size %d; training with %d",
                        effective, micro, micro * accum)
        return TrainSettings(micro, accum, ckpt, precision, quantize, reason)

    micro, ckpt = tier_micro_batch(hw)
    micro = _largest_divisor_at_most(effective, micro)
    if isinstance(ckpt_cfg, bool):
        ckpt = ckpt_cfg
    reason = (f"tier for {hw.device} with {hw.memory_budget_bytes / GiB:.1f} GiB: micro-batch {micro} × "
              f"accumulation {effective // micro}")
    return TrainSettings(micro, effective // micro, ckpt, precision, quantize, reason)


def _fits_or_checkpoint(model_cfg: ModelConfig, hw: Hardware, model_config: Any, micro: int, precision: Precision,
                        seq_len: int, image_size: int | None) -> bool:
    micro_tier, ckpt = tier_micro_batch(hw)
    return ckpt or micro > micro_tier
