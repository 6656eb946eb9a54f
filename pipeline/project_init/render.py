"""The YAML text `tamis init` writes: the layout of configs/smolvlm-qlora.yaml (a pretrained model) or of
configs/demo.yaml (a tiny stand-in), each chosen value with the reason settings.py gave for it as a comment."""

from __future__ import annotations

import json
from typing import Any

from pipeline.project_init.found import Found
from pipeline.project_init.settings import ModelFacts, Settings

# The tiny stand-in's settings from configs/demo.yaml, where the comments say why each is needed.
TINY_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "fc1", "fc2", "proj", "gate_proj", "up_proj",
                "down_proj"]


def _v(x: Any) -> str:
    """A scalar or list as YAML (JSON is YAML, and quotes what needs quoting)."""
    return json.dumps(x, ensure_ascii=False)


def _source_lines(f: Found) -> list[str]:
    lines = [f"    # {f.what}"]
    first = True
    for k, v in f.source.items():
        lines.append(f"    {'- ' if first else '  '}{k}: {_v(v)}")
        first = False
    return lines


def _model_lines(model: str, facts: ModelFacts, s: Settings) -> list[str]:
    family = facts.family if facts.family not in (None,) else None
    lines = ["model:", f"  # {s.hardware}" + (f"; tamis hardware's plan for this model: {s.train_plan}"
                                              if s.train_plan else ""),
             "  # A hub ID (downloaded once into the HF cache) or a local folder with config.json + weights + processor.",
             f"  name_or_path: {_v(model)}"]
    if family:
        lines.append(f"  family: {family}")
    if facts.tiny_size is not None:
        lines += ["  mode: qlora",
                  "  # A tiny random-weight stand-in (configs/demo.yaml says why): rank 64 on every projection, the",
                  "  # random vision tower included, so it can learn from images at all.",
                  "  lora_r: 64", "  lora_alpha: 128", "  lora_dropout: 0.05",
                  f"  target_modules: {_v(TINY_TARGETS)}", "  compute_dtype: auto"]
    else:
        lines += ["  mode: qlora                          # 4-bit NF4 base + LoRA",
                  "  lora_r: 16", "  lora_alpha: 32", "  lora_dropout: 0.05",
                  "  compute_dtype: auto                  # bf16 on Ampere or newer, fp16 on older GPUs, fp32 on CPU"]
    return lines


def _train_lines(facts: ModelFacts) -> list[str]:
    if facts.tiny_size is not None:
        return ["train:", "  # A fixed step budget keeps a tiny model's rounds short on a CPU; each round continues the",
                "  # previous adapter (a fresh tiny adapter sits at chance for a random number of steps).",
                "  batch_size: 8", "  effective_batch_size: 8", "  max_steps: 100", "  learning_rate: 0.002",
                "  checkpoint_every: 20", "  init: warm"]
    return ["train:", "  batch_size: auto                     # the memory planner picks micro-batch × accumulation",
            "  effective_batch_size: 16", "  gradient_checkpointing: auto", "  epochs: 2",
            "  learning_rate: 0.0002", "  checkpoint_every: 50                 # a killed round resumes from here",
            "  init: fresh"]


def _answer_lines(found: list[Found], answers: list[str] | None, answers_why: str, boxes: bool,
                  schema_file: str | None = None) -> list[str]:
    if schema_file:
        return [f"  # {answers_why}.", "  # The schema below was proposed from them: check its enums and required fields "
                "(docs/structured.md).", f"  answer_schema: {_v(schema_file)}", "  answers: null"]
    if boxes:
        return [f"  # {answers_why}: labels are boxes of these {len(answers or [])} classes.", "  task: boxes",
                f"  answers: {_v(answers)}"]
    if answers is None:
        return [f"  # {answers_why or 'open answers'}; scored by semantic entropy (docs/open-answers.md).",
                "  answers: null"]
    return [f"  # {len(answers)} answers, from " + " and ".join(
            "the class folders" if f.source["kind"] == "folder" else f"{f.source['path']}" for f in found if f.answers)
            + ": a closed set scores as classification over them.", f"  answers: {_v(answers)}"]


def _strategy_lines(answers: list[str] | None, boxes: bool, schema: bool = False) -> list[str]:
    if schema:  # docs/structured.md: why token entropy rather than per-field uncertainty over sampled answers
        return ["  strategy: token_entropy               # JSON answers: the mean token entropy of the generated answer",
                "  diversity: uncertainty_herding"]
    if boxes:  # a box answer is generated text: its token entropy is what the scoring gives without extra passes
        return ["  strategy: token_entropy               # box answers: the answer's mean token entropy",
                "  diversity: class_balanced             # each pick to the class with fewest predicted boxes "
                "(docs/boxes.md)"]
    return ["  strategy: margin" if answers else "  strategy: semantic_entropy", "  diversity: uncertainty_herding",
            *([] if answers else ["  mc_dropout_passes: 4                 # semantic entropy groups 4 sampled answers"])]


def render_config(found: list[Found], *, answers: list[str] | None, question: str, model: str, facts: ModelFacts,
                  settings: Settings, pool: int, artifacts: str, answers_why: str = "", boxes: bool = False,
                  schema_file: str | None = None) -> str:
    s = settings
    lines = ["# Written by `tamis init`: every setting below was chosen from your data, model and hardware, with the",
             "# reason beside it. Edit freely; `tamis config show -c THIS_FILE` prints it with every default filled in.",
             "# Paths are absolute, so tamis runs this project from any folder.", "seed: 0", "paths:",
             "  # datasets, adapters, rounds/NNN/{selection,export}, the label ledger and the inbox",
             f"  artifacts: {_v(artifacts)}",
             "data:", "  sources:"]
    for f in found:
        lines += _source_lines(f)
    lines += _answer_lines(found, answers, answers_why, boxes, schema_file)
    lines += [f"  question: {_v(question)}", "preprocess:", f"  # {s.size.why}", f"  size: {s.size.value}",
              "  pad: square                          # keep the aspect ratio: never stretch",
              f"  num_proc: {s.num_proc.value}                          # {s.num_proc.why}",
              "quality:",
              "  # Flags never delete anything; these two keep a sample out of the pool (docs/data.md).",
              "  exclude: [exact_duplicate, low_information]",
              "augment:", "  copies: 0"]
    lines += _model_lines(model, facts, s)
    if s.max_new_tokens is not None:
        per = "one per 2 characters of your longest JSON answer" if schema_file else "about 2 tokens a word of your longest answer"
        lines.append(f"  max_new_tokens: {s.max_new_tokens}                   # the generation budget: {per}, 8 to spare")
    lines += _train_lines(facts)
    lines += ["select:", f"  # {s.batch_size.why}", f"  batch_size: {s.batch_size.value}",
              f"  # {s.embeddings.why}", f"  embeddings: {s.embeddings.value}",
              "  # The label-efficiency winner: Uncertainty Herding, coverage weighted by the model's uncertainty; it",
              "  # moves from coverage to uncertainty by itself (benchmarks/README.md). Open answers: semantic entropy.",
              "  cold_start: maxherding",
              *_strategy_lines(answers, boxes, bool(schema_file)),
              f"  # {s.shard_size.why}", f"  shard_size: {s.shard_size.value}",
              f"  score_batch_size: {s.score_batch_size.value}               # {s.score_batch_size.why}",
              f"  # auto: score every eligible sample up to 10,000, restrict above (this pool: {pool:,}); the",
              "  # round summary says which it did and why (docs/selection.md).",
              "  candidates: auto",
              "annotate:", "  export_images: legible", "  formats: [label_studio, csv, jsonl, images]",
              "labelcheck:", "  method: heldout                      # the last adapter's boxes against new labels"
              if boxes else "  method: heldout                      # scores new labels with the last adapter",
              "rounds:", "  # Rounds in all, round 0 included; the last one trains and evaluates but selects nothing.",
              "  max_rounds: 10",
              f"  # {s.stop_set.why}", f"  stop_set: {s.stop_set.value}",
              "  # The default stop (rounds.stop_when_converged): once the stop set's agreement trend forecasts that",
              "  # later rounds would change at most 6 % of its answers, or the agreement stopped rising.",
              "  simulate_annotator: false"]
    return "\n".join(lines) + "\n"
