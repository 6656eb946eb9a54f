"""Which runtimes take a family's model (`tamis export-model --check`), declared on the families, and the pieces of
`--format vllm` that need no trained project: the adapter split and the serve script."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
import yaml

from pipeline.config import ModelConfig
from pipeline.model.families import FAMILIES
from pipeline.model.runtimes import UNCHECKED, vllm_max_lora_rank
from pipeline.serving.runtimes import runtime_check
from pipeline.serving.vllm import language_keys, serve_script, write_language_adapter
from tests.test_use_model import said, tamis_cli

VLLM_LORA = {"idefics3", "smolvlm", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3", "internvl"}
GGUF = {"idefics3", "smolvlm", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3"}  # the pinned converter's


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_declares_its_runtimes(name):
    fam = FAMILIES[name]()
    assert fam.runtimes is not UNCHECKED and fam.runtimes.vllm_note and fam.runtimes.gguf_note
    assert fam.runtimes.vllm_lora == (name in VLLM_LORA) and fam.runtimes.gguf == (name in GGUF)
    verdicts = {v.runtime.split()[0]: v for v in runtime_check(fam, ModelConfig(name_or_path="m", family=name))}
    assert verdicts["transformers"].works == "yes"
    assert verdicts["vLLM"].works == ("yes" if name in VLLM_LORA else "merged only")
    assert verdicts["llama.cpp"].works == ("merged only" if name in GGUF else "no")


def test_llava_onevision_says_why_not_and_vision_lora_is_partly_served():
    llava = {v.runtime.split()[0]: v for v in runtime_check(FAMILIES["llava_onevision"](), ModelConfig(
        name_or_path="m", family="llava_onevision"))}
    assert "takes no LoRA" in llava["vLLM"].how and "merge" in llava["vLLM"].how
    assert "LLaVA-OneVision" in llava["llama.cpp"].how
    qwen = {v.runtime: v for v in runtime_check(FAMILIES["qwen2_vl"](), ModelConfig(
        name_or_path="m", family="qwen2_vl", train="all"))}
    assert qwen["vLLM"].works == "partly" and "projector and the vision tower" in qwen["vLLM"].how
    full = runtime_check(FAMILIES["gemma3"](), ModelConfig(name_or_path="m", family="gemma3", mode="full"))
    assert full[1].works == "merged only" and "vllm serve merged" in full[1].how


def test_vllm_max_lora_rank_rounds_up_to_a_rank_vllm_accepts():
    assert [vllm_max_lora_rank(r) for r in (1, 4, 8, 12, 64, 300)] == [1, 8, 8, 16, 64, 320]
    with pytest.raises(ValueError, match="serve the merged checkpoint"):
        vllm_max_lora_rank(1024)


def test_the_language_adapter_keeps_only_language_model_lora(tmp_path, tiny_models):
    """A real PEFT adapter on the tiny model with LoRA in the vision tower too: adapter-vllm/ keeps the text model's
    tensors and a target_modules regex that PEFT loads back onto the text model alone."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from pipeline.model.loading import linear_names

    fam = FAMILIES["idefics3"]()
    base = AutoModelForImageTextToText.from_pretrained(tiny_models["idefics3"])
    target = fam.lora_target(None, "all", linears=linear_names(base))
    peft = get_peft_model(base, LoraConfig(r=4, target_modules=target, init_lora_weights=False))
    peft.save_pretrained(tmp_path / "adapter")
    full = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert any("vision_model" in k for k in full) and any("connector" in k for k in full)

    dropped = write_language_adapter(tmp_path / "adapter", tmp_path / "lang", fam)
    kept = load_file(str(tmp_path / "lang" / "adapter_model.safetensors"))
    assert sorted(kept) == sorted(language_keys(list(full), fam)) and dropped == len(full) - len(kept) > 0
    assert all(".text_model." in k for k in kept) and all(torch.equal(kept[k], full[k]) for k in kept)
    cfg = json.loads((tmp_path / "lang" / "adapter_config.json").read_text())
    assert cfg["target_modules"] == fam.lora_target(None, "language") and cfg["r"] == 4
    reloaded = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(tiny_models["idefics3"]),
                                         tmp_path / "lang")
    adapted = [n for n, _ in reloaded.named_modules() if n.endswith("lora_A")]
    assert adapted and all(".text_model." in n for n in adapted)


def test_serve_script_runs_vllm_with_the_adapter_and_its_rank(tmp_path):
    text = serve_script(base="HuggingFaceTB/SmolVLM-256M-Instruct", name="tamis-round-3", adapter="adapter", rank=16)
    script = tmp_path / "serve.sh"
    script.write_text(text)
    assert 'exec vllm serve "$BASE" --enable-lora --lora-modules tamis-round-3=./adapter --max-lora-rank 16 "$@"' in text
    # The command it would run, with a stand-in `vllm` on PATH that prints its arguments.
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "vllm").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (tmp_path / "bin" / "vllm").chmod(0o755)
    run = subprocess.run(["sh", str(script), "--port", "8001"], capture_output=True, text=True, cwd="/",
                         env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "BASE": "/models/smolvlm"})
    assert run.stdout.split("\n")[:-1] == ["serve", "/models/smolvlm", "--enable-lora", "--lora-modules",
                                           "tamis-round-3=./adapter", "--max-lora-rank", "16", "--port", "8001"]
    merged = serve_script(base="b", name="tamis-round-1", adapter=None, rank=None)
    assert "exec vllm serve ./merged --served-model-name tamis-round-1" in merged
    odd = serve_script(base="my models/base$1", name="n", adapter="adapter", rank=8)
    assert "BASE='my models/base$1'" in odd


def test_export_model_check_names_the_runtimes_before_any_export(tmp_path, tiny_models):
    from tests.test_round_flow import write_project

    config = write_project(tmp_path, tiny_models, limit=10, model={"train": "all"})
    res = tamis_cli("export-model", "-c", config, "--check")
    assert res.returncode == 0, said(res)
    text = said(res)
    assert "idefics3 model" in text and "train all" in text
    assert "transformers: yes." in text and "vLLM: partly." in text and "llama.cpp / LM Studio / Ollama (GGUF): merged only." in text
    assert not (tmp_path / "artifacts").exists() or not any((tmp_path / "artifacts").rglob("adapter*"))
    cfg = yaml.safe_load(config.read_text())
    cfg["model"]["family"] = "llava_onevision"
    cfg["model"]["name_or_path"] = str(tiny_models["llava_onevision"])
    config.write_text(yaml.safe_dump(cfg))
    res = tamis_cli("export-model", "-c", config, "--check")
    assert res.returncode == 0, said(res)
    assert "vLLM: merged only." in said(res) and "(GGUF): no." in said(res)
    missing = tamis_cli("export-model", "-c", config)
    assert missing.returncode == 2 and "--out is required" in said(missing)
