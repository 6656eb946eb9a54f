"""`tamis export-model --check`: which runtimes can take this project's model, and why not, before any conversion.

Read from the family's declaration (`Family.runtimes`, pipeline/model/runtimes.py) and what the adapter holds
(`model.mode`, and `model.train`: LoRA on the projector or the vision tower is LoRA vLLM takes only experimentally).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import ModelConfig
from pipeline.model.families import Family


@dataclass(frozen=True)
class Verdict:
    """One runtime's answer: `works` is yes, partly, merged only or no; `how` says what to run, or why not."""

    runtime: str
    works: str
    how: str

    def line(self) -> str:
        return f"{self.runtime}: {self.works}. {self.how}"


def vision_lora(model: ModelConfig) -> str | None:
    """What of the adapter lies outside the language model (LoRA there vLLM does not take by default), or None."""
    if model.mode == "full":
        return None
    return {"language+projector": "the projector", "all": "the projector and the vision tower"}.get(model.train)


def transformers_verdict(model: ModelConfig) -> Verdict:
    how = ("the merged model (export-model writes merged/ for a full fine-tune)" if model.mode == "full" else
           "adapter/ on its base with PEFT, or merged/ (--merge)")
    return Verdict("transformers", "yes", f"Every family: {how}; `python predict.py IMAGES` in the export.")


def vllm_verdict(family: Family, model: ModelConfig) -> Verdict:
    rt, extra = family.runtimes, vision_lora(model)
    if model.mode == "full":
        return Verdict("vLLM", "merged only" if rt.vllm_lora else "unchecked",
                       "A full fine-tune has no adapter: `vllm serve merged` (--format vllm writes serve.sh). "
                       + rt.vllm_note)
    if not rt.vllm_lora:
        return Verdict("vLLM", "merged only", f"{rt.vllm_note}. --format vllm merges and writes serve.sh for it.")
    if extra:
        return Verdict("vLLM", "partly", f"{rt.vllm_note}; this adapter also has LoRA on {extra} (model.train: "
                       f"{model.train}), which vLLM takes only experimentally. --format vllm writes adapter-vllm/ "
                       "without it and measures how many test answers change; or serve merged/ (--merge).")
    return Verdict("vLLM", "yes", f"{rt.vllm_note}. --format vllm writes serve.sh: vllm serve BASE --enable-lora "
                   "--lora-modules NAME=./adapter --max-lora-rank R.")


def gguf_verdict(family: Family) -> Verdict:
    from pipeline.serving.gguf import refusal

    rt, why = family.runtimes, refusal(family)
    if why:
        return Verdict("llama.cpp / LM Studio / Ollama (GGUF)", "no", why.removeprefix("--format gguf: ") + ".")
    return Verdict("llama.cpp / LM Studio / Ollama (GGUF)", "merged only",
                   f"{rt.gguf_note}: --format gguf merges, converts merged/ with llama.cpp's convert_hf_to_gguf.py "
                   "at a pinned commit (text model f16 / q8_0, and the projector with --mmproj) and writes an "
                   "Ollama Modelfile and an LM Studio folder; an adapter alone does not carry the vision part.")


def runtime_check(family: Family, model: ModelConfig) -> list[Verdict]:
    """transformers, vLLM and GGUF runtimes for this family's model, as the project trains it."""
    return [transformers_verdict(model), vllm_verdict(family, model), gguf_verdict(family)]


def check_model(model: ModelConfig) -> tuple[Family, list[Verdict]]:
    """The project's family (configured, or detected from the checkpoint) and its runtime verdicts."""
    from pipeline.model.loading import resolve_family

    family = resolve_family(model)
    return family, runtime_check(family, model)
