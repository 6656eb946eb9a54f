"""Which serving runtimes take a family's model: declared once per family (`Family.runtimes`), read by
`tamis export-model --check` and `--format vllm` (pipeline/serving/), never tested by name in a caller.

Checked in December 2026 against vLLM's supported-models table (the LoRA column of its multimodal models; LoRA on
the vision tower and connector is experimental there) and llama.cpp's convert_hf_to_gguf.py (`--mmproj` writes the
vision tower a multimodal GGUF needs). Re-check both when they move; docs/use-your-model.md has the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's LoRAConfig.max_lora_rank takes one of these (vllm/config/lora.py MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class Runtimes:
    """What a family's exported model can be served with beyond transformers (which takes every family)."""

    vllm_lora: bool  # vLLM serves the architecture with LoRA adapters on its language model
    gguf: bool  # llama.cpp's convert_hf_to_gguf.py (+ --mmproj) converts a merged checkpoint: llama.cpp, LM Studio,
    # Ollama load the result
    vllm_note: str = ""
    gguf_note: str = ""
    # The `architectures` the pinned converter (pipeline/serving/llama_cpp.py) registers for the text model and for
    # the --mmproj pass; export-model --format gguf writes them into a staged config.json. Empty: not convertible.
    gguf_text: str = ""
    gguf_vision: str = ""


UNCHECKED = Runtimes(False, False, vllm_note="not a registered family: vLLM's support for this architecture is "
                     "unchecked; try the merged checkpoint with `vllm serve merged/`",
                     gguf_note="not a registered family: whether convert_hf_to_gguf.py knows it is unchecked")


def vllm_max_lora_rank(r: int) -> int:
    """The smallest rank vLLM's --max-lora-rank accepts that holds an adapter of rank `r`."""
    fit = [k for k in VLLM_LORA_RANKS if k >= r]
    if not fit:
        raise ValueError(f"LoRA rank {r} is above vLLM's largest --max-lora-rank ({VLLM_LORA_RANKS[-1]}); serve the "
                         "merged checkpoint (export-model --merge) instead")
    return fit[0]
