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
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config import (
    AnnotateConfig,
    DataConfig,
    ModelConfig,
    PreprocessConfig,
    SelectConfig,
    TrainConfig,
)
from pipeline.errors import ConfigError, ModelError
from pipeline.mdtext import code_span, escape_md, fenced
from pipeline.round_state import RoundState, trained_round

if TYPE_CHECKING:
    from pipeline.serving.gguf import GgufExport
    from pipeline.serving.vllm import VllmExport

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class ExportSpec:
    """The config sections an export reads: the question and answers (data), the image preparation (preprocess), the
    base model and how it trained (model, train, seed: lineage.json), the consensus method (annotate, the card) and
    the scoring batch (select: predict_config.json and serve.sh)."""

    data: DataConfig
    preprocess: PreprocessConfig
    model: ModelConfig
    train: TrainConfig
    annotate: AnnotateConfig
    select: SelectConfig
    seed: int


@dataclass(frozen=True)
class Provenance:
    """What the model card and lineage.json say about a round's adapter, gathered once."""

    round: int
    state: RoundState
    train_manifest: Any
    labels: list[dict[str, Any]]  # one per training label: ledger entry fields, or source "seed"
    artifacts: Path  # the project's: paths under it are written relative to it


def training_labels(artifacts: str | os.PathLike[str], state: RoundState) -> list[dict[str, Any]]:
    """The labels the round's adapter trained on (its labeled set, rounds/NNN/labeled/), each traced to the newest
    ledger entry for that sample imported by that round, or marked as a seed label the data came with."""
    import datasets

    from pipeline.annotation.ledger import Ledger, ledger_path
    from pipeline.round_state import round_dir

    folder = round_dir(artifacts, state.round) / "labeled" / "dataset"
    if not folder.is_dir():
        raise ConfigError(f"{folder}: the round's labeled set is gone, so its labels cannot be traced; run "
                          f"`tamis round --full` to rebuild it")
    ds = datasets.load_from_disk(str(folder)).select_columns(["sample_id", "answer"])
    newest: dict[str, dict[str, Any]] = {}
    for e in Ledger(ledger_path(artifacts)).entries():
        if "sample_id" in e and int(e.get("round", 0)) <= state.round:
            newest[e["sample_id"]] = e
    logged = logged_votes(artifacts, state.round)
    return [trace_label(sid, answer, newest.get(sid), logged, artifacts)
            for sid, answer in zip(ds["sample_id"], ds["answer"], strict=True)]


def trace_label(sid: str, answer: str, entry: Mapping[str, Any] | None, logged: Mapping[str, list[dict[str, str]]],
                artifacts: str | os.PathLike[str]) -> dict[str, Any]:
    """One label as lineage.json lists it: its ledger entry (id, annotators and their votes, round, the imported
    file's digest), or `source: seed` for a label the data came with (no entry)."""
    if entry is None:
        return {"sample_id": sid, "label": answer, "source": "seed"}
    e = entry
    row = {"sample_id": sid, "label": answer, "source": "ledger", "entry_id": e.get("entry_id"),
           "annotator": e.get("annotator"), "votes": logged.get(sid) or entry_votes(e), "round": e.get("round"),
           "kind": e.get("kind"), "source_file": shareable_path(e.get("source_file"), artifacts),
           "source_digest": e.get("source_digest")}
    if e.get("label") != answer:  # e.g. a consensus of several annotators' votes replaced the entry's label
        row["ledger_label"] = e.get("label")
    return row


def logged_votes(artifacts: str | os.PathLike[str], round_index: int) -> dict[str, list[dict[str, str]]]:
    """sample_id → every raw vote on it up to `round_index` (the vote log beside the ledger: each annotator's answer,
    outvoted ones and votes a later consensus settled included), oldest first. A file imported twice counts once."""
    from pipeline.annotation.consensus import votes_path
    from pipeline.store import read_jsonl

    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in read_jsonl(votes_path(artifacts)):
        if "sample_id" in r and int(r.get("round", 0)) <= round_index:
            seen.setdefault((r.get("source_digest"), r["sample_id"], r.get("annotator"), r.get("label")), r)
    out: dict[str, list[dict[str, str]]] = {}
    for r in seen.values():
        out.setdefault(str(r["sample_id"]), []).append({"annotator": str(r["annotator"]), "label": str(r["label"])})
    return out


def entry_votes(e: Mapping[str, Any]) -> list[dict[str, str]]:
    """A ledger entry's votes, for a label the vote log does not know (an older project, a simulated annotator):
    the votes it recorded, else its one annotator. Never its `annotator` field split on commas: that field joins
    the names of the winning side only, and a name may hold a comma."""
    if e.get("votes"):
        return [{"annotator": str(v["annotator"]), "label": str(v["label"])} for v in e["votes"]]
    return [{"annotator": str(e["annotator"]), "label": str(e["label"])}] if e.get("annotator") else []


def annotators(labels: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every person who voted on a training label, once each, outvoted ones included (the model as a consensus
    rater is not a person)."""
    from pipeline.annotation.consensus import MODEL_RATER

    return sorted({v["annotator"] for r in labels for v in r.get("votes", ()) if v["annotator"] != MODEL_RATER})


def shareable_path(path: str | os.PathLike[str] | None, artifacts: str | os.PathLike[str]) -> str | None:
    """A project path as an export may name it: relative to the artifacts folder when inside it, else only its
    file name (an absolute path tells whoever receives the export the user's name and the host's layout)."""
    if path is None:
        return None
    p, art = Path(path), Path(artifacts)
    for root in (art, art.resolve()):
        if p.is_relative_to(root):
            return p.relative_to(root).as_posix()
    return p.name


def provenance(artifacts: str | os.PathLike[str], round_index: int | None) -> Provenance:
    from pipeline.store import read_manifest

    state = trained_round(artifacts, round_index)
    return Provenance(state.round, state, read_manifest(state.adapter["dir"]),
                      training_labels(artifacts, state), Path(artifacts))


def lineage(prov: Provenance, *, model: Mapping[str, Any], train: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """lineage.json: which labels (ledger entry ids, their files' digests) and which config made the adapter."""
    from pipeline.store import digest_json

    ref, m = prov.state.adapter, prov.train_manifest
    return {
        "round": prov.round,
        "adapter": {"digest": ref.get("adapter_digest"), "train_key": ref.get("digest"),
                    "train_dir": shareable_path(ref.get("dir"), prov.artifacts),
                    "stage_version": m.stage_version, "inputs": dict(m.inputs)},
        "config_digest": digest_json({"model": dict(model), "train": dict(train), "seed": seed}),
        "train_config_digest": m.config_digest,
        "labeled_digest": prov.state.labeled_digest,
        "counts": {"labels": len(prov.labels), "from_ledger": sum(r["source"] == "ledger" for r in prov.labels),
                   "seed": sum(r["source"] == "seed" for r in prov.labels)},
        "labels": prov.labels,
    }


def _intervals(evaluation: Any) -> dict[str, list[float]]:
    """The evaluation's metric intervals (metrics.json's `intervals`), empty when it has none."""
    path = evaluation.dir / "metrics.json" if evaluation is not None else None
    if path is None or not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8")).get("intervals") or {}


def _prompt_example(loaded: Any, question: str) -> str:
    return loaded.family.prompt(loaded.processor, question)


def _how_to_load(base: str, merged_dtype: str | None) -> list[str]:
    lines = ["## How to load it", "", "The adapter on its base model (PEFT):", "",
             *fenced("\n".join(["from peft import PeftModel",
                                "from transformers import AutoModelForImageTextToText, AutoProcessor",
                                f"base = AutoModelForImageTextToText.from_pretrained({json.dumps(base)})",
                                'model = PeftModel.from_pretrained(base, "adapter")',
                                'processor = AutoProcessor.from_pretrained("adapter")']), "python"), ""]
    if merged_dtype:
        lines += [f"The merged checkpoint (`merged/`, {merged_dtype} weights; no PEFT needed):", "", "```python",
                  "from transformers import AutoModelForImageTextToText, AutoProcessor",
                  'model = AutoModelForImageTextToText.from_pretrained("merged")',
                  'processor = AutoProcessor.from_pretrained("merged")', "```", ""]
    return lines + ["Without tamis: `python predict.py IMAGES --out predictions.csv` (transformers, peft, torch and "
                    "Pillow; it prepares images, prompts and scores every token of every answer as tamis does, from "
                    "`predict_config.json`).", "",
                    "Or with tamis: `tamis predict IMAGES --adapter adapter` (same preparation and prompt).", "",
                    "Lineage: `lineage.json` lists every training label's ledger entry (id, annotators and their "
                    "votes, round, the imported file's digest) and the config digest behind this adapter."]


def _provenance_lines(prov: Provenance, *, model_cfg: ModelConfig, family: str, adapter_config: Mapping[str, Any],
                      rounds_done: int, consensus: str, base: str) -> list[str]:
    """The card's Provenance section; every name a user or annotator chose goes through escape_md."""
    labels, people = prov.labels, annotators(prov.labels)
    lines = [
        "## Provenance", "",
        f"- base model: {code_span(base)} (family `{family}`)",
        f"- mode: **{model_cfg.mode}**" + (" (4-bit NF4 base + LoRA)" if model_cfg.mode == "qlora" else ""),
        f"- LoRA: r = {adapter_config.get('r')}, alpha = {adapter_config.get('lora_alpha')}, dropout = "
        f"{adapter_config.get('lora_dropout')}, target modules = "
        f"{code_span(str(adapter_config.get('target_modules')))}",
        f"- rounds: this adapter is round {prov.round}'s; {rounds_done} rounds finished (0 … {prov.round})",
        f"- labels: **{len(labels)}** ({sum(r['source'] == 'ledger' for r in labels)} from the label ledger, "
        f"{sum(r['source'] == 'seed' for r in labels)} that came with the data)",
        f"- annotators: {len(people)} ({', '.join(map(escape_md, people)) or 'none'}); consensus method: "
        f"{escape_md(consensus)}",
    ]
    check = prov.state.labelcheck
    if check:
        lines.append(f"- label check ({escape_md(str(check.get('method')))}): " + (
            f"could not judge yet ({check.get('checked')} labels checked)" if check.get("abstained") else
            f"{check.get('issues')} likely label errors of {check.get('checked')} checked"))
    else:
        lines.append("- label check: none this round")
    return lines


def metrics_markdown(metrics: Mapping[str, float] | None, evaluation: Any) -> list[str]:
    """The card's test metrics: the per-class table (pipeline.report escapes the names), else each metric with its interval."""
    from pipeline.report import per_class_markdown, per_group_markdown

    pc = evaluation.per_class if evaluation is not None else None
    if pc:
        return per_class_markdown(pc)
    metrics, ci = metrics or {}, _intervals(evaluation)
    if not metrics:
        return []
    lines = [", ".join(f"{k} = {v:.4f}" + (f" (95% CI {ci[k][0]:.3f}–{ci[k][1]:.3f})" if k in ci else "")
                       for k, v in metrics.items())]
    if evaluation is not None and evaluation.per_group:
        pg = evaluation.per_group
        lines += [""] + per_group_markdown(pg)
    return lines


def model_card(prov: Provenance, *, model_cfg: ModelConfig, loaded: Any, adapter_config: Mapping[str, Any],
               rounds_done: int, consensus: str, question: str, answers: Sequence[str] | None,
               evaluation: Any, base: str, preprocess_note: str, merged_dtype: str | None) -> str:
    """README.md: a Hugging Face model card (YAML header) saying where the model came from and how to use it.
    Names users and annotators chose (answers, annotators, the question, the base's name) are text, never markup:
    escaped, or code delimited by more backticks than they hold (pipeline/mdtext.py); JSON-quoted in the YAML
    header."""
    from pipeline.chance import card_lines as chance_card_lines

    plain = re.fullmatch(r"[A-Za-z0-9/][A-Za-z0-9._/-]*", base)  # a hub ID as YAML reads it; anything else quoted
    header = ["---", f"base_model: {base if plain else json.dumps(base)}", "library_name: peft",
              "pipeline_tag: image-text-to-text",
              "tags:", "- tamis", "- active-learning", f"- {model_cfg.mode}", "---", ""]
    lines = header + [
        f"# tamis model: round {prov.round}", "",
        "Trained by tamis (data-centric active learning for vision-language models) from the labels listed in "
        "`lineage.json`.", "",
        *_provenance_lines(prov, model_cfg=model_cfg, family=loaded.family.name, adapter_config=adapter_config,
                           rounds_done=rounds_done, consensus=consensus, base=base),
        *chance_card_lines(prov.state.at_chance),
        "", "## Test metrics", "", *metrics_markdown(prov.state.metrics, evaluation),
        "", "## Prompt", "",
        f"Question: {code_span(question)}" + (f"; answers: {', '.join(map(escape_md, answers))}" if answers else
                                               " (open answers)"),
        "", "The model sees this text (the image placeholder expands in the processor):", "",
        *fenced(_prompt_example(loaded, question)), "", preprocess_note,
        "tamis scores every candidate answer's tokens after the prompt (mean log-probability per token) and "
        "answers the most likely one." if answers else "tamis answers by greedy generation.", "",
        *_how_to_load(base, merged_dtype)]
    return "\n".join(lines) + "\n"


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


@dataclass(frozen=True)
class ExportResult:
    dir: Path
    round: int
    adapter: Path
    card: Path
    lineage: Path
    labels: int
    merged: Path | None
    merged_dtype: str | None
    vllm: VllmExport | None = None  # with format vllm: serve.sh, the adapter it serves, what leaving LoRA out cost
    gguf: GgufExport | None = None  # with format gguf: the GGUF files, the Modelfile, the LM Studio folder


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


def write_predict_script(out: Path, *, loaded: Any, processor: Any, spec: ExportSpec, size: int) -> None:
    """DIR/predict.py (tamis's standalone predictor, copied) and DIR/predict_config.json (what it asks and how)."""
    from pipeline.serving.predict_config import CONFIG_NAME, SCRIPT, SCRIPT_NAME, predict_config
    from pipeline.store import atomic_write_json, atomic_write_text

    atomic_write_json(out / CONFIG_NAME, predict_config(
        loaded=loaded, processor=processor, data=spec.data, preprocess=spec.preprocess, model=spec.model,
        select=spec.select, size=size))
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
    write_predict_script(out, loaded=loaded, processor=processor, spec=spec, size=size)
    if adapter_out.is_dir():
        atomic_write_text(adapter_out / "README.md", card)  # in place of PEFT's empty template
    # An earlier export's (--force): they would not match this adapter.
    for stale in ("adapter-vllm", "serve.sh", "gguf", "lmstudio"):
        shutil.rmtree(out / stale) if (out / stale).is_dir() else (out / stale).unlink(missing_ok=True)
    vllm = serve_with_vllm(out, prov, loaded, spec, base) if fmt == "vllm" else None
    gguf = serve_with_gguf(out, prov, loaded, processor, question, size) if fmt == "gguf" else None
    return ExportResult(out, prov.round, adapter_out, out / "README.md", out / "lineage.json", len(prov.labels),
                        out / "merged" if merge else None, merged_dtype, vllm, gguf)
