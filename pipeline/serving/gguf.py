"""`tamis export-model --format gguf`: the merged model as llama.cpp's GGUF files, and what runtimes load them with.

    DIR/gguf/NAME-f16.gguf, NAME-q8_0.gguf   the text model (llama.cpp's converter at LLAMA_CPP's commit)
    DIR/gguf/NAME-Q4_K_M.gguf                when llama-quantize from the same source is built (else a note says how)
    DIR/gguf/mmproj-NAME-f16.gguf            the vision tower and projector (--mmproj): every runtime needs it beside
                                             the text model, or the model answers without seeing the image
    DIR/gguf/Modelfile                       Ollama: the model and the projector as two FROM lines, the chat frame
                                             the rounds trained with, its stop tokens
    DIR/lmstudio/tamis/NAME/                 LM Studio's models/<publisher>/<model>/ layout with both files

The converter reads config.json's `architectures`: each pass gets a staged copy of merged/ (links, config.json
rewritten) naming the class the pinned converter registers for the family (`Runtimes.gguf_text` / `gguf_vision`),
so merged/ itself stays what transformers loads.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import ModelConfig
from pipeline.errors import ConfigError
from pipeline.model.families import Family
from pipeline.serving.llama_cpp import LLAMA_CPP, build_hint, convert, quantize, require_source, tool_path

log = logging.getLogger(__name__)
TEXT_TYPES = ("f16", "q8_0")  # what the converter writes in pure Python
K_QUANT = "Q4_K_M"  # needs the compiled llama-quantize
RUNTIME_FILE = "q8_0"  # the text model the Modelfile and LM Studio folder name
PUBLISHER = "tamis"
PROMPT_MARK = "\x00PROMPT\x00"


@dataclass(frozen=True)
class GgufExport:
    """What --format gguf wrote: the text models by type, the projector, the runtime files, and what it took."""

    dir: Path
    models: dict[str, Path]
    mmproj: Path
    modelfile: Path
    lmstudio: Path
    seconds: float
    notes: list[str] = field(default_factory=list)  # e.g. why there is no Q4_K_M


def refusal(family: Family) -> str | None:
    """Why the pinned converter cannot take this family (and the nearest path), or None when it can."""
    rt = family.runtimes
    if rt.gguf and rt.gguf_text and rt.gguf_vision:
        return None
    return (f"--format gguf: llama.cpp {LLAMA_CPP.commit}'s convert_hf_to_gguf.py cannot convert a {family.name} "
            f"model ({rt.gguf_note}). Serve it with transformers (the export's predict.py, or merged/ with --merge)"
            + (" or vLLM (--format vllm)" if rt.vllm_lora else " or vLLM from merged/ (--format vllm)"))


def check_convertible(model: ModelConfig) -> Family:
    """The project's family, or a ConfigError before any work when the pinned converter cannot take it."""
    from pipeline.model.loading import resolve_family

    family = resolve_family(model)
    why = refusal(family)
    if why:
        raise ConfigError(why)
    return family


def gguf_name(family: Family, round_index: int) -> str:
    """The GGUF files' stem and the LM Studio / Ollama model name."""
    return f"{family.name.replace('_', '-')}-tamis-round-{round_index}"


def staged(merged: Path, architecture: str, into: Path) -> Path:
    """A view of `merged` whose config.json names `architecture` (files linked, config.json rewritten)."""
    into.mkdir(parents=True)
    for f in merged.iterdir():
        if f.name != "config.json":
            (into / f.name).symlink_to(f.resolve())
    cfg = json.loads((merged / "config.json").read_text(encoding="utf-8"))
    (into / "config.json").write_text(json.dumps({**cfg, "architectures": [architecture]}, indent=2), encoding="utf-8")
    return into


def convert_merged(merged: Path, family: Family, out: Path, name: str) -> tuple[dict[str, Path], Path]:
    """The text model at TEXT_TYPES and the f16 projector from `merged`, written into `out`."""
    src = require_source()
    rt = family.runtimes
    models = {t: out / f"{name}-{t}.gguf" for t in TEXT_TYPES}
    mmproj = out / f"mmproj-{name}-f16.gguf"
    with tempfile.TemporaryDirectory(prefix="tamis-gguf-") as tmp:
        text = staged(merged, rt.gguf_text, Path(tmp) / "text")
        vision = text if rt.gguf_vision == rt.gguf_text else staged(merged, rt.gguf_vision, Path(tmp) / "vision")
        for t, path in models.items():
            convert(text, path, t, mmproj=False, src=src)
        convert(vision, mmproj, "f16", mmproj=True, src=src)
    return models, mmproj


def chat_frame(processor: Any) -> str:
    """The chat template the rounds trained with, rendered around one user turn as Ollama's TEMPLATE: the question
    is `{{ .Prompt }}`; Ollama places the image itself."""
    turn = [{"role": "user", "content": [{"type": "text", "text": PROMPT_MARK}]}]
    text = processor.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
    if text.count(PROMPT_MARK) != 1:
        raise ConfigError(f"the chat template renders the question {text.count(PROMPT_MARK)} times; cannot write "
                          "an Ollama TEMPLATE from it")
    return text.replace(PROMPT_MARK, "{{ .Prompt }}")


def stop_tokens(family: Family, processor: Any) -> list[str]:
    tok = getattr(processor, "tokenizer", processor)
    return list(dict.fromkeys(t for t in (family.end_token, tok.eos_token) if t))


def modelfile(model: str, mmproj: str, frame: str, stops: list[str]) -> str:
    """Ollama's Modelfile: the projector is a second FROM (an ADAPTER line would be read as LoRA)."""
    lines = ["# Written by `tamis export-model --format gguf` (docs/use-your-model.md): ollama create NAME -f Modelfile",
             f"FROM ./{model}", f"FROM ./{mmproj}", f'TEMPLATE """{frame}"""',
             *(f"PARAMETER stop {json.dumps(s)}" for s in stops), "PARAMETER temperature 0"]
    return "\n".join(lines) + "\n"


def link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def runtime_files(out: Path, gguf_dir: Path, name: str, model: Path, mmproj: Path, *, processor: Any,
                  family: Family) -> tuple[Path, Path]:
    """The Modelfile beside the GGUF files and the LM Studio layout (hard links where the disk allows)."""
    from pipeline.store import atomic_dir, atomic_write_text

    mf = atomic_write_text(gguf_dir / "Modelfile", modelfile(model.name, mmproj.name, chat_frame(processor),
                                                             stop_tokens(family, processor)))
    lm = out / "lmstudio" / PUBLISHER / name
    lm.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(lm) as tmp:
        for f in (model, mmproj):
            link_or_copy(f, tmp / f.name)
    return mf, lm


def card_section(res: GgufExport, *, question: str | None, size: int) -> str:
    """The model card's GGUF part: the files and the commands of each runtime, from the export's folder."""
    rel = res.dir.parent
    model, mmproj = (p.relative_to(rel) for p in (res.models[RUNTIME_FILE], res.mmproj))
    q = shlex.quote(question or "Describe the image.")
    lines = ["", "## GGUF (llama.cpp, LM Studio, Ollama)", "",
             f"Converted from merged/ by llama.cpp {LLAMA_CPP.commit}'s convert_hf_to_gguf.py "
             f"({LLAMA_CPP.requirement}'s vendored copy): text model "
             + ", ".join(f"`{p.relative_to(rel)}`" for p in res.models.values())
             + f" and the projector `{mmproj}` (always load both). Give it images prepared as tamis prepares them "
             f"(longest side {size} px).", *(f"> {n}" for n in res.notes), "", "```sh",
             f"llama-mtmd-cli -m {model} --mmproj {mmproj} --image IMAGE.png -p {q} --temp 0 -n 16",
             f"llama-server -m {model} --mmproj {mmproj} --temp 0 --port 8080",
             f"ollama create {res.lmstudio.name} -f {res.modelfile.relative_to(rel)}",
             f"lms import {res.lmstudio.relative_to(rel)}/{res.models[RUNTIME_FILE].name}"
             "  # or copy lmstudio/tamis/ into ~/.lmstudio/models/ (the projector must sit beside the model)", "```"]
    return "\n".join(lines) + "\n"


def export_gguf(out: Path, merged: Path, family: Family, *, name: str, processor: Any) -> GgufExport:
    """DIR/gguf/ (text model f16, q8_0 and Q4_K_M when llama-quantize is built; the f16 projector; the Modelfile) and
    DIR/lmstudio/ from `merged`."""
    from pipeline.store import atomic_dir

    why = refusal(family)
    if why:
        raise ConfigError(why)
    start = time.monotonic()
    with atomic_dir(out / "gguf") as tmp:
        models, mmproj = convert_merged(merged, family, tmp, name)
        notes, tool = [], tool_path("llama-quantize")
        if tool.is_file():
            quantize(tool, models["f16"], tmp / f"{name}-{K_QUANT}.gguf", K_QUANT)
            models[K_QUANT] = tmp / f"{name}-{K_QUANT}.gguf"
        else:
            notes.append(f"No {K_QUANT}: llama-quantize ({tool}) is not built; {build_hint()}; then export again.")
    models = {t: out / "gguf" / p.name for t, p in models.items()}
    mmproj = out / "gguf" / mmproj.name
    mf, lm = runtime_files(out, out / "gguf", name, models[RUNTIME_FILE], mmproj, processor=processor, family=family)
    return GgufExport(out / "gguf", models, mmproj, mf, lm, time.monotonic() - start, notes)
