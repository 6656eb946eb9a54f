"""Peak training memory from a model's config alone: weights, adapters, optimizer, activations, logits, runtime.

The model is built on the meta device (no weights are allocated) to list its Linear layers and other parameters; the
bitsandbytes rules of transformers decide which Linears become NF4. Activation terms are per-token byte counts of the
tensors autograd saves in one decoder / encoder layer, derived from the layer structure (RMSNorm upcasts, SDPA keeps
q, k, v, out and the log-sum-exp, SwiGLU keeps three intermediate tensors, LoRA keeps its dropped-out input) and
checked against the saved-tensor bytes of real models in tests/test_planner.py.

Assumptions (say so when comparing with a measurement):
- qlora: `prepare_model_for_kbit_training` has cast every non-4-bit parameter to fp32.
- lora: the base model sits in the compute dtype; full: parameters, gradients and AdamW states in the compute dtype.
- LoRA adapters, their gradients and AdamW states are fp32 (PEFT's `autocast_adapter_dtype`).
- Images are planned as squares of `image_size` px: an upper bound for aspect-preserving preprocessing.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from pipeline.errors import ModelError

log = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30
Mode = Literal["qlora", "lora", "full"]
MODES: tuple[Mode, ...] = ("qlora", "lora", "full")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
NF4_BLOCK = 64          # bnb 4-bit blocksize: one absmax per 64 weights
DQ_BLOCK = 256          # double quantization: absmaxes quantized to 8 bit in blocks of 256
VISION_PREFIXES = ("vision_model", "visual", "vision_tower", "vision_encoder")
# Leaf names whose input is not otherwise kept by autograd in a frozen layer: a LoRA there keeps one more tensor.
_UNSHARED_INPUTS = ("o_proj", "out_proj", "down_proj", "fc2", "proj", "dense")
# CUDA context + cuBLAS workspaces (not in max_memory_allocated, but in nvidia-smi); on CPU the resident size of a
# process that imported torch, transformers, peft and bitsandbytes (measured: 854 MB RSS).
RUNTIME_BYTES = {"cuda": 600 * MiB, "cpu": 850 * MiB}
FRAGMENTATION = 0.05    # caching-allocator slack on the dynamic part


@dataclass(frozen=True)
class Linear:
    name: str
    in_features: int
    out_features: int
    bias: bool

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features


@dataclass(frozen=True)
class Stack:
    """A stack of identical transformer layers (the language model, or the vision encoder)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_dim: int       # key/value width (GQA keeps fewer heads)
    q_dim: int
    swiglu: bool
    rms_norm: bool


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs from a model, read once from its config on the meta device."""

    model_type: str
    linears: tuple[Linear, ...]
    other_params: int          # parameters outside Linear layers (embeddings, norms, convolutions), counted once
    other_param_names: tuple[tuple[str, int], ...]
    buffer_bytes: int
    skip_quant: tuple[str, ...]  # module name patterns transformers keeps out of 4-bit
    text: Stack
    vision: Stack | None
    vocab: int
    family: str | None
    vision_cfg: dict[str, Any] = field(default_factory=dict)

    @property
    def params(self) -> int:
        return self.other_params + sum(lin.numel + (lin.out_features if lin.bias else 0) for lin in self.linears)


@dataclass(frozen=True)
class PlanInputs:
    """One training step's configuration as the planner reads it (`plan(model_config, inputs)`); invalid values are
    refused here, naming the field. `seq_len` counts text tokens per sample; `image_size` None: the vision config's
    own; `gpu_memory_bytes` × `margin` is the budget `Plan.fits` compares with; `processes`: data-parallel devices."""

    mode: Mode = "qlora"
    batch: int = 1
    seq_len: int = 256
    image_size: int | None = None
    gpu_memory_bytes: int | None = None
    lora_r: int = 8
    target_modules: Sequence[str] | str | None = None
    checkpointing: bool = False
    precision: str = "bf16"
    device: Literal["cuda", "cpu"] = "cuda"
    lora_dropout: float = 0.05
    attention: Literal["sdpa", "flash_attention_2", "eager"] = "sdpa"
    skip_modules: Sequence[str] | None = None
    double_quant: bool = True
    margin: float = 0.85
    processes: int = 1
    optimizer: str = "adamw"
    activation_offload: bool = False
    train: str = "language"
    liger: bool = False

    def __post_init__(self) -> None:
        _check_plan_args(self.mode, self.precision, self.batch, self.seq_len, self.optimizer)


@dataclass(frozen=True)
class Plan:
    mode: Mode
    batch: int
    seq_len: int                 # text tokens per sample, image tokens excluded
    image_size: int
    image_tokens: int            # tokens the images add to each sample's sequence
    vision_tokens: int           # patches the vision encoder sees per sample
    checkpointing: bool
    precision: str
    device: str
    terms: dict[str, int]        # bytes per term, in table order
    gpu_memory_bytes: int | None
    margin: float
    trainable_params: int
    total_params: int
    processes: int = 1           # data-parallel processes, one per device: every figure here is per device
    optimizer: str = "adamw"
    activation_offload: bool = False
    # Which phase of the step peaks: "backward" (activations, logits alive) or "optimizer step" (its transients).
    phase: str = "backward"
    # Bytes that live in host memory instead of the device's (paged optimizer state, offloaded activations on CUDA).
    host_terms: dict[str, int] = field(default_factory=dict)
    liger: bool = False

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    @property
    def optimizer_state(self) -> int:
        return self.terms.get("optimizer", 0) + self.host_terms.get("optimizer_paged", 0)

    @property
    def weights(self) -> int:
        return sum(v for k, v in self.terms.items() if k.startswith("weights"))

    @property
    def budget(self) -> int | None:
        return None if self.gpu_memory_bytes is None else int(self.gpu_memory_bytes * self.margin)

    @property
    def fits(self) -> bool | None:
        return None if self.budget is None else self.total <= self.budget

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "batch": self.batch, "seq_len": self.seq_len, "image_size": self.image_size,
            "image_tokens": self.image_tokens, "vision_tokens": self.vision_tokens,
            "checkpointing": self.checkpointing, "precision": self.precision, "device": self.device,
            "terms_mb": {k: round(v / MiB, 1) for k, v in self.terms.items()}, "total_mb": round(self.total / MiB, 1),
            "gpu_memory_mb": None if self.gpu_memory_bytes is None else round(self.gpu_memory_bytes / MiB),
            "fits": self.fits, "trainable_params": self.trainable_params, "total_params": self.total_params,
            "processes": self.processes, "optimizer": self.optimizer, "activation_offload": self.activation_offload,
            "phase": self.phase, "host_mb": {k: round(v / MiB, 1) for k, v in self.host_terms.items()},
        }


# ------------------------------------------------------------------------------------------------ model shape
def load_model_config(source: Any, *, local_only: bool = False) -> Any:
    """A transformers config from a config object, a dict, a config.json file, a model folder or a hub ID
    (`local_only`: from the HF cache only, never the network)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return source
    if isinstance(source, dict):
        data = dict(source)
    else:
        path = Path(str(source))
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise ModelError(f"{path}: not valid JSON (line {exc.lineno}): {exc.msg}") from None
        elif not path.exists() and (path.is_absolute() or str(source).startswith(".")):
            raise ModelError(f"{path}: no such model folder or config.json")
        else:
            try:
                return AutoConfig.from_pretrained(str(source), local_files_only=local_only)
            except (OSError, ValueError) as exc:
                raise ModelError(f"{source}: cannot read a model config ({exc}); pass a local model folder or "
                                 "config.json (offline machines cannot reach the hub)") from None
    if "model_type" not in data:
        raise ModelError(f"{source if not isinstance(source, dict) else '<config dict>'}: no 'model_type' key; "
                         "is this a transformers config.json?")
    data.pop("transformers_version", None)
    return AutoConfig.for_model(data.pop("model_type"), **data)


def _meta_model(config: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    with torch.device("meta"):
        for auto in (AutoModelForImageTextToText, AutoModelForCausalLM):
            try:
                return auto.from_config(config)
            except ValueError:
                continue
    raise ModelError(f"model_type {config.model_type!r}: transformers has no image-text-to-text or causal-LM class "
                     "for it, so its memory cannot be planned")


def _skip_patterns(model: Any) -> list[str]:
    """Module names transformers leaves out of bitsandbytes 4-bit by default (lm_head, tied weights, fp32 keeps)."""
    try:
        from transformers.quantizers.base import get_keys_to_not_convert

        skip = list(get_keys_to_not_convert(model))
    except (ImportError, AttributeError):  # older transformers: the output embedding is the documented default
        skip = ["lm_head"]
    return sorted(set(skip) | set(getattr(model, "_keep_in_fp32_modules", None) or ()))


def _quantized(name: str, patterns: Sequence[str]) -> bool:
    # Same matching as transformers' should_convert_module: prefix at a module boundary, regex, or suffix.
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{p}){boundary}", name) or name.endswith(p) for p in patterns)


def _stack_text(tc: Any) -> Stack:
    h, heads = tc.hidden_size, tc.num_attention_heads
    hd = getattr(tc, "head_dim", None) or h // heads
    kv = getattr(tc, "num_key_value_heads", None) or heads
    return Stack(tc.num_hidden_layers, h, tc.intermediate_size, heads, kv * hd, heads * hd,
                 swiglu=True, rms_norm=True)


def _stack_vision(vc: Any, model_type: str) -> Stack:
    h = getattr(vc, "embed_dim", None) or vc.hidden_size  # Qwen2-VL: hidden_size is the merger's output width
    inter = getattr(vc, "intermediate_size", None) or int(h * getattr(vc, "mlp_ratio", 4))
    layers = getattr(vc, "num_hidden_layers", None) or vc.depth
    heads = getattr(vc, "num_attention_heads", None) or vc.num_heads
    swiglu = model_type == "qwen2_5_vl"
    return Stack(layers, h, inter, heads, h, h, swiglu=swiglu, rms_norm=swiglu)


def _family_of(model_type: str) -> str | None:
    from pipeline.model.families import family_of_model_type

    return family_of_model_type(model_type)


def analyze(model_config: Any, *, local_only: bool = False) -> ModelShape:
    """Read a model's structure from its config: builds it on the meta device, allocates no weights."""
    import torch

    config = load_model_config(model_config, local_only=local_only)
    model = _meta_model(config)
    linears, others = [], []
    # A Linear whose weight is tied to another parameter (Gemma 3's lm_head is its embedding) stores nothing more.
    owned = {n for n, _ in model.named_parameters()}
    for name, mod in model.named_modules():
        if type(mod) is torch.nn.Linear and f"{name}.weight" in owned:
            linears.append(Linear(name, mod.in_features, mod.out_features, mod.bias is not None))
    linear_params = {f"{lin.name}.{p}" for lin in linears for p in ("weight", "bias")}
    for name, p in model.named_parameters():
        if name not in linear_params:
            others.append((name, p.numel()))
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    vc = getattr(config, "vision_config", None)
    return ModelShape(
        model_type=config.model_type,
        linears=tuple(linears),
        other_params=sum(n for _, n in others),
        other_param_names=tuple(others),
        buffer_bytes=buffers,
        skip_quant=tuple(_skip_patterns(model)),
        text=_stack_text(config.get_text_config()),
        vision=None if vc is None else _stack_vision(vc, config.model_type),
        vocab=config.get_text_config().vocab_size,
        family=_family_of(config.model_type),
        vision_cfg={} if vc is None else {
            # InternVL writes sizes as [height, width]: the planner works with square images.
            k: (v[0] if isinstance(v, (list, tuple)) else v)
            for k in ("image_size", "patch_size", "spatial_merge_size") if (v := getattr(vc, k, None)) is not None
        } | {k: getattr(config, k) for k in ("scale_factor", "mm_tokens_per_image", "image_grid_pinpoints",
                                             "downsample_ratio", "vision_aspect_ratio") if hasattr(config, k)},
    )


# ------------------------------------------------------------------------------------------------ image tokens
def image_token_counts(shape: ModelShape, image_size: int) -> tuple[int, int]:
    """(tokens in the text sequence, patches through the vision encoder) for one square image of `image_size` px:
    the family's geometry (`Family.planned_image_tokens`), the merged-patch grid for a model without one."""
    from pipeline.model.families import Family, get_family

    if shape.vision is None or image_size <= 0:
        return 0, 0
    family = get_family(shape.family) if shape.family else Family()
    return family.planned_image_tokens(shape.vision_cfg, image_size)


# ------------------------------------------------------------------------------------------------ LoRA targets
def lora_targets(shape: ModelShape, target_modules: Sequence[str] | str | None,
                 train: str = "language") -> list[Linear]:
    """The Linear layers PEFT wraps, as pipeline.model.loading configures it: a regex (fullmatch), or names that match
    anywhere (the vision encoder too), or None for the family's default for `train` (model.train)."""
    if target_modules is None and shape.family is not None:
        from pipeline.model.families import get_family

        target_modules = get_family(shape.family).lora_target(train=train, linears=[lin.name for lin in shape.linears])
    if isinstance(target_modules, str):
        pattern = re.compile(target_modules)
        return [lin for lin in shape.linears if pattern.fullmatch(lin.name)]
    names = list(target_modules or ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    return [lin for lin in shape.linears if any(lin.name == n or lin.name.endswith(f".{n}") for n in names)]


OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw", "paged_adamw_8bit")
MIN_8BIT_SIZE = 4096   # bitsandbytes keeps fp32 state for tensors with fewer values
STATE_BLOCK = 256      # its block-wise 8-bit state: one fp32 absmax per 256 values


def optimizer_state_bytes(optimizer: str, tensors: Sequence[int], value_bytes: int) -> int:
    """Adam's two moments for trained tensors of these sizes: torch's AdamW keeps them in the parameters' dtype
    (`value_bytes`); bitsandbytes' 32-bit (paged) ones in fp32; its 8-bit ones in uint8 plus one fp32 absmax per
    256 values each, and its two shared 256-entry quantization maps (fp32 state under 4,096 values)."""
    if optimizer == "adamw":
        return sum(2 * n * value_bytes for n in tensors)
    if optimizer == "paged_adamw":
        return sum(8 * n for n in tensors)
    total = 2 * 256 * 4
    for n in tensors:
        total += 2 * (n + 4 * math.ceil(n / STATE_BLOCK)) if n >= MIN_8BIT_SIZE else 8 * n
    return total


def optimizer_step_bytes(optimizer: str, tensors: Sequence[int], value_bytes: int, device: str) -> int:
    """Transient memory of one optimizer step, from the update's code.

    torch AdamW: on the CPU one tensor at a time, `(exp_avg_sq.sqrt() / c).add_(eps)` holds two temporaries of the
    largest tensor; on CUDA the foreach path takes the square root of every state at once (one copy of all of
    them). bitsandbytes on CUDA: fused kernels, no temporaries. bitsandbytes on the CPU: one tensor at a time, both
    moments dequantized to fp32 (8-bit) plus the scaled gradient and the two denominator temporaries, all fp32."""
    if not tensors:
        return 0
    big = max(tensors)
    if optimizer == "adamw":
        return 2 * big * value_bytes if device == "cpu" else sum(tensors) * value_bytes
    if device == "cuda":
        return 0
    if optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        return (2 + 1 + 2) * 4 * big
    return (1 + 2) * 4 * big


def _is_vision(name: str) -> bool:
    return any(f"{p}." in f"{name}." for p in VISION_PREFIXES)


# ------------------------------------------------------------------------------------------------ the terms
def _weights(shape: ModelShape, mode: Mode, p: int, skip: Sequence[str], double_quant: bool) -> dict[str, int]:
    if mode != "qlora":
        bias = sum(lin.out_features for lin in shape.linears if lin.bias)
        return {"weights": (shape.other_params + bias + sum(lin.numel for lin in shape.linears)) * p
                + shape.buffer_bytes}
    packed = consts = kept = 0
    for lin in shape.linears:
        kept += lin.out_features * 4 if lin.bias else 0
        if not _quantized(lin.name, skip):
            kept += lin.numel * 4
            continue
        packed += (lin.numel + 1) // 2
        blocks = math.ceil(lin.numel / NF4_BLOCK)
        if double_quant:
            # uint8 absmax per block, fp32 absmax + the 256-entry fp32 code of the second level, one fp32 offset
            consts += blocks + 4 * math.ceil(blocks / DQ_BLOCK) + 256 * 4 + 4
        else:
            consts += 4 * blocks
        consts += 16 * 4  # the NF4 code table
    return {"weights_nf4": packed, "weights_nf4_constants": consts,
            "weights_other": (shape.other_params * 4 + kept) + shape.buffer_bytes}


def _layer_bytes(s: Stack, p: int, *, trained: bool, full: bool, attention: str, seq: int) -> float:
    """Bytes autograd keeps per token in one layer of `s` while gradients flow through it."""
    if not trained:
        return 0.0
    h, i = s.hidden, s.intermediate
    norms = 2 * (4 * h if s.rms_norm else p * h)         # RMSNorm keeps its fp32 upcast; LayerNorm its input
    attn = p * (2 * s.q_dim + 2 * s.kv_dim) + 4 * s.heads  # q, k, v, out, logsumexp
    if attention == "eager":
        attn += p * s.heads * seq                         # the softmax probabilities
    mlp = p * (3 * i if s.swiglu else 2 * i)              # SwiGLU: gate, act, up; GELU: input, output
    total = norms + attn + mlp
    if full:  # weight gradients need every Linear's input: the normed hiddens, the attention output, down's input
        total += p * (2 * h + s.q_dim + (i if s.swiglu else 0))
    return total


def _working_set(s: Stack, p: int, tokens: int, per_image: int, attention: str) -> float:
    # One layer's live tensors in a forward pass without saved state (frozen tower, or checkpoint recompute slack).
    work = tokens * p * (4 * s.hidden + 2 * s.intermediate)
    if attention == "eager":
        work += p * s.heads * per_image * tokens
    return work


@dataclass(frozen=True)
class _Tokens:
    """One micro-batch's tokens: per sample (text + image tokens in the language model, patches in the vision tower)
    and in all (× batch)."""
    seq: int
    per_image: int
    text: int
    vision: int


@dataclass(frozen=True)
class _Trained:
    """What a step trains: the adapted Linears (none in full training), the size of each trained tensor, their
    total and the bytes of one trained value."""
    adapted: list[Linear]
    tensors: list[int]
    params: int
    value_bytes: int


def _check_plan_args(mode: str, precision: str, batch: int, seq_len: int, optimizer: str) -> None:
    if mode not in MODES:
        raise ModelError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if precision not in DTYPE_BYTES:
        raise ModelError(f"precision {precision!r} is not one of {', '.join(DTYPE_BYTES)}")
    if batch < 1 or seq_len < 1:
        raise ModelError(f"batch ({batch}) and seq_len ({seq_len}) must be ≥ 1")
    if optimizer not in OPTIMIZERS:
        raise ModelError(f"optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")


def _trained(shape: ModelShape, mode: Mode, wp: int, lora_r: int, target_modules: Sequence[str] | str | None,
             train: str) -> _Trained:
    if mode == "full":
        tensors = [lin.numel for lin in shape.linears] + [lin.out_features for lin in shape.linears if lin.bias] + [
            n for _, n in shape.other_param_names]
        return _Trained([], tensors, shape.params, wp)  # trained in the weights' dtype
    adapted = lora_targets(shape, target_modules, train)
    tensors = [n for lin in adapted for n in (lora_r * lin.in_features, lora_r * lin.out_features)]
    return _Trained(adapted, tensors, sum(tensors), 4)  # PEFT keeps adapters in fp32


def _trained_terms(tr: _Trained, full: bool) -> dict[str, int]:
    """The trained values and their gradients (the weights themselves are `_weights`' in full training)."""
    if full:
        return {"gradients": tr.params * tr.value_bytes}
    return {"lora_params": tr.params * 4, "gradients": tr.params * 4}


def _optimizer_term(optimizer: str, tr: _Trained, device: str) -> tuple[str, int]:
    """("optimizer", bytes) on the device, or ("optimizer_paged", bytes) in host memory."""
    state = optimizer_state_bytes(optimizer, tr.tensors, tr.value_bytes)
    if optimizer.startswith("paged") and device == "cuda":
        # CUDA unified memory: the driver moves it to host memory when the device runs short, so it never
        # makes a step run out of memory (and torch's allocator does not count it).
        return "optimizer_paged", state
    return "optimizer", state


def _lora_input_bytes(adapted: Sequence[Linear], lora_r: int, lora_dropout: float, p: int,
                      device: str) -> tuple[float, float]:
    """Per-token bytes the adapters save, (language model, vision tower)."""
    # Adapters are fp32 and PEFT casts their input up: each adapted Linear keeps an fp32 copy of its input (dropped
    # out, with a mask: float on CPU, bool on CUDA), unless dropout is off and the input is already fp32 and kept.
    mask = 4 if device == "cpu" else 1
    lora_tok = lora_vtok = 0.0
    for lin in adapted:
        if lora_dropout > 0:
            extra = lin.in_features * (4 + mask)
        elif p < 4 or lin.name.rsplit(".", 1)[-1] in _UNSHARED_INPUTS:
            extra = lin.in_features * 4
        else:
            extra = 0
        extra += lora_r * 4
        if _is_vision(lin.name):
            lora_vtok += extra
        else:
            lora_tok += extra
    return lora_tok, lora_vtok


def _activations(shape: ModelShape, tr: _Trained, tok: _Tokens, *, mode: Mode, p: int, attention: str,
                 lora_r: int, lora_dropout: float, checkpointing: bool, offload: bool,
                 device: str) -> tuple[int, int]:
    """(activation bytes on the device, bytes offloaded to pinned host memory)."""
    full = mode == "full"
    vision_trained = full or any(_is_vision(lin.name) for lin in tr.adapted)
    text_trained = full or any(not _is_vision(lin.name) for lin in tr.adapted)
    text, vision = shape.text, shape.vision
    per_text = _layer_bytes(text, p, trained=text_trained, full=full, attention=attention, seq=tok.seq)
    per_vis = 0.0 if vision is None else _layer_bytes(
        vision, p, trained=vision_trained, full=full, attention=attention, seq=tok.per_image)
    lora_tok, lora_vtok = _lora_input_bytes(tr.adapted, lora_r, lora_dropout, p, device)
    # The largest single layer's activations, language model or vision tower.
    layer = max(tok.text * (per_text + lora_tok / max(text.layers, 1)),
                tok.vision * (per_vis + lora_vtok / max(vision.layers if vision else 1, 1)))

    # k-bit preparation upcasts the embeddings, so a qlora model's residual stream is fp32.
    rp = 4 if mode == "qlora" else p
    if checkpointing:
        # Only each layer's input survives the forward; backward recomputes one layer at a time.
        kept = (tok.text * text.hidden * rp * text.layers if text_trained else 0) + (
            tok.vision * vision.hidden * p * vision.layers if vision_trained and vision else 0)
        acts = kept + 2 * layer  # the recomputed layer's activations and their gradients
    else:
        acts = tok.text * (per_text * text.layers + lora_tok) + (
            tok.vision * (per_vis * vision.layers + lora_vtok) if vision else 0)
    # The residual stream entering the model and the image features; a frozen tower's forward working set.
    acts += tok.text * text.hidden * rp * 2
    if vision is not None and not vision_trained:
        acts += _working_set(vision, p, tok.vision, tok.per_image, attention)
    if not (offload and device == "cuda"):
        return int(acts), 0
    # The tensors autograd saves outside checkpointed layers go to pinned host memory; two layers' worth stay
    # on the device (the one being computed or differentiated, and the next one in transfer).
    kept_on_device = acts if checkpointing else 2 * layer + tok.text * text.hidden * rp * 2
    return int(min(acts, kept_on_device)), int(max(0.0, acts - kept_on_device))


def _logits_bytes(shape: ModelShape, tokens: int, liger: bool) -> int:
    if liger:
        # Liger's fused linear cross-entropy never holds all the logits: it computes them in chunks of
        # 2^ceil(log2(tokens / ceil(vocab / hidden))) rows (fp32 logits and their gradient) and the hidden
        # states' gradient (fp32) in the forward pass.
        rows = 2 ** math.ceil(math.log2(max(1, math.ceil(tokens / math.ceil(shape.vocab / shape.text.hidden)))))
        return int(min(rows, tokens) * shape.vocab * 4 * 2 + tokens * shape.text.hidden * 4)
    # Logits in compute dtype, their fp32 upcast for the loss, log-softmax output, and the gradient.
    return int(tokens * shape.vocab * 16)


def _peak(terms: dict[str, int], optimizer: str, tr: _Trained, device: str) -> tuple[dict[str, int], str]:
    """The terms of the step's peak and its phase: the end of backward, or the optimizer step."""
    # The optimizer step runs after backward, when activations and logits are gone, with transients of its own.
    step_terms = {k: v for k, v in terms.items() if k not in ("activations", "logits", "dequant_buffer")}
    step_terms["runtime"] = RUNTIME_BYTES[device]
    step_terms["optimizer_step"] = optimizer_step_bytes(optimizer, tr.tensors, tr.value_bytes, device)
    if sum(step_terms.values()) > sum(terms.values()):
        return step_terms, "optimizer step"
    return terms, "backward"


def plan(model_config: Any, inputs: PlanInputs = PlanInputs()) -> Plan:
    """Estimated peak memory of one training step (forward, backward, optimizer step), term by term.

    `model_config` is anything `load_model_config` reads, or a `ModelShape` from `analyze` (faster when planning
    many configurations). The image tokens of one `inputs.image_size` px image are added to each sample's text.

    With `inputs.processes` > 1 (data-parallel, pipeline.model.distributed) the plan is one device's: each holds the
    whole model and its own micro-batch, plus the flat buffer its gradients are summed across devices in.
    """
    i, device = inputs, inputs.device
    shape = model_config if isinstance(model_config, ModelShape) else analyze(model_config)
    p = DTYPE_BYTES[i.precision]
    image_size = i.image_size if i.image_size is not None else int(shape.vision_cfg.get("image_size", 0) or 448)
    img_tokens, vis_tokens = image_token_counts(shape, image_size)
    tok = _Tokens(i.seq_len + img_tokens, vis_tokens, i.batch * (i.seq_len + img_tokens), i.batch * vis_tokens)
    full = i.mode == "full"
    offload, liger = i.activation_offload and device == "cuda", i.liger and device == "cuda"

    skip = list(shape.skip_quant) + list(i.skip_modules or ())
    # fp16 weights cannot be trained under a grad scaler, so full fp16 training keeps fp32 weights (as loading does).
    wp = 4 if full and i.precision == "fp16" else p
    tr = _trained(shape, i.mode, wp, i.lora_r, i.target_modules, i.train)
    terms = _weights(shape, i.mode, wp, skip, i.double_quant) | _trained_terms(tr, full)
    host: dict[str, int] = {}
    where, state = _optimizer_term(i.optimizer, tr, device)
    (host if where == "optimizer_paged" else terms)[where] = state
    terms["activations"], offloaded = _activations(
        shape, tr, tok, mode=i.mode, p=p, attention=i.attention, lora_r=i.lora_r, lora_dropout=i.lora_dropout,
        checkpointing=i.checkpointing, offload=offload, device=device)
    if offload:
        host["activations_offloaded"] = offloaded
    terms["logits"] = _logits_bytes(shape, tok.text, liger)
    if i.mode == "qlora":  # backward dequantizes one weight at a time
        terms["dequant_buffer"] = max((lin.numel for lin in shape.linears if _quantized(lin.name, skip)), default=0) * p
    if i.processes > 1:  # the gradients are copied into one buffer for the all-reduce, next to their originals
        terms["gradient_allreduce"] = terms["gradients"]
    terms["runtime"] = RUNTIME_BYTES[device] + int(FRAGMENTATION * (terms["activations"] + terms["logits"]))
    terms, phase = _peak(terms, i.optimizer, tr, device)
    return Plan(mode=i.mode, batch=i.batch, seq_len=i.seq_len, image_size=image_size, image_tokens=img_tokens,
                vision_tokens=vis_tokens, checkpointing=i.checkpointing, precision=i.precision, device=device,
                terms=terms, gpu_memory_bytes=i.gpu_memory_bytes, margin=i.margin, trainable_params=tr.params,
                total_params=shape.params, processes=i.processes, optimizer=i.optimizer, activation_offload=offload,
                phase=phase, host_terms=host, liger=liger)


def plan_grid(model_config: Any, inputs: PlanInputs = PlanInputs(), *, modes: Iterable[Mode] = MODES,
              batches: Iterable[int] = (1, 2, 4, 8, 16), checkpointing: Iterable[bool] = (False, True)) -> list[Plan]:
    """Plans of `inputs` for every mode × checkpointing × micro-batch, the model analyzed once."""
    shape = model_config if isinstance(model_config, ModelShape) else analyze(model_config)
    return [plan(shape, replace(inputs, mode=m, batch=b, checkpointing=c))
            for m in modes for c in checkpointing for b in batches]


# ------------------------------------------------------------------------------------------------ tables
def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def terms_table(*plans: Plan) -> Any:
    """Plans side by side, term by term (rich Table): e.g. one mode and batch with checkpointing off and on."""
    from rich.table import Table

    first = plans[0]
    per = f", per device of {first.processes}" if first.processes > 1 else ""
    t = Table(title=f"{first.mode}, micro-batch {first.batch}, {first.seq_len} text + {first.image_tokens} image "
                    f"tokens ({first.image_size} px), {first.precision}, peak GiB{per}")
    t.add_column("term")
    for p in plans:
        t.add_column(f"{p.mode} b{p.batch} ckpt {'on' if p.checkpointing else 'off'}", justify="right")
    for k in dict.fromkeys(k for p in plans for k in p.terms):
        t.add_row(k, *(_gib(p.terms.get(k, 0)) for p in plans))
    t.add_row("[bold]total[/]", *(f"[bold]{_gib(p.total)}[/]" for p in plans))
    if first.budget is not None:
        t.add_row(f"budget: {first.margin:.0%} of {_gib(first.gpu_memory_bytes or 0)}", *(_gib(first.budget) for _ in plans))
        t.add_row("fits", *("[green]yes[/]" if p.fits else "[red]no[/]" for p in plans))
    return t


def plan_table(model_config: Any, inputs: PlanInputs = PlanInputs(), *,
               batches: Iterable[int] = (1, 2, 4, 8, 16)) -> Any:
    """Which configurations of `inputs` fit (rich Table): mode × checkpointing × micro-batch, with the main terms."""
    from rich.table import Table

    plans = plan_grid(model_config, inputs, batches=batches)
    n = inputs.processes
    t = Table(title="Peak training memory (GiB)" + (f" per device, {n} data-parallel processes" if n > 1 else ""))
    for col in ("mode", "ckpt", "batch", "weights", "trainable+opt", "activations", "logits", "total", "fits"):
        t.add_column(col, justify="right" if col not in ("mode", "ckpt", "fits") else "left")
    for p in plans:
        train = p.terms.get("lora_params", 0) + p.terms["gradients"] + p.terms.get("optimizer", 0)
        fits = {None: "-", True: "[green]yes[/]", False: "[red]no[/]"}[p.fits]
        t.add_row(p.mode, "on" if p.checkpointing else "off", str(p.batch), _gib(p.weights), _gib(train),
                  _gib(p.terms.get("activations", 0)), _gib(p.terms.get("logits", 0)),
                  _gib(p.total) + ("*" if p.phase != "backward" else ""), fits)
    if any(p.phase != "backward" for p in plans):
        t.caption = "* the optimizer step peaks (its temporaries outweigh the backward pass's activations)"
    return t


def largest_fitting_batch(shape: ModelShape, budget_candidates: Sequence[int],
                          inputs: PlanInputs = PlanInputs()) -> tuple[int, Plan] | None:
    """The largest micro-batch among `budget_candidates` whose plan of `inputs` fits, with its plan; None when none
    fits."""
    for b in sorted(budget_candidates, reverse=True):
        p = plan(shape, replace(inputs, batch=b))
        if p.fits:
            return b, p
    return None


__all__ = ["Linear", "ModelShape", "Plan", "PlanInputs", "Stack", "analyze", "image_token_counts", "largest_fitting_batch",
           "load_model_config", "lora_targets", "plan", "plan_grid", "plan_table", "terms_table"]
