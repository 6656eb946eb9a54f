"""README.md, the model card: provenance, test metrics, the prompt and how to load the export."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.config import ModelConfig
from pipeline.export_model.provenance import Provenance, annotators
from pipeline.mdtext import code_span, escape_md, fenced


def _intervals(evaluation: Any) -> dict[str, list[float]]:
    """The evaluation's metric intervals (metrics.json's `intervals`; a box evaluation's `map50_ci95`, `map_ci95`),
    empty when it has none."""
    path = evaluation.dir / "metrics.json" if evaluation is not None else None
    if path is None or not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data.get("intervals") or {k.removesuffix("_ci95"): v for k, v in data.items() if k.endswith("_ci95") and v}


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
    from pipeline.report import box_per_class_markdown, per_class_markdown, per_group_markdown

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
    if evaluation is not None and evaluation.per_box_class:  # a box project: mAP above, AP per class below
        lines += ["", "Per class:", ""] + box_per_class_markdown(evaluation.per_box_class)
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
