"""`tamis export-model`: a round's model as a folder that stands on its own.

    DIR/adapter/       the PEFT adapter (base_model_name_or_path = the model the project names), the processor with
                       the image settings tamis used, and the chat template it trained with
    DIR/README.md      the model card (Hugging Face YAML header): base model, mode, LoRA settings, the rounds, labels
                       and annotators behind it, label-check verdicts, test metrics with intervals, prompt, loading
    DIR/lineage.json   the ledger entries (ids and digests) behind the adapter, the config digest, the train key
    DIR/merged/        with merge: base weights (4-bit ones dequantized) + the adapter merged, loadable by plain
                       transformers
    DIR/predict.py     a standalone script (transformers, peft, torch, Pillow; no tamis) that prepares images, prompts
                       and scores answers as tamis does, reading DIR/predict_config.json (pipeline/serving/)

The parts: spec.py (ExportSpec, ExportResult), provenance.py (the labels traced, lineage.json), card.py (README.md),
files.py (the adapter, merged/, predict.py, the serving hand-offs, the folder check). This module writes them in order.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pipeline.errors import ConfigError
from pipeline.export_model.card import metrics_markdown, model_card
from pipeline.export_model.files import (
    ADAPTER_FILES,
    EXPORT_NAMES,
    FORMATS,
    check_out,
    load_processor,
    merge_adapter,
    processor_for_export,
    serve_with_gguf,
    serve_with_vllm,
    storage_dtype,
    write_adapter,
    write_predict_script,
)
from pipeline.export_model.provenance import (
    Provenance,
    annotators,
    entry_votes,
    images_per_sample,
    lineage,
    logged_votes,
    provenance,
    shareable_path,
    trace_label,
    training_labels,
)
from pipeline.export_model.spec import ExportResult, ExportSpec

__all__ = ["ADAPTER_FILES", "EXPORT_NAMES", "FORMATS", "ExportResult", "ExportSpec", "Provenance", "annotators",
           "check_out", "entry_votes", "export_model", "images_per_sample", "lineage", "load_processor", "logged_votes", "merge_adapter",
           "metrics_markdown", "model_card", "processor_for_export", "provenance", "serve_with_gguf",
           "serve_with_vllm", "shareable_path", "storage_dtype", "trace_label", "training_labels", "write_adapter",
           "write_predict_script"]


def export_model(out: str | os.PathLike[str], *, artifacts: str | os.PathLike[str], spec: ExportSpec,
                 round_index: int | None = None, merge: bool = False, dtype: str = "auto",
                 force: bool = False, fmt: str = "hf") -> ExportResult:
    """Write DIR/adapter, DIR/README.md, DIR/lineage.json (and DIR/merged with `merge`) for a round's adapter.
    `spec`: the config sections read (ExportSpec). A DIR that is not empty needs `force` (check_out); paths in the export are relative, the base named as the config names it.
    `fmt` vllm adds serve.sh and, when the adapter holds LoRA vLLM does not take, adapter-vllm/ (pipeline/serving/)."""
    from pipeline.perclass import load_eval_report
    from pipeline.preprocess import resolve_size
    from pipeline.round_state import completed_rounds
    from pipeline.store import atomic_write_json, atomic_write_text

    data, pre, model_cfg = spec.data, spec.preprocess, spec.model
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: choose {', '.join(FORMATS)}")
    if fmt == "gguf":  # before any work: a family the pinned converter cannot take
        from pipeline.serving.gguf import check_convertible

        check_convertible(model_cfg)
    out = check_out(out, artifacts, force=force)
    prov = provenance(artifacts, round_index)
    adapter_src = Path(prov.state.adapter["adapter_dir"])
    base = model_cfg.name_as_written  # a hub ID, or the folder as the user wrote it (never the resolved path)
    loaded = load_processor(model_cfg)
    size = resolve_size(pre, model_cfg)
    processor = processor_for_export(loaded, size)
    out.mkdir(parents=True, exist_ok=True)
    adapter_out, adapter_cfg = out / "adapter", {}
    # A full fine-tune has no adapter, and vLLM takes no LoRA for some families: the whole model is the hand-off.
    if model_cfg.mode == "full" or fmt == "gguf" or (fmt == "vllm" and not loaded.family.runtimes.vllm_lora):
        merge = True
    if model_cfg.mode == "full":
        if adapter_out.is_dir():  # an earlier export's (--force): it would not match this model
            shutil.rmtree(adapter_out)
    else:
        adapter_cfg = write_adapter(adapter_src, adapter_out, base=base, processor=processor)
    merged_dtype = None
    if merge:
        dt = storage_dtype(dtype, model_cfg)
        merge_adapter(model_cfg, adapter_src, out / "merged", processor=processor, dtype=dt)
        merged_dtype = str(dt).removeprefix("torch.")
    elif (out / "merged").is_dir():  # an earlier export's (--force): it would not match this adapter
        shutil.rmtree(out / "merged")
    lin = lineage(prov, model=spec.model.model_dump(mode="json"), train=spec.train.model_dump(mode="json"),
                  seed=spec.seed)
    atomic_write_json(out / "lineage.json", lin)
    pad = f", padded square with {tuple(pre.pad_color)}" if pre.pad == "square" else ""
    note = (f"Images are prepared as tamis prepares them: EXIF-rotated, RGB, longest side {size} px (aspect kept{pad}); "
            "the exported processor carries tamis's image settings for images of that size.")
    question = next((s.question for s in data.sources if s.question), None) or data.question
    card = model_card(prov, model_cfg=model_cfg, loaded=loaded, adapter_config=adapter_cfg,
                      rounds_done=len(completed_rounds(artifacts)), consensus=spec.annotate.consensus,
                      question=question,
                      answers=data.answers, evaluation=load_eval_report(prov.state.eval_dir), base=base,
                      preprocess_note=note, merged_dtype=merged_dtype)
    atomic_write_text(out / "README.md", card)
    write_predict_script(out, loaded=loaded, processor=processor, spec=spec, size=size,
                         images_per_sample=images_per_sample(artifacts, prov.state))
    if adapter_out.is_dir():
        atomic_write_text(adapter_out / "README.md", card)  # in place of PEFT's empty template
    # An earlier export's (--force): they would not match this adapter.
    for stale in ("adapter-vllm", "serve.sh", "gguf", "lmstudio"):
        shutil.rmtree(out / stale) if (out / stale).is_dir() else (out / stale).unlink(missing_ok=True)
    vllm = serve_with_vllm(out, prov, loaded, spec, base) if fmt == "vllm" else None
    gguf = serve_with_gguf(out, prov, loaded, processor, question, size) if fmt == "gguf" else None
    return ExportResult(out, prov.round, adapter_out, out / "README.md", out / "lineage.json", len(prov.labels),
                        out / "merged" if merge else None, merged_dtype, vllm, gguf)
