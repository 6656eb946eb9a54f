"""`tamis export-model --format vllm`: the adapter as vLLM takes it, and serve.sh with the `vllm serve` command.

vLLM applies LoRA to a multimodal model's language model; LoRA on its vision tower or connector is experimental
there. An adapter trained with model.train: language+projector or all is written again as adapter-vllm/ with only
its language-model tensors (and target_modules saying so), and the cost is measured, not guessed: the tiny model or
the real one answers the round's test split with the full and with the restricted adapter, and the share of top
answers that changed is reported. A family vLLM takes no LoRA for (Family.runtimes) is served merged.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import ModelConfig
from pipeline.errors import ConfigError
from pipeline.model.families import Family
from pipeline.model.runtimes import vllm_max_lora_rank
from pipeline.round_state import RoundState

log = logging.getLogger(__name__)
LANGUAGE_ADAPTER = "adapter-vllm"
SERVE_SCRIPT = "serve.sh"
WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class VllmExport:
    """What --format vllm wrote and what it cost: `adapter` is the folder serve.sh names (None: it serves merged/),
    `dropped` the LoRA tensors left out, `changed` the share of test answers that moved when some were (of `tested`)."""

    serve: Path
    adapter: Path | None
    rank: int | None
    dropped: int = 0
    changed: float | None = None
    tested: int = 0

    def warning(self) -> str | None:
        if not self.dropped:
            return None
        moved = (f"{self.changed:.1%} of {self.tested} test answers changed" if self.changed is not None else
                 "not measured (the round has no evaluated test split)")
        return (f"vLLM takes LoRA on the language model only: {self.dropped} LoRA tensors on the projector / vision "
                f"tower were left out of {self.adapter.name}/ ({moved} without them); serve merged/ (--merge) to keep "
                "them")


def language_keys(keys: Sequence[str], family: Family) -> list[str]:
    """The adapter tensors inside the family's language model (`language_model_scope` in their module path)."""
    inside = re.compile(rf"(?:^|\.){family.language_model_scope}\.")
    return [k for k in keys if inside.search(k)]


def write_language_adapter(src: Path, out: Path, family: Family) -> int:
    """`out`: the adapter in `src` with only its language-model LoRA tensors and a target_modules regex that says so;
    returns how many tensors were left out."""
    from safetensors.torch import load_file, save_file

    from pipeline.store import atomic_dir

    if not (src / WEIGHTS).is_file():
        raise ConfigError(f"{src}: no {WEIGHTS}; --format vllm rewrites safetensors adapters only")
    tensors = load_file(str(src / WEIGHTS))
    kept = language_keys(list(tensors), family)
    if not kept:
        raise ConfigError(f"{src}: none of its {len(tensors)} LoRA tensors is under the {family.name} language model "
                          f"({family.language_model_scope}); vLLM would serve the base model. Serve merged/ instead")
    cfg = json.loads((src / "adapter_config.json").read_text(encoding="utf-8"))
    cfg["target_modules"] = family.lora_target(None, "language")
    with atomic_dir(out) as tmp:
        save_file({k: tensors[k].contiguous() for k in kept}, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        for f in src.iterdir():  # the processor, chat template and card beside the weights
            if f.is_file() and f.name not in (WEIGHTS, "adapter_config.json", "adapter_model.bin"):
                (tmp / f.name).write_bytes(f.read_bytes())
    return len(tensors) - len(kept)


def test_rows(artifacts: str | os.PathLike[str], state: RoundState) -> list[dict[str, Any]]:
    """The labeled test split the round evaluated its adapter on (artifacts/eval/test/<digest>/), or [] without one."""
    import datasets

    from pipeline.store import read_manifest

    if not state.eval_dir or not Path(state.eval_dir).is_dir():
        return []
    digest = read_manifest(state.eval_dir).inputs.get("test")
    folder = Path(artifacts) / "eval" / "test" / str(digest)[:16] / "dataset"
    return list(datasets.load_from_disk(str(folder))) if digest and folder.is_dir() else []


def answer_change(model: ModelConfig, full: Path, restricted: Path, rows: Sequence[Mapping[str, Any]],
                  answers: Sequence[str] | None, *, batch_size: int) -> float:
    """The share of rows whose answer (top answer, or greedy generation) differs between the two adapters."""
    from pipeline.evaluate import predict_answers
    from pipeline.model.loading import load_model

    got = [predict_answers(load_model(model, adapter=a), rows, answers, batch_size=batch_size,
                           max_new_tokens=model.max_new_tokens) for a in (full, restricted)]
    return sum(x != y for x, y in zip(*got, strict=True)) / len(rows)


def serve_script(*, base: str, name: str, adapter: str | None, rank: int | None) -> str:
    """serve.sh: vLLM's OpenAI-compatible server on the base with the adapter (or on merged/), from the export's
    folder; BASE=… overrides the base (a local copy), extra arguments go to `vllm serve`."""
    lines = ["#!/bin/sh", "# Written by `tamis export-model --format vllm` (docs/use-your-model.md).", "set -e",
             'cd "$(dirname "$0")"']
    if adapter is None:
        lines.append('exec vllm serve ./merged --served-model-name ' + shlex.quote(name) + ' "$@"')
    else:
        lines += [f"BASE=\"${{BASE:-{base}}}\"" if re.fullmatch(r"[\w./-]+", base) else f"BASE={shlex.quote(base)}",
                  f'exec vllm serve "$BASE" --enable-lora --lora-modules {shlex.quote(name)}=./{adapter} '
                  f'--max-lora-rank {rank} "$@"']
    return "\n".join(lines) + "\n"


def export_vllm(out: Path, *, state: RoundState, family: Family, model: ModelConfig, base: str,
                answers: Sequence[str] | None, batch_size: int, artifacts: str | os.PathLike[str]) -> VllmExport:
    """serve.sh in `out` (an export with adapter/, or merged/ when vLLM takes no adapter here), and adapter-vllm/
    with the language-model LoRA when the adapter holds more, measured on the round's test split."""
    from pipeline.store import atomic_write_text

    name = f"tamis-round-{state.round}"
    adapter_dir = out / "adapter"
    if model.mode == "full" or not family.runtimes.vllm_lora or not adapter_dir.is_dir():
        res = VllmExport(out / SERVE_SCRIPT, None, None)
    else:
        rank = vllm_max_lora_rank(int(json.loads((adapter_dir / "adapter_config.json").read_text())["r"]))
        res = VllmExport(out / SERVE_SCRIPT, adapter_dir, rank)
        from safetensors import safe_open

        with safe_open(str(adapter_dir / WEIGHTS), "pt") as f:
            keys = list(f.keys())
        if len(language_keys(keys, family)) < len(keys):
            lang = out / LANGUAGE_ADAPTER
            dropped = write_language_adapter(adapter_dir, lang, family)
            rows = test_rows(artifacts, state)
            changed = answer_change(model, adapter_dir, lang, rows, answers, batch_size=batch_size) if rows else None
            res = VllmExport(out / SERVE_SCRIPT, lang, rank, dropped, changed, len(rows))
    atomic_write_text(res.serve, serve_script(base=base, name=name, adapter=res.adapter and res.adapter.name,
                                              rank=res.rank))
    res.serve.chmod(res.serve.stat().st_mode | 0o111 & ~_umask())
    if res.warning():
        log.warning("%s", res.warning())
    return res


def _umask() -> int:
    from pipeline.store import current_umask

    return current_umask()
