"""Loading tiny checkpoints in qlora / lora / full on the CPU, and the pure config builders."""

from __future__ import annotations

import math
from pathlib import Path

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


# ------------------------------------------------------------------------------------------ model.train
# Which modules each model.train value adapts, per family: the language model's projections always; the projector's
# Linears from language+projector on; the vision tower's block Linears only with all.
PARTS = {
    "idefics3": {"projector": "connector.", "vision": "vision_model."},
    "qwen2_vl": {"projector": "visual.merger.", "vision": "visual.blocks."},
    "qwen2_5_vl": {"projector": "visual.merger.", "vision": "visual.blocks."},
}


@pytest.mark.parametrize("train", ["language", "language+projector", "all"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_train_adapts_the_parts_it_names(tiny_models, family, train):
    import peft

    mode = "qlora" if train == "all" else "lora"  # 4-bit Linears take adapters in the projector and tower too
    try:
        loaded = load_model(ModelConfig(name_or_path=str(tiny_models[family]), mode=mode, train=train),
                            trainable=True, hw=CPU)
    except ModelError as exc:  # Gemma 3's projector is a plain weight matrix: nothing for LoRA to wrap
        assert train == "language+projector" and "has no Linear layer for LoRA to adapt" in str(exc), exc
        return
    import re

    adapted = {n for n, m in loaded.model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    fam = loaded.family
    # Where the parts sit, as the family declares them; for the three first families also as written out by hand.
    projector, vision = (re.compile(rf"(?:^|.*\.){scope}\.") for scope in (fam.projector_scope, fam.vision_scope))
    parts = {"projector": lambda n: bool(projector.match(n)),
             "vision": lambda n: bool(vision.match(n)) and not projector.match(n)}
    if family in PARTS:
        written = PARTS[family]
        parts = {k: (lambda n, k=k, f=f: f(n) and written[k] in n) for k, f in parts.items()}
    in_projector = {n for n in adapted if parts["projector"](n)}
    in_vision = {n for n in adapted if parts["vision"](n)}
    language = adapted - in_projector - in_vision
    import torch.nn as nn

    # The model's Linears: the adapted ones (wrappers now) and the plain ones left (not the adapters' own parts).
    linears = adapted | {n for n, m in loaded.model.named_modules()
                         if isinstance(m, nn.Linear) and "lora_" not in n and "base_layer" not in n}
    assert language and all(loaded.family.language_model_scope in n for n in language)
    has_projector = any(parts["projector"](n) for n in linears)
    assert bool(in_projector) == (train != "language" and has_projector)
    assert bool(in_vision) == (train == "all")
    # Every Linear of the projector and of the vision blocks is adapted when asked: nothing is silently missed.
    if train != "language":
        assert in_projector == {n for n in linears if parts["projector"](n)}
    if train == "all":
        assert in_vision == {n for n in linears if parts["vision"](n)}
    assert loaded.info["train"] == train
    trainable = {n for n, p in loaded.model.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in trainable)


def test_model_train_and_target_modules_do_not_mix():
    with pytest.raises(ValueError, match="model.target_modules .* and model.train .* both choose"):
        ModelConfig(target_modules=["q_proj"], train="all")
    with pytest.raises(ModelError, match="model.train is 'vision'"):
        get_family("idefics3").lora_target(train="vision")


def test_language_default_regex_is_unchanged():
    # Adapters trained before model.train existed keep their target regex (and so their cache keys and names).
    assert get_family("idefics3").lora_target() == r"^(?:.*\.)?text_model\..*\.(?:q_proj|k_proj|v_proj|o_proj|" \
        r"gate_proj|up_proj|down_proj)$"


# ------------------------------------------------------------------------------------------------ Liger
def test_liger_is_never_applied_on_the_cpu(tiny_models):
    from pipeline.model.hardware import resolve_liger

    for value in (True, "auto"):
        applied, why = resolve_liger(ModelConfig(liger=value), CPU)
        assert applied is False and "CPU" in why
    loaded = load_model(ModelConfig(name_or_path=str(tiny_models["idefics3"]), mode="lora", liger=True),
                        trainable=True, hw=CPU)
    assert loaded.info["liger"]["applied"] is False and loaded.info["liger"]["patch"] is None
    # Unpatched: the RMSNorms are still transformers' own classes.
    assert not any("Liger" in type(m).__name__ for m in loaded.model.modules())


def test_liger_on_cuda_needs_the_extra():
    import importlib.util

    from pipeline.model.hardware import resolve_liger

    assert resolve_liger(ModelConfig(liger=False), BF16_GPU) == (False, "model.liger is false")
    if importlib.util.find_spec("liger_kernel") is None:
        applied, why = resolve_liger(ModelConfig(liger="auto"), BF16_GPU)
        assert applied is False and "tamis[liger]" in why
        with pytest.raises(ModelError, match=r"model.liger is true but liger_kernel does not import"):
            resolve_liger(ModelConfig(liger=True), BF16_GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_liger_loss_matches_the_unpatched_model_on_cuda(tiny_models, family):
    """Liger's fused kernels change the arithmetic, not the result: the same batch's loss within bf16 tolerance."""
    pytest.importorskip("liger_kernel")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from pipeline.model.hardware import detect_hardware

    hw = detect_hardware()
    losses = {}
    for liger in (False, True):
        torch.manual_seed(0)
        loaded = load_model(ModelConfig(name_or_path=str(tiny_models[family]), mode="lora", liger=liger),
                            trainable=True, hw=hw)
        assert loaded.info["liger"]["applied"] is liger
        enc = loaded.family.encode(loaded.processor, [Image.new("RGB", (32, 32), (90, 20, 200))],
                                   ["Which digit is shown?"], ["4"])
        enc.pop("answer_start")
        enc = {k: v.cuda() if torch.is_tensor(v) else v for k, v in enc.items()}
        loaded.model.train()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            losses[liger] = float(loaded.model(**enc).loss)
    assert abs(losses[True] - losses[False]) <= 2e-2 * abs(losses[False]), losses


def _mapped_ranges(path) -> list[tuple[int, int]]:
    out = []
    with open("/proc/self/maps", encoding="utf-8") as f:
        for line in f:
            if line.rstrip().endswith(str(path)):
                lo, hi = line.split()[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_4bit_load_lets_the_checkpoint_map_close(tiny_models):
    """No weight of a 4-bit model still points into the memory-mapped checkpoint (whose already-quantized fp32
    pages would otherwise stay resident), and tied weights stay tied."""
    import gc

    loaded = load_model(ModelConfig(name_or_path=str(tiny_models["qwen2_vl"]), mode="qlora"), trainable=True,
                        hw=CPU)
    gc.collect()
    files = list(Path(tiny_models["qwen2_vl"]).glob("*.safetensors"))
    ranges = [r for f in files for r in _mapped_ranges(f.resolve())]
    model = loaded.model
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        ptr = t.untyped_storage().data_ptr()
        assert not any(lo <= ptr < hi for lo, hi in ranges), f"{name} still lives in the checkpoint's map"
    base = model.get_base_model()
    if base.config.get_text_config().tie_word_embeddings:
        assert base.lm_head.weight is base.get_input_embeddings().weight
