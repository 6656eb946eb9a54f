"""What each training-memory knob saves and costs, for one project config: the planner's peak per alternative and a
relative step time from a FLOP count, side by side (`tamis plan --config`).

The step time is arithmetic, not a measurement: forward 2 FLOPs per weight per token through every Linear (and the
output head); backward 2× that through the trained weights (input and weight gradients) and 1× through frozen layers
that gradients still pass (input gradients only); checkpointing adds one more forward of the checkpointed layers
gradients pass. It leaves out what a FLOP count cannot see (4-bit dequantization, host transfers of offloaded
activations and paged state, the fused kernels' fewer memory passes), and the table says so per knob.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pipeline.config import ModelConfig
from pipeline.model.planner import (
    GiB,
    ModelShape,
    Plan,
    PlanInputs,
    _is_vision,
    image_token_counts,
    lora_targets,
    plan,
)


def step_flops(shape: ModelShape, *, mode: str, checkpointing: bool, train: str, batch: int, seq_len: int,
               image_size: int, target_modules: Any = None) -> float:
    """FLOPs of one training step's forward + backward (+ recompute), from the Linear layers' sizes."""
    img, vis = image_token_counts(shape, image_size)
    tokens, vtokens = batch * (seq_len + img), batch * vis
    text_w = sum(lin.numel for lin in shape.linears if not _is_vision(lin.name))
    vis_w = sum(lin.numel for lin in shape.linears if _is_vision(lin.name))
    head = shape.vocab * shape.text.hidden if not any(lin.name.endswith("lm_head") for lin in shape.linears) else 0
    fwd_text, fwd_vis = 2.0 * (text_w + head) * tokens, 2.0 * vis_w * vtokens
    if mode == "full":
        vision_grads = True
        back = 2 * (fwd_text + fwd_vis)
    else:
        vision_grads = any(_is_vision(lin.name) for lin in lora_targets(shape, target_modules, train))
        back = fwd_text + (fwd_vis if vision_grads else 0.0)  # input gradients only (adapters are small)
    recompute = (fwd_text + (fwd_vis if vision_grads else 0.0)) if checkpointing else 0.0
    return fwd_text + fwd_vis + back + recompute


@dataclass(frozen=True)
class Alternative:
    knob: str
    setting: str
    plan: Plan
    flops: float
    note: str = ""


def alternatives(shape: ModelShape, base: PlanInputs) -> list[Alternative]:
    """The configured plan first, then one plan per single change of a knob (the others as configured)."""
    device = base.device

    def one(knob: str, setting: str, note: str = "", **change: Any) -> Alternative:
        i = replace(base, **change)
        p = plan(shape, i)
        f = step_flops(shape, mode=i.mode, checkpointing=i.checkpointing, train=i.train, batch=i.batch,
                       seq_len=i.seq_len, image_size=p.image_size, target_modules=i.target_modules)
        return Alternative(knob, setting, p, f, note)

    rows = [one("as configured", _describe(base))]
    ckpt = not base.checkpointing
    rows.append(one("train.gradient_checkpointing", "on" if ckpt else "off", "recomputes each layer in backward",
                    checkpointing=ckpt))
    for opt in ("adamw", "adamw_8bit", "paged_adamw", "paged_adamw_8bit"):
        if opt != base.optimizer:
            note = {"adamw_8bit": "8-bit moments (block-wise absmax)",
                    "paged_adamw": "state paged to host under pressure (CUDA)" if device == "cuda"
                    else "no paging on the CPU",
                    "paged_adamw_8bit": "8-bit and paged" if device == "cuda" else "8-bit; no paging on the CPU",
                    "adamw": "fp32 moments (torch)"}[opt]
            rows.append(one("train.optimizer", opt, note, optimizer=opt))
    if device == "cuda":
        rows.append(one("train.activation_offload", "off" if base.activation_offload else "on",
                        "+ host transfers (overlapped, not counted)", activation_offload=not base.activation_offload))
        rows.append(one("model.liger", "off" if base.liger else "on", "fused kernels: fewer memory passes",
                        liger=not base.liger))
    for mode in ("qlora", "lora", "full"):
        if mode != base.mode:
            rows.append(one("model.mode", mode, "4-bit dequantization not counted in time" if mode == "qlora" else "",
                            mode=mode))
    if base.mode != "full" and base.target_modules is None:
        for train in ("language", "language+projector", "all"):
            if train != base.train:
                rows.append(one("model.train", train, train=train))
    return rows


def _describe(base: PlanInputs) -> str:
    return f"{base.mode}, ckpt {'on' if base.checkpointing else 'off'}, {base.optimizer}, micro-batch {base.batch}"


def knobs_table(rows: list[Alternative], budget: int | None = None) -> Any:
    """rich Table: peak memory of each alternative, its difference from the configured one, relative step time."""
    from rich.table import Table

    first = rows[0]
    where = f"{first.plan.device}, {first.plan.precision}, {first.plan.seq_len} text + {first.plan.image_tokens} " \
            f"image tokens"
    t = Table(title=f"What each knob saves and costs ({where}; peak GiB by the planner, step time from FLOPs)")
    for col in ("knob", "setting", "peak GiB", "vs configured", "step time", "note"):
        t.add_column(col, justify="right" if col in ("peak GiB", "vs configured", "step time") else "left")
    for r in rows:
        diff = r.plan.total - first.plan.total
        delta = "-" if r is first else f"{diff / GiB:+.2f} ({diff / first.plan.total:+.0%})"
        fits = "" if budget is None else (" [green]fits[/]" if r.plan.total <= budget else " [red]over[/]")
        t.add_row(r.knob, r.setting, f"{r.plan.total / GiB:.2f}{fits}", delta, f"×{r.flops / first.flops:.2f}",
                  r.note)
    return t


def plan_inputs(model_cfg: ModelConfig, settings: Any, *, seq_len: int, image_size: int | None, device: str) -> PlanInputs:
    """The planner's inputs for a project's model section and its chosen training settings on `device`."""
    return PlanInputs(mode=model_cfg.mode, batch=settings.micro_batch, seq_len=seq_len, image_size=image_size,
                      lora_r=model_cfg.lora_r, target_modules=model_cfg.target_modules,
                      checkpointing=settings.gradient_checkpointing, precision=settings.precision,
                      lora_dropout=model_cfg.lora_dropout, optimizer=settings.optimizer,
                      activation_offload=settings.activation_offload, train=model_cfg.train,
                      liger=getattr(settings, "liger", False), processes=settings.num_processes, device=device)
