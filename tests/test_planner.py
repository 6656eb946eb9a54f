"""Memory planner: weight estimates against real models' footprints, activation terms against autograd's saved
tensors, image-token counts, and the shape of plans (what shrinks with 4-bit and checkpointing)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipeline.errors import ModelError
from pipeline.model.planner import (
    MiB,
    PlanInputs,
    analyze,
    image_token_counts,
    load_model_config,
    lora_targets,
    plan,
    plan_grid,
    plan_table,
    terms_table,
)

ROOT = Path(__file__).resolve().parent.parent
SHAPE_JSON = ROOT / "configs" / "smolvlm-256m-shape.json"
# Widths that bitsandbytes' CPU 4-bit kernels accept (in_features % 64, out_features % 32).
TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512, "tie_word_embeddings": False}


def tiny_config(family: str, text_layers: int = 2, **text: int):
    from transformers import Idefics3Config, Qwen2_5_VLConfig, Qwen2VLConfig

    tc = {**TEXT, **text, "num_hidden_layers": text_layers}
    ids = {"image_token_id": 500, "video_token_id": 501, "vision_start_token_id": 502, "vision_end_token_id": 503}
    head_dim = tc["hidden_size"] // tc["num_attention_heads"]
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, head_dim // 2 - 5]}
    if family == "idefics3":
        return Idefics3Config(text_config={"model_type": "llama", **tc},
                              vision_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                             "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
                              scale_factor=2, image_token_id=500)
    if family == "qwen2_vl":
        return Qwen2VLConfig(text_config={**tc, "rope_parameters": rope},
                             vision_config={"depth": 2, "embed_dim": 64, "hidden_size": tc["hidden_size"],
                                            "num_heads": 2, "mlp_ratio": 2, "patch_size": 8,
                                            "spatial_merge_size": 2, "temporal_patch_size": 2}, **ids)
    return Qwen2_5_VLConfig(text_config={**tc, "rope_parameters": rope},
                            vision_config={"hidden_size": 64, "intermediate_size": 128, "depth": 2, "num_heads": 2,
                                           "out_hidden_size": tc["hidden_size"], "patch_size": 8,
                                           "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 32,
                                           "fullatt_block_indexes": [1]}, **ids)


def _model(config, dtype=torch.float32):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config, dtype=dtype)


def _load_4bit(config, tmp_path: Path):
    from transformers import AutoModelForImageTextToText, BitsAndBytesConfig

    _model(config).save_pretrained(tmp_path)
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)
    return AutoModelForImageTextToText.from_pretrained(tmp_path, quantization_config=bnb, dtype=torch.float32)


def _quant_state_bytes(model) -> int:
    """Bytes of the 4-bit quantization constants, which get_memory_footprint does not count."""
    total = 0
    for mod in model.modules():
        qs = getattr(getattr(mod, "weight", None), "quant_state", None)
        if qs is None:
            continue
        for t in (qs.absmax, qs.code, qs.offset, *((qs.state2.absmax, qs.state2.code) if qs.nested else ())):
            total += 0 if t is None else t.numel() * t.element_size()
    return total


FAMILIES = ("idefics3", "qwen2_vl", "qwen2_5_vl")


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_match_footprint_fp32_and_bf16(family):
    config = tiny_config(family)
    shape = analyze(config)
    model = _model(config)
    assert shape.params == sum(p.numel() for p in model.parameters())
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = model.to(dtype)
        planned = plan(shape, PlanInputs(mode="lora", precision=precision, device="cpu")).weights
        measured = model.get_memory_footprint()
        assert abs(planned - measured) / measured < 0.10, (precision, planned, measured)


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_match_footprint_4bit(family, tmp_path):
    import bitsandbytes as bnb

    config = tiny_config(family)
    model = _load_4bit(config, tmp_path)
    shape = analyze(config)
    p = plan(shape, PlanInputs(mode="qlora", precision="fp32", device="cpu"))
    # The same Linear layers become 4-bit as transformers decides (lm_head and friends stay full precision).
    quantized = {n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert quantized, "nothing was quantized"
    from pipeline.model.planner import _quantized

    assert quantized == {lin.name for lin in shape.linears if _quantized(lin.name, shape.skip_quant)}
    footprint = model.get_memory_footprint()
    stored = p.terms["weights_nf4"] + p.terms["weights_other"]
    assert abs(stored - footprint) / footprint < 0.10, (stored, footprint)
    constants = _quant_state_bytes(model)
    assert abs(p.terms["weights_nf4_constants"] - constants) / constants < 0.10, (p.terms, constants)


def _shape_json(text_layers: int, vision_layers: int):
    data = json.loads(SHAPE_JSON.read_text())
    data["text_config"]["num_hidden_layers"] = text_layers
    data["vision_config"]["num_hidden_layers"] = vision_layers
    return load_model_config(data)


def test_midsize_smolvlm_shape_weights_match_footprint():
    # Full widths of SmolVLM-256M (49k vocabulary, 576/768 hidden), fewer layers so the test runs in seconds.
    config = _shape_json(2, 1)
    model = _model(config)
    planned = plan(config, PlanInputs(mode="lora", precision="fp32", device="cpu")).weights
    measured = model.get_memory_footprint()
    assert abs(planned - measured) / measured < 0.10


@pytest.mark.slow
def test_midsize_smolvlm_shape_4bit_footprint(tmp_path):
    config = _shape_json(4, 2)
    model = _load_4bit(config, tmp_path)
    p = plan(config, PlanInputs(mode="qlora", precision="fp32", device="cpu"))
    footprint = model.get_memory_footprint()
    stored = p.terms["weights_nf4"] + p.terms["weights_other"]
    assert abs(stored - footprint) / footprint < 0.10
    constants = _quant_state_bytes(model)
    assert abs(p.terms["weights_nf4_constants"] - constants) / constants < 0.10


def test_full_smolvlm_shape_has_256m_params():
    shape = analyze(SHAPE_JSON)
    assert 250e6 < shape.params < 262e6
    assert shape.skip_quant == ("lm_head",)
    # The vision encoder's Linears are quantized too: transformers only skips the output embedding by default.
    p = plan(shape, PlanInputs(mode="qlora", device="cuda"))
    assert p.terms["weights_nf4"] > 0.4 * (shape.params - shape.other_params) / 2


# --------------------------------------------------------------------------------------- activations
def _idefics3_batch(config, batch: int, text: int):
    n_img = (config.vision_config.image_size // config.vision_config.patch_size) ** 2 // config.scale_factor**2
    ids = torch.randint(0, 400, (batch, text + n_img))
    ids[:, 2:2 + n_img] = config.image_token_id
    size = config.vision_config.image_size
    return {"input_ids": ids, "labels": ids.clone(), "pixel_values": torch.randn(batch, 1, 3, size, size),
            "pixel_attention_mask": torch.ones(batch, 1, size, size, dtype=torch.bool)}


def _saved_bytes(model, inputs) -> int:
    """Bytes of the tensors autograd keeps for backward (parameters excluded), each storage counted once."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**inputs)
    return sum(seen.values())


@pytest.mark.parametrize(("mode", "dropout"), [("lora", 0.05), ("lora", 0.0), ("full", 0.0)])
def test_per_layer_activations_match_saved_tensors(mode, dropout):
    """One more decoder layer adds what the planner says one layer keeps (fp32, CPU)."""
    from peft import LoraConfig, get_peft_model

    from pipeline.model.families import get_family

    measured, planned = [], []
    for layers in (1, 3):
        config = tiny_config("idefics3", text_layers=layers, hidden_size=128, intermediate_size=384)
        model = _model(config)
        if mode == "lora":
            model = get_peft_model(model, LoraConfig(r=8, lora_dropout=dropout,
                                                     target_modules=get_family("idefics3").lora_target()))
        inputs = _idefics3_batch(config, batch=2, text=48)
        measured.append(_saved_bytes(model, inputs))
        p = plan(config, PlanInputs(mode=mode, batch=2, seq_len=48 - 3, image_size=32, precision="fp32", device="cpu",
                            lora_dropout=dropout))
        planned.append(p.terms["activations"])
    per_layer_measured = (measured[1] - measured[0]) / 2
    per_layer_planned = (planned[1] - planned[0]) / 2
    assert abs(per_layer_planned - per_layer_measured) / per_layer_measured < 0.2, (
        per_layer_planned, per_layer_measured)


def test_vision_activations_count_only_when_the_tower_trains():
    from pipeline.model.families import get_family

    config = tiny_config("idefics3")
    shape = analyze(config)
    text_only = get_family("idefics3").lora_target(["q_proj", "v_proj"])
    lora = plan(shape, PlanInputs(mode="lora", batch=4, image_size=32, precision="fp32", device="cpu",
                                  target_modules=text_only))
    in_vision = lora_targets(shape, ["q_proj", "v_proj"])
    assert any("vision_model" in lin.name for lin in in_vision)
    assert not any("vision_model" in lin.name for lin in lora_targets(shape, None))
    lora_vision = plan(shape, PlanInputs(mode="lora", batch=4, image_size=32, precision="fp32", device="cpu",
                                  target_modules=["q_proj", "v_proj"]))
    assert lora_vision.trainable_params > lora.trainable_params
    assert lora_vision.terms["activations"] > lora.terms["activations"]


# --------------------------------------------------------------------------------------- plan shape
def test_qlora_and_checkpointing_shrink_the_plan():
    shape = analyze(SHAPE_JSON)
    kw = {"batch": 8, "seq_len": 128, "image_size": 512, "precision": "bf16", "device": "cuda"}
    full, lora, qlora = (plan(shape, PlanInputs(mode=m, **kw)) for m in ("full", "lora", "qlora"))
    # Not 4x smaller: the 49k-token embeddings and lm_head stay out of 4-bit and are upcast to fp32.
    assert qlora.weights < 0.7 * lora.weights
    assert qlora.total < lora.total < full.total
    ckpt = plan(shape, PlanInputs(mode="qlora", checkpointing=True, **kw))
    assert ckpt.terms["activations"] < 0.5 * qlora.terms["activations"]
    assert ckpt.terms["weights_nf4"] == qlora.terms["weights_nf4"]
    double = plan(shape, PlanInputs(mode="qlora", **{**kw, "batch": 16}))
    assert 1.8 < double.terms["activations"] / qlora.terms["activations"] < 2.2
    assert double.terms["logits"] == 2 * qlora.terms["logits"]


def test_fits_uses_the_margin():
    shape = analyze(SHAPE_JSON)
    p = plan(shape, PlanInputs(mode="qlora", batch=4, image_size=512, gpu_memory_bytes=10**12))
    assert p.fits is True
    tight = plan(shape, PlanInputs(mode="qlora", batch=4, image_size=512, gpu_memory_bytes=int(p.total / 0.9),
                                   margin=0.85))
    assert tight.fits is False
    assert plan(shape, PlanInputs(mode="qlora", image_size=512)).fits is None


def test_image_token_counts():
    smol = analyze(SHAPE_JSON)
    assert image_token_counts(smol, 512) == (64 + 3, 1024)          # one tile, no splitting
    assert image_token_counts(smol, 1024) == (5 * 67, 5 * 1024)     # 2x2 tiles + the global one
    qwen = analyze(tiny_config("qwen2_vl"))                         # patch 8, merge 2
    assert image_token_counts(qwen, 64) == (64 // 4 + 2, 64)


def test_bad_inputs_are_named(tmp_path):
    # Refused where they are written down, before any model config is read.
    with pytest.raises(ModelError, match="mode 'big'"):
        PlanInputs(mode="big")  # type: ignore[arg-type]
    with pytest.raises(ModelError, match="batch \\(0\\)"):
        PlanInputs(batch=0)
    with pytest.raises(ModelError, match="optimizer 'sgd' is not one of"):
        PlanInputs(optimizer="sgd")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ModelError, match="config.json: not valid JSON"):
        load_model_config(bad)
    nokey = tmp_path / "other.json"
    nokey.write_text("{}")
    with pytest.raises(ModelError, match="no 'model_type'"):
        load_model_config(nokey)
    with pytest.raises(ModelError, match="missing-model"):
        load_model_config(tmp_path / "missing-model")


def test_tables_render():
    from rich.console import Console

    shape = analyze(tiny_config("qwen2_5_vl"))
    plans = plan_grid(shape, PlanInputs(image_size=64, gpu_memory_bytes=900 * MiB, device="cuda"), batches=(1, 64))
    assert len(plans) == 3 * 2 * 2
    assert {p.fits for p in plans} == {True, False}  # the runtime alone takes most of 900 MiB at batch 64
    console = Console(record=True, width=160)
    console.print(plan_table(shape, PlanInputs(image_size=64, gpu_memory_bytes=900 * MiB), batches=(1, 64)))
    console.print(terms_table(plans[0]))
    text = console.export_text()
    assert "qlora" in text and "full" in text and "yes" in text and "no" in text
    assert "weights_nf4_constants" in text and "total" in text
    assert json.dumps(plans[0].as_dict())


# --------------------------------------------------------------------------------------- optimizer choice
@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit", "paged_adamw", "paged_adamw_8bit"])
def test_optimizer_state_matches_the_real_optimizers(optimizer):
    """Full training of a tiny model: the planned Adam state equals what the optimizer really allocates."""
    from pipeline.model.optim import build_optimizer, optimizer_state_bytes

    config = tiny_config("idefics3", hidden_size=128, intermediate_size=256)
    model = _model(config)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(optimizer, params, 1e-3, 0.0)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    measured = optimizer_state_bytes(opt)
    full = PlanInputs(mode="full", precision="fp32", device="cpu", optimizer=optimizer)
    planned = plan(analyze(config), full).optimizer_state
    # The step counters (one scalar per parameter) and per-parameter copies of the shared 8-bit maps are all
    # that differ.
    assert abs(planned - measured) / measured < 0.05, (planned, measured)


def test_8bit_state_is_under_30_percent_and_paged_state_leaves_the_gpu():
    shape = analyze(SHAPE_JSON)
    kw = {"mode": "full", "batch": 1, "seq_len": 64, "image_size": 512}
    adamw = plan(shape, PlanInputs(optimizer="adamw", precision="fp32", device="cpu", **kw))
    eight = plan(shape, PlanInputs(optimizer="adamw_8bit", precision="fp32", device="cpu", **kw))
    assert eight.optimizer_state < 0.30 * adamw.optimizer_state
    assert eight.total < adamw.total
    paged = plan(shape, PlanInputs(optimizer="paged_adamw", precision="bf16", device="cuda", **kw))
    plain = plan(shape, PlanInputs(optimizer="adamw", precision="bf16", device="cuda", **kw))
    # bitsandbytes' 32-bit state is fp32 (8 bytes per bf16 parameter), in unified memory the driver can page out.
    assert "optimizer" not in paged.terms and paged.host_terms["optimizer_paged"] == 2 * plain.terms["optimizer"]
    cpu_paged = plan(shape, PlanInputs(optimizer="paged_adamw", precision="fp32", device="cpu", **kw))
    assert cpu_paged.terms["optimizer"] == adamw.terms["optimizer"] and not cpu_paged.host_terms


def test_the_optimizer_step_can_be_the_peak():
    """On the CPU bitsandbytes' 8-bit step dequantizes the largest tensor's moments to fp32: with checkpointing
    the step then outweighs the backward pass, and the plan says which phase it sized."""
    shape = analyze(SHAPE_JSON)
    kw = {"mode": "full", "batch": 1, "seq_len": 64, "image_size": 512, "precision": "fp32", "device": "cpu"}
    p = plan(shape, PlanInputs(optimizer="adamw_8bit", checkpointing=True, **kw))
    biggest = max(n for _, n in shape.other_param_names)  # the token embeddings
    assert p.phase == "optimizer step" and p.terms["optimizer_step"] == 20 * biggest
    assert "activations" not in p.terms
    assert plan(shape, PlanInputs(optimizer="adamw_8bit", checkpointing=False, **kw)).phase == "backward"


def test_activation_offload_and_liger_count_on_cuda_only():
    shape = analyze(SHAPE_JSON)
    kw = {"mode": "lora", "batch": 8, "seq_len": 128, "image_size": 512}
    gpu = plan(shape, PlanInputs(precision="bf16", device="cuda", **kw))
    off = plan(shape, PlanInputs(precision="bf16", device="cuda", activation_offload=True, **kw))
    assert off.terms["activations"] < 0.5 * gpu.terms["activations"]
    assert off.host_terms["activations_offloaded"] + off.terms["activations"] == gpu.terms["activations"]
    cpu = plan(shape, PlanInputs(precision="fp32", device="cpu", **kw))
    assert plan(shape, PlanInputs(precision="fp32", device="cpu", activation_offload=True, **kw)).terms == cpu.terms
    liger = plan(shape, PlanInputs(precision="bf16", device="cuda", liger=True, **kw))
    assert liger.terms["logits"] < 0.5 * gpu.terms["logits"] and liger.liger
    assert plan(shape, PlanInputs(precision="fp32", device="cpu", liger=True, **kw)).terms == cpu.terms


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("train", ["language", "language+projector", "all"])
def test_planned_targets_are_what_peft_wraps(family, train):
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    from pipeline.model.families import get_family
    from pipeline.model.loading import linear_names

    config = tiny_config(family)
    base = _model(config)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=get_family(family).lora_target(
        train=train, linears=linear_names(base))))
    wrapped = {n.removeprefix("base_model.model.") for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert {lin.name for lin in lora_targets(analyze(config), None, train)} == wrapped
    p = plan(config, PlanInputs(mode="lora", image_size=32, device="cpu", precision="fp32", train=train, lora_r=4))
    assert p.trainable_params == sum(x.numel() for x in model.parameters() if x.requires_grad)


def test_knobs_table_shows_every_alternative():
    from rich.console import Console

    from pipeline.model.knobs import alternatives, knobs_table

    shape = analyze(SHAPE_JSON)
    base = PlanInputs(mode="qlora", batch=4, seq_len=128, image_size=512, checkpointing=False, precision="bf16",
                      optimizer="paged_adamw", activation_offload=False, liger=False, train="language", device="cuda")
    rows = alternatives(shape, base)
    knobs = {(r.knob, r.setting) for r in rows}
    assert {("train.gradient_checkpointing", "on"), ("train.optimizer", "adamw_8bit"), ("model.liger", "on"),
            ("train.activation_offload", "on"), ("model.mode", "full"), ("model.train", "all")} <= knobs
    by = {(r.knob, r.setting): r for r in rows}
    ckpt = by[("train.gradient_checkpointing", "on")]
    assert ckpt.plan.total < rows[0].plan.total and ckpt.flops > rows[0].flops  # saves memory, costs time
    assert by[("model.mode", "full")].flops > rows[0].flops
    console = Console(record=True, width=200)
    console.print(knobs_table(rows, budget=16 << 30))
    text = console.export_text()
    assert "train.activation_offload" in text and "×1.00" in text and "fits" in text
    cpu = {(r.knob, r.setting) for r in alternatives(shape, replace(base, device="cpu", precision="fp32"))}
    assert not any(k in ("model.liger", "train.activation_offload") for k, _ in cpu)


def test_tamis_plan_with_a_project_config_prints_each_knob(tmp_path):
    """`tamis plan -c` as a user runs it: the project's model section and chosen settings become the planner's
    inputs (knobs.plan_inputs), and every single-knob change is planned from them."""
    import os
    import shutil
    import subprocess
    import sys

    import yaml

    (tmp_path / "model").mkdir()
    shutil.copy(SHAPE_JSON, tmp_path / "model" / "config.json")
    config = tmp_path / "tamis.yaml"
    config.write_text(yaml.safe_dump({"model": {"name_or_path": str(tmp_path / "model"), "mode": "qlora"},
                                      "paths": {"artifacts": str(tmp_path / "art")}}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "250", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([str(Path(sys.executable).parent / "tamis"), "plan", "-c", str(config), "--gpu-memory",
                          "16GiB"], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    out = " ".join(res.stdout.split())
    assert "What each knob saves and costs" in out and "qlora, ckpt off" in out
    for knob in ("train.gradient_checkpointing", "train.optimizer", "model.mode", "model.train"):
        assert knob in out, out
