"""Loading tiny checkpoints in qlora / lora / full on the CPU, and the pure config builders."""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image

from pipeline.config import ModelConfig
from pipeline.errors import ModelError
from pipeline.model.families import FAMILIES, get_family
from pipeline.model.hardware import GPU, Hardware
from pipeline.model.loading import (
    build_bnb_config,
    build_lora_config,
    load_model,
    pick_attn_implementation,
    resolve_compute_dtype,
)

CPU = Hardware("cpu", [], 2, 8 << 30)
BF16_GPU = Hardware("cuda", [GPU("A100", 40 << 30, (8, 0), True)])
OLD_GPU = Hardware("cuda", [GPU("T4", 16 << 30, (7, 5), False)])


def _linear4bit_count(model) -> int:
    import bitsandbytes as bnb

    return sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())


@pytest.mark.parametrize("mode", ["qlora", "lora", "full"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_loads_in_each_mode(tiny_models, family, mode):
    loaded = load_model(ModelConfig(name_or_path=str(tiny_models[family]), mode=mode), trainable=True, hw=CPU)
    model, info = loaded.model, loaded.info
    assert loaded.family.name == family and info["family"] == family
    assert not model.training, "loaded models start in eval mode"
    assert (_linear4bit_count(model) > 0) == (mode == "qlora")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if mode == "full":
        assert len(trainable) == len(list(model.parameters()))
    else:
        assert trainable and all("lora_" in n for n in trainable)
        # Default targets sit in the language model only; the vision tower stays frozen and un-adapted.
        assert not any("vision" in n or "visual" in n for n in trainable)
    assert 0 < info["trainable_params"] <= info["total_params"]
    assert info["memory_footprint_mb"] > 0 and info["compute_dtype"] == "float32"
    assert info["attn_implementation"] == "sdpa"

    enc = loaded.family.encode(loaded.processor, [Image.new("RGB", (32, 32))], ["Which digit is shown?"], ["4"])
    enc.pop("answer_start")
    out = model(**enc)
    assert math.isfinite(out.loss.item())


def test_qlora_footprint_is_smaller_and_inference_load_is_frozen(tiny_models):
    path = str(tiny_models["qwen2_vl"])
    q = load_model(ModelConfig(name_or_path=path, mode="qlora"), hw=CPU)
    ref = load_model(ModelConfig(name_or_path=path, mode="lora"), hw=CPU)
    assert q.info["memory_footprint_mb"] < ref.info["memory_footprint_mb"]
    for loaded in (q, ref):
        assert loaded.info["trainable_params"] == 0
        assert not any(p.requires_grad for p in loaded.model.parameters())


def test_bnb_config_builder():
    cfg = ModelConfig(mode="qlora")
    bnb = build_bnb_config(cfg, CPU)
    assert bnb.load_in_4bit and bnb.bnb_4bit_quant_type == "nf4" and bnb.bnb_4bit_use_double_quant
    assert bnb.bnb_4bit_compute_dtype == torch.float32
    assert build_bnb_config(cfg, BF16_GPU).bnb_4bit_compute_dtype == torch.bfloat16
    assert build_bnb_config(cfg, OLD_GPU).bnb_4bit_compute_dtype == torch.float16
    assert build_bnb_config(ModelConfig(mode="lora"), CPU) is None
    assert build_bnb_config(ModelConfig(mode="full"), CPU) is None
    assert resolve_compute_dtype(ModelConfig(compute_dtype="float16"), BF16_GPU) == torch.float16


def test_lora_config_builder():
    cfg = ModelConfig(lora_r=4, lora_alpha=8, lora_dropout=0.1)
    lora = build_lora_config(cfg, get_family("idefics3"))
    assert (lora.r, lora.lora_alpha, lora.lora_dropout) == (4, 8, 0.1)
    assert isinstance(lora.target_modules, str) and "text_model" in lora.target_modules
    explicit = build_lora_config(ModelConfig(target_modules=["q_proj", "v_proj"]), get_family("qwen2_vl"))
    assert set(explicit.target_modules) == {"q_proj", "v_proj"}


def test_attention_choice():
    # No flash_attn on these machines (and no CUDA): sdpa is the automatic pick.
    assert pick_attn_implementation(ModelConfig()) == "sdpa"
    assert pick_attn_implementation(ModelConfig(attn_implementation="eager")) == "eager"
    with pytest.raises(ModelError, match="flash_attention_2 needs the flash_attn package"):
        pick_attn_implementation(ModelConfig(attn_implementation="flash_attention_2"))


def test_missing_model_is_built_when_asked(tmp_path):
    target = tmp_path / "models" / "tiny-qwen"
    with pytest.raises(ModelError, match="does not exist; build one with `tamis make-tiny-model"):
        load_model(ModelConfig(name_or_path=str(target), family="qwen2_5_vl"), hw=CPU)
    loaded = load_model(
        ModelConfig(name_or_path=str(target), family="qwen2_5_vl", build_tiny_if_missing=True, mode="lora"), hw=CPU,
    )
    assert (target / "config.json").is_file() and loaded.family.name == "qwen2_5_vl"


def test_family_mismatch_and_bad_adapter(tiny_models, tmp_path):
    with pytest.raises(ModelError, match="model.family is 'qwen2_vl' but .* is a 'idefics3' checkpoint"):
        load_model(ModelConfig(name_or_path=str(tiny_models["idefics3"]), family="qwen2_vl"), hw=CPU)
    with pytest.raises(ModelError, match="not a LoRA adapter folder"):
        load_model(ModelConfig(name_or_path=str(tiny_models["idefics3"]), mode="lora"), adapter=tmp_path, hw=CPU)
