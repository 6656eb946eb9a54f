"""The export's files besides the card and lineage: the adapter with tamis's processor, the merged checkpoint, the
standalone predict.py, the serving hand-offs (vLLM, GGUF), and the folder check before any of them is written."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config import ModelConfig
from pipeline.errors import ConfigError, ModelError
from pipeline.export_model.provenance import Provenance
from pipeline.export_model.spec import ExportSpec

if TYPE_CHECKING:
    from pipeline.serving.gguf import GgufExport
    from pipeline.serving.vllm import VllmExport

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def load_processor(model_cfg: ModelConfig) -> Any:
    """The base model's processor and family (a Loaded without weights: the card and the export need no model)."""
    from transformers import AutoProcessor

    from pipeline.model.loading import Loaded, resolve_family

    try:
        processor = AutoProcessor.from_pretrained(model_cfg.name_or_path)
    except OSError as exc:
        raise ModelError(f"{model_cfg.name_or_path}: cannot load the processor ({exc}); model.name_or_path must "
                         "name the base model the adapter was trained on") from None
    return Loaded(model=None, processor=processor, family=resolve_family(model_cfg))


def processor_for_export(loaded: Any, image_size: int) -> Any:
    """The processor with tamis's image settings as its defaults (the processor_kwargs every tamis call passes for
    prepared images of `image_size`) and the chat template tamis rendered prompts with, so a plain call reproduces
    tamis's inputs."""
    processor, family = loaded.processor, loaded.family
    kwargs = family.processor_kwargs(image_size, tile=family.tile_size(processor))
    for name, value in kwargs.items():
        setattr(processor.image_processor, name, value)
    if not getattr(processor, "chat_template", None):
        processor.chat_template = family.chat_template
    return processor


def write_adapter(adapter_dir: Path, out: Path, *, base: str, processor: Any) -> dict[str, Any]:
    """DIR/adapter: the adapter's weights, its config pointing at `base`, the processor; returns the config."""
    from pipeline.store import atomic_dir

    with atomic_dir(out) as tmp:
        for name in ADAPTER_FILES:
            if (adapter_dir / name).is_file():
                shutil.copyfile(adapter_dir / name, tmp / name)
        cfg = json.loads((tmp / "adapter_config.json").read_text(encoding="utf-8"))
        cfg["base_model_name_or_path"] = base
        (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        processor.save_pretrained(tmp)
    return cfg


def merge_adapter(model_cfg: ModelConfig, adapter_dir: Path, out: Path, *, processor: Any, dtype: Any) -> None:
    """DIR/merged: the base loaded as tamis loads it (4-bit NF4 for qlora), its 4-bit Linears dequantized to fp32
    (transformers' `dequantize`: the weights the adapter was trained against, not the original ones), the LoRA
    merged into them (peft's merge_and_unload), saved in `dtype`."""
    import torch
    from peft import PeftModel

    from pipeline.model.loading import load_model
    from pipeline.store import atomic_dir

    if model_cfg.mode == "full":
        from transformers import AutoModelForImageTextToText

        merged = AutoModelForImageTextToText.from_pretrained(str(adapter_dir), dtype=dtype)
    else:
        base = load_model(model_cfg).model
        if model_cfg.mode == "qlora":
            base = base.dequantize(dtype=torch.float32)
        merged = PeftModel.from_pretrained(base.float(), str(adapter_dir)).merge_and_unload()
        if getattr(merged, "hf_quantizer", None) is not None or getattr(merged.config, "quantization_config", None):
            raise ModelError("the merged model still carries a quantization config after dequantizing; refusing to "
                             "save a checkpoint plain transformers would load in 4-bit")
    merged = merged.to(dtype)
    with atomic_dir(out) as tmp:
        merged.save_pretrained(tmp)
        processor.save_pretrained(tmp)


def storage_dtype(choice: str, model_cfg: ModelConfig) -> Any:
    """The merged checkpoint's weights: `auto` is the dtype tamis computes in here (bf16 on GPUs that support it, fp32
    on CPUs, where bf16 matmuls crawl and where the round's answers were computed in fp32)."""
    from pipeline.model.loading import DTYPES, resolve_compute_dtype

    if choice == "auto":
        return resolve_compute_dtype(model_cfg)
    if choice not in DTYPES:
        raise ConfigError(f"--dtype {choice!r}: choose auto, {', '.join(DTYPES)}")
    return DTYPES[choice]


EXPORT_NAMES = ("adapter", "merged", "README.md", "lineage.json", "predict.py", "predict_config.json",
                "adapter-vllm", "serve.sh", "gguf", "lmstudio")
FORMATS = ("hf", "vllm", "gguf")  # what an export writes into its folder


def check_out(out: str | os.PathLike[str], artifacts: str | os.PathLike[str], *, force: bool,
              names: Sequence[str] = EXPORT_NAMES, command: str = "export-model") -> Path:
    """The export's folder, refused when writing there would destroy something: any folder in the project's
    artifacts (a round's train folder holds the adapter `predict` verifies), or one that already holds files,
    unless `force`. Like `git clone` and `tamis init`, it wants a new or empty folder; `force` replaces `names` (what
    `command` writes there) and never empties a folder it did not make."""
    out, art = Path(out), Path(artifacts).resolve()
    where = out.resolve()
    clash = where if where.is_relative_to(art) else next(
        (out / n for n in names if (where / n).resolve().is_relative_to(art)
         or art.is_relative_to((where / n).resolve())), None)
    if clash is not None:
        raise ConfigError(f"--out {out}: {clash} is in the project's artifacts folder {art} (or holds it), whose "
                          "files the rounds own (a round's adapter, which `predict` verifies); an export there would "
                          f"replace them, so it is refused even with --force. Export to a folder outside it, e.g. "
                          f"--out {art.parent / 'export'}")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: a file, not a folder; name a new or empty folder")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not force:
        shown = ", ".join(held[:6]) + (f" and {len(held) - 6} more" if len(held) > 6 else "")
        raise ConfigError(f"--out {out}: the folder is not empty ({len(held)} entries: {shown}); {command} "
                          f"writes {', '.join(names)} there. Name a new or empty folder, or pass --force to "
                          "replace those (anything else in the folder is kept)")
    return out


def write_predict_script(out: Path, *, loaded: Any, processor: Any, spec: ExportSpec, size: int,
                         images_per_sample: int = 1) -> None:
    """DIR/predict.py (tamis's standalone predictor, copied) and DIR/predict_config.json (what it asks and how);
    `images_per_sample` > 1 (samples of several images) is recorded, and predict.py then refuses with the fix: it
    asks about one image at a time."""
    from pipeline.serving.predict_config import CONFIG_NAME, SCRIPT, SCRIPT_NAME, predict_config
    from pipeline.store import atomic_write_json, atomic_write_text

    cfg = predict_config(loaded=loaded, processor=processor, data=spec.data, preprocess=spec.preprocess,
                         model=spec.model, select=spec.select, size=size)
    atomic_write_json(out / CONFIG_NAME, {**cfg, "images_per_sample": images_per_sample} if images_per_sample > 1
                      else cfg)
    atomic_write_text(out / SCRIPT_NAME, SCRIPT.read_text(encoding="utf-8"))


def serve_with_vllm(out: Path, prov: Provenance, loaded: Any, spec: ExportSpec, base: str) -> VllmExport:
    """--format vllm: serve.sh, and adapter-vllm/ when the adapter holds LoRA vLLM does not take (measured)."""
    from pipeline.serving.vllm import export_vllm

    return export_vllm(out, state=prov.state, family=loaded.family, model=spec.model, base=base,
                       answers=spec.data.answers, batch_size=spec.select.score_batch_size, artifacts=prov.artifacts)


def serve_with_gguf(out: Path, prov: Provenance, loaded: Any, processor: Any, question: str | None,
                    size: int) -> GgufExport:
    """--format gguf: merged/ converted by the pinned llama.cpp (pipeline/serving/gguf.py), its section in the card."""
    from pipeline.serving.gguf import card_section, export_gguf, gguf_name
    from pipeline.store import atomic_write_text

    res = export_gguf(out, out / "merged", loaded.family, name=gguf_name(loaded.family, prov.round),
                      processor=processor)
    for card in (out / "README.md", out / "adapter" / "README.md"):
        if card.is_file():
            atomic_write_text(card, card.read_text(encoding="utf-8") + card_section(res, question=question, size=size))
    return res
