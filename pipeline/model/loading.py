"""Load a VLM for training or inference: qlora (4-bit NF4 + LoRA), lora (LoRA on a 16/32-bit model) or full.

Pure builders turn the config into `BitsAndBytesConfig` / `LoraConfig` (TRL's pattern) so they can be tested and
reused without loading anything; `load_model` is the one place that touches weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.config import ModelConfig
from pipeline.errors import ModelError
from pipeline.model.families import Family, detect_family, get_family

log = logging.getLogger(__name__)
MiB = 1 << 20
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Loaded:
    model: Any
    processor: Any
    family: Family
    info: dict[str, Any] = field(default_factory=dict)


def _hardware(hw: Any) -> Any:
    if hw is not None:
        return hw
    from pipeline.model.hardware import detect_hardware

    return detect_hardware()


def resolve_compute_dtype(model_cfg: ModelConfig, hw: Any = None) -> torch.dtype:
    """auto → bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPU (bf16 matmuls crawl on CPUs)."""
    hw = _hardware(hw)
    if model_cfg.compute_dtype != "auto":
        dtype = DTYPES[model_cfg.compute_dtype]
        if hw.device != "cuda" and dtype != torch.float32:
            log.warning("model.compute_dtype=%s on the CPU is much slower than float32", model_cfg.compute_dtype)
        return dtype
    if hw.device != "cuda":
        return torch.float32
    return torch.bfloat16 if hw.bf16_supported else torch.float16


def _flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def pick_attn_implementation(model_cfg: ModelConfig, dtype: torch.dtype | None = None) -> str:
    """flash_attention_2 when flash_attn imports and CUDA is present (16-bit only), else sdpa, else eager."""
    wanted = model_cfg.attn_implementation
    sixteen_bit = dtype in (None, torch.bfloat16, torch.float16)
    if wanted == "flash_attention_2" and not (_flash_attn_available() and sixteen_bit):
        raise ModelError("model.attn_implementation=flash_attention_2 needs the flash_attn package, a CUDA GPU and "
                         f"16-bit compute (compute dtype is {dtype}); install tamis[flash] or set it to auto")
    if wanted != "auto":
        choice, why = wanted, "set in model.attn_implementation"
    elif _flash_attn_available() and sixteen_bit:
        choice, why = "flash_attention_2", "flash_attn imports and CUDA is present"
    elif hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        choice, why = "sdpa", "flash_attn unavailable" if not _flash_attn_available() else "fp32 compute"
    else:
        choice, why = "eager", "no fused attention in this torch"
    log.info("attention: %s (%s)", choice, why)
    return choice


def build_bnb_config(model_cfg: ModelConfig, hw: Any = None) -> Any:
    """4-bit NF4 with double quantization for qlora; None for the other modes."""
    if model_cfg.mode != "qlora":
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=resolve_compute_dtype(model_cfg, hw),
    )


def linear_names(model: torch.nn.Module) -> list[str]:
    """Names of the model's Linear modules (bitsandbytes' 4-bit and 8-bit Linears subclass nn.Linear)."""
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def build_lora_config(model_cfg: ModelConfig, family: Family, linears: Any = None) -> Any:
    """LoRA from the config. Default targets: the family's projections inside the language model, plus the
    projector's and the vision tower's Linears as `model.train` asks; an explicit `model.target_modules` list is
    passed to PEFT as given (names match anywhere, the vision encoder too)."""
    from peft import LoraConfig

    targets: Any = (list(model_cfg.target_modules) if model_cfg.target_modules
                    else family.lora_target(train=model_cfg.train, linears=linears))
    return LoraConfig(
        r=model_cfg.lora_r,
        lora_alpha=model_cfg.lora_alpha,
        lora_dropout=model_cfg.lora_dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters; a 4-bit weight stores two values per byte, so it counts double."""
    trainable = total = 0
    for p in model.parameters():
        n = p.numel()
        if type(p).__name__ == "Params4bit":
            n *= 2 * getattr(p, "quant_storage", torch.uint8).itemsize
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def _resolve_source(model_cfg: ModelConfig) -> tuple[str, bool]:
    """(what to pass to from_pretrained, whether it is a local folder); builds the tiny model when asked."""
    name = model_cfg.name_or_path
    path = Path(name)
    local = path.is_absolute() or path.exists()
    if local and not path.exists():
        if not model_cfg.build_tiny_if_missing:
            raise ModelError(f"{path}: model folder does not exist; build one with `tamis make-tiny-model --family "
                             f"{model_cfg.family or 'idefics3'} --out {path}`, set model.build_tiny_if_missing: true, "
                             "or point model.name_or_path at a checkpoint")
        if model_cfg.family is None:
            raise ModelError(f"{path}: missing, and model.build_tiny_if_missing needs model.family to know which "
                             "tiny model to build; set model.family")
        from pipeline.model.tiny import make_tiny_model

        log.info("%s is missing: building a tiny random-weight %s model there", path, model_cfg.family)
        make_tiny_model(model_cfg.family, path)
    return str(path) if local else name, local


def resolve_family(model_cfg: ModelConfig, source: str | None = None) -> Family:
    """The configured family, checked against the checkpoint's config when that can be read."""
    source = source or model_cfg.name_or_path
    if model_cfg.family == "auto":
        from pipeline.model.generic import resolve_auto

        return resolve_auto(source, end_token=model_cfg.end_token)
    detected = None
    if model_cfg.family is None or Path(source, "config.json").is_file():
        detected = detect_family(source)
    if model_cfg.family is not None and detected is not None and detected != model_cfg.family:
        raise ModelError(f"model.family is {model_cfg.family!r} but {source} is a {detected!r} checkpoint; "
                         f"set model.family: {detected} (or remove it to detect it)")
    return get_family(model_cfg.family or detected)


def apply_liger(model: Any) -> str:
    """Patch a loaded model's RMSNorm, RoPE, SwiGLU and loss with Liger's kernels, by its model_type (smolvlm,
    qwen2_vl, qwen2_5_vl, ... as liger_kernel maps them); returns the patch's name."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = model.config.model_type
    # SmolVLM v1 checkpoints are idefics3 configs; Liger's smolvlm patch covers the same classes.
    fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type) or MODEL_TYPE_TO_APPLY_LIGER_FN.get(
        {"idefics3": "smolvlm"}.get(model_type, ""))
    if fn is None:
        raise ModelError(f"model.liger: liger_kernel has no patch for model_type {model_type!r}; set model.liger: "
                         "false")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    fn(model=base)
    return fn.__name__


def release_checkpoint_map(model: torch.nn.Module) -> int:
    """Copy the CPU parameters and buffers that still point into the memory-mapped checkpoint into memory of their
    own; returns the bytes copied.

    A 4-bit load reads every quantized weight through safetensors' memory map, and the map stays open as long as any
    unquantized tensor (embeddings, norms) is a view of it: the pages of the already-quantized fp32 weights then stay
    resident, ~0.75 GB of RSS on the SmolVLM-256M shape for nothing. Owning copies let the map close."""
    copied, done = 0, set()
    with torch.no_grad():
        for mod in model.modules():
            for _name, p in list(mod.named_parameters(recurse=False)):
                # A tied weight is one Parameter in two modules: copied once, and still tied.
                if p.device.type == "cpu" and type(p).__name__ != "Params4bit" and id(p) not in done:
                    done.add(id(p))
                    p.data = p.data.clone()
                    copied += p.numel() * p.element_size()
            for name, b in list(mod.named_buffers(recurse=False)):
                if b is not None and b.device.type == "cpu":
                    mod._buffers[name] = b.clone()
    return copied


def _weights_dtype(mode: str, compute: torch.dtype) -> torch.dtype:
    # Full training keeps fp32 master weights unless bf16 (fp16 weights cannot be trained with a grad scaler).
    if mode == "full" and compute == torch.float16:
        return torch.float32
    return compute


def load_model(
    model_cfg: ModelConfig,
    *,
    adapter: str | Path | None = None,
    trainable: bool = False,
    hw: Any = None,
) -> Loaded:
    """Load model + processor for `model_cfg.mode`; attach `adapter` (a PEFT folder) when given.

    In full mode `adapter` is the folder a full training run saved (the whole model), loaded instead of the base.

    trainable=True prepares the model for training: qlora gets `prepare_model_for_kbit_training` and a fresh LoRA
    (unless an adapter is given, which is then loaded trainable), lora a fresh LoRA, full unfreezes every weight.
    The model is returned in eval() mode either way; the training loop switches it to train().
    """
    hw = _hardware(hw)
    source, local, adapter = _base_source(model_cfg, adapter)
    family = resolve_family(model_cfg, source)
    compute = resolve_compute_dtype(model_cfg, hw)
    dtype = _weights_dtype(model_cfg.mode, compute)
    attn = pick_attn_implementation(model_cfg, compute)
    bnb = build_bnb_config(model_cfg, hw)
    model, processor = _from_pretrained(source, local, hw, dtype=dtype, attn=attn, bnb=bnb)
    if bnb is not None:
        release_checkpoint_map(model)
    model = _for_use(model, model_cfg, family, adapter, trainable)
    from pipeline.model.hardware import resolve_liger

    liger, liger_why = resolve_liger(model_cfg, hw) if trainable else (False, "inference")
    liger_patch = apply_liger(model) if liger else None
    model.eval()

    n_train, n_total = count_parameters(model)
    info = {
        "family": family.name,
        "mode": model_cfg.mode,
        "source": source,
        "adapter": str(adapter) if adapter is not None else None,
        "device": hw.device,
        "compute_dtype": str(compute).removeprefix("torch."),
        "weights_dtype": str(dtype).removeprefix("torch."),
        "quantized": bnb is not None,
        "attn_implementation": attn,
        "liger": {"applied": liger_patch is not None, "patch": liger_patch, "reason": liger_why},
        "train": model_cfg.train if model_cfg.mode != "full" else "all (full)",
        "trainable_params": n_train,
        "total_params": n_total,
        "trainable_percent": round(100 * n_train / max(n_total, 1), 4),
        "memory_footprint_mb": round(model.get_memory_footprint() / MiB, 2),
    }
    log.info("loaded %s (%s, %s): trainable params %d of %d (%.3f%%), footprint %.1f MB", source, family.name,
             model_cfg.mode, n_train, n_total, info["trainable_percent"], info["memory_footprint_mb"])
    return Loaded(model=model, processor=processor, family=family, info=info)


def _base_source(model_cfg: ModelConfig, adapter: str | Path | None) -> tuple[str, bool, str | Path | None]:
    """(what to load the base from, whether it is a local folder, the adapter still to attach)."""
    source, local = _resolve_source(model_cfg)
    if adapter is not None and model_cfg.mode == "full":
        # Full training saves the whole model where the adapter would go: load it in place of the base.
        if not Path(adapter, "config.json").is_file():
            raise ModelError(f"{adapter}: model.mode is full, so this must be a saved model folder (config.json); "
                             "it is not")
        return str(adapter), True, None
    return source, local, adapter


def _from_pretrained(source: str, local: bool, hw: Any, *, dtype: torch.dtype, attn: str,
                     bnb: Any) -> tuple[Any, Any]:
    """(model, processor) as transformers loads them: in `dtype`, 4-bit with `bnb`, on the GPU when there is one."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": attn}
    if bnb is not None:
        kwargs["quantization_config"] = bnb
    if hw.device == "cuda":
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    try:
        return AutoModelForImageTextToText.from_pretrained(source, **kwargs), AutoProcessor.from_pretrained(source)
    except OSError as exc:
        where = "the folder" if local else "the hub (offline machines need a local folder)"
        raise ModelError(f"{source}: cannot load the model from {where}: {exc}") from None


def _for_use(model: Any, model_cfg: ModelConfig, family: Any, adapter: str | Path | None, trainable: bool) -> Any:
    """The loaded base made ready: k-bit preparation for training, the adapter (given or fresh), gradients on the
    trained weights only."""
    if trainable and model_cfg.mode == "qlora":
        from peft import prepare_model_for_kbit_training

        # Gradient checkpointing is the training loop's call (per the chosen settings), not the loader's.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if adapter is not None:
        from peft import PeftModel

        adapter = Path(adapter)
        if not (adapter / "adapter_config.json").is_file():
            raise ModelError(f"{adapter}: not a LoRA adapter folder (no adapter_config.json); point at a round's "
                             "train/adapter folder")
        model = PeftModel.from_pretrained(model, str(adapter), is_trainable=trainable)
    elif trainable and model_cfg.mode in ("qlora", "lora"):
        from peft import get_peft_model

        model = get_peft_model(model, build_lora_config(model_cfg, family, linear_names(model)))
    elif trainable:
        model.requires_grad_(True)
    if not trainable:
        # Inference (scoring, evaluation) needs no gradients; frozen weights keep autograd out of the way.
        model.requires_grad_(False)
    return model
