"""The optimizers `train.optimizer` names, and their state as safetensors + JSON (no pickle) for checkpoints.

torch's AdamW, or bitsandbytes' AdamW8bit / PagedAdamW / PagedAdamW8bit (they run on the CPU too, the 8-bit state
in uint8). A checkpoint stores every state tensor as its own safetensors entry and the scalars and parameter groups
as JSON, so the 8-bit state is restored bit for bit and a killed run resumes exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from pipeline.errors import ModelError

log = logging.getLogger(__name__)


def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state dict into tensors (safetensors) and plain data (JSON): no pickle on disk.

    Keys are `param.name`, or `param.group.name` for a nested dict (bitsandbytes wraps its 8-bit state, absmax
    and quantization maps in one per parameter), so the 8-bit state is stored as its own uint8 tensors, exactly."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    seen: set[int] = set()

    def put(key: str, v: Any) -> None:
        if torch.is_tensor(v):
            t = v.detach().cpu().contiguous()
            # bitsandbytes shares one quantization map between parameters; safetensors refuses shared storage.
            ptr = t.untyped_storage().data_ptr()
            tensors[key] = t.clone() if ptr in seen else t
            seen.add(ptr)
        elif isinstance(v, dict):
            for k, sub in v.items():
                put(f"{key}.{k}", sub)
        else:
            scalars[key] = v

    for idx, state in sd["state"].items():
        for k, v in state.items():
            put(f"{idx}.{k}", v)
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                     devices: Sequence[torch.device] | None = None) -> dict[str, Any]:
    """The inverse of optimizer_tensors; tensors go to their parameter's device (`devices`, in parameter order)."""
    state: dict[int, dict[str, Any]] = {}
    for key, v in [*tensors.items(), *meta["scalars"].items()]:
        idx, *path = key.split(".")
        if devices is not None and torch.is_tensor(v):
            v = v.to(devices[int(idx)])
        node = state.setdefault(int(idx), {})
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = v
    return {"state": state, "param_groups": meta["param_groups"]}


# ------------------------------------------------------------------------------------------------ optimizers
def build_optimizer(name: str, params: Sequence[torch.nn.Parameter], lr: float,
                    weight_decay: float) -> torch.optim.Optimizer:
    """`train.optimizer` (resolved, see pipeline.model.hardware.resolve_optimizer) → the optimizer object.

    The 8-bit ones keep both Adam moments in uint8 with one fp32 absmax per 256 values (block-wise quantization;
    tensors under 4,096 values keep fp32 state); the paged ones put their state in CUDA unified memory, which the
    driver pages to host memory under pressure (bitsandbytes falls back to ordinary memory on the CPU)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    import bitsandbytes as bnb

    classes = {"adamw_8bit": bnb.optim.AdamW8bit, "paged_adamw": bnb.optim.PagedAdamW,
               "paged_adamw_8bit": bnb.optim.PagedAdamW8bit}
    if name not in classes:
        raise ModelError(f"train.optimizer {name!r} is not one of adamw, {', '.join(classes)}")
    if name.startswith("paged") and not any(p.is_cuda for p in params):
        import warnings

        # bitsandbytes warns at the first step that paging falls back to ordinary memory on the CPU: documented
        # above and logged here once, instead of a warning from inside its step.
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        log.info("train.optimizer %s on the CPU: no paging (a CUDA feature), the state is ordinary memory", name)
    return classes[name](params, lr=lr, weight_decay=weight_decay)


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor the optimizer keeps (moments, 8-bit absmax and maps, step counters), each storage once
    (bitsandbytes shares its quantization maps between parameters)."""
    total = 0
    seen: set[int] = set()

    def add(v: Any) -> None:
        nonlocal total
        if torch.is_tensor(v):
            ptr = v.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += v.numel() * v.element_size()
        elif isinstance(v, dict):
            for sub in v.values():
                add(sub)

    for state in opt.state.values():
        add(state)
    return total
