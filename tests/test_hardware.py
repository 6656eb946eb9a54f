"""Hardware detection and adaptive training settings. GPUs are injected as data (a Hardware built here), since
the batch choice is a function of the memory figure, not of a live device."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import ModelConfig, TrainConfig, load_config
from pipeline.model.hardware import (
    GPU,
    SAFETY,
    GiB,
    Hardware,
    choose_precision,
    choose_train_settings,
    detect_hardware,
)
from pipeline.model.planner import PlanInputs, analyze, plan

ROOT = Path(__file__).resolve().parent.parent
SHAPE_JSON = ROOT / "configs" / "smolvlm-256m-shape.json"


def gpu(gib: float, cc: tuple[int, int] = (8, 0)) -> Hardware:
    return Hardware("cuda", [GPU("Injected GPU", int(gib * GiB), cc, cc[0] >= 8)], cpu_count=8, ram_bytes=64 * GiB)


CPU = Hardware("cpu", [], cpu_count=2, ram_bytes=16 * GiB, ram_available_bytes=12 * GiB)
HUB_ONLY = ModelConfig(name_or_path="nobody/not-cached-model")  # no config to plan from, offline


@pytest.fixture(scope="module")
def smol():
    return analyze(SHAPE_JSON)


@pytest.fixture(scope="module")
def qwen2b():
    # Qwen2-VL-2B-Instruct's shape (built on the meta device only).
    from transformers import Qwen2VLConfig

    return analyze(Qwen2VLConfig(
        text_config={"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}},
        vision_config={"depth": 32, "embed_dim": 1280, "hidden_size": 1536, "num_heads": 16, "mlp_ratio": 4,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        tie_word_embeddings=True))


def test_detect_hardware_describes_this_machine():
    import torch

    hw = detect_hardware()
    assert hw.cpu_count >= 1 and hw.ram_bytes > 0 and hw.memory_budget_bytes > 0
    assert hw.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert bool(hw.gpus) == (hw.device == "cuda")
    for g in hw.gpus:
        assert g.total_memory_bytes > 0 and g.compute_capability[0] >= 3
    d = hw.describe()
    assert d["device"] == hw.device and d["ram_gib"] > 0


@pytest.mark.parametrize(("gib", "expected"), [(24, (8, 2, False)), (16, (4, 4, False)), (12, (2, 8, True)),
                                                (6, (1, 16, True))])
def test_tiers_without_a_model_config(gib, expected):
    s = choose_train_settings(TrainConfig(), HUB_ONLY, gpu(gib))
    assert (s.micro_batch, s.grad_accum, s.gradient_checkpointing) == expected
    assert "tier" in s.reason


def test_cpu_is_one_by_sixteen_in_fp32(smol):
    s = choose_train_settings(TrainConfig(), ModelConfig(mode="qlora"), CPU, smol)
    assert (s.micro_batch, s.grad_accum, s.precision, s.quantize) == (1, 16, "fp32", True)
    assert s.gradient_checkpointing is False  # 256M in 4-bit fits easily in 12 GiB of RAM
    assert choose_train_settings(TrainConfig(), HUB_ONLY, CPU).micro_batch == 1


@pytest.mark.parametrize(("gib", "tier_micro"), [(24, 8), (16, 4), (12, 2), (8, 2)])
def test_planner_is_at_least_as_good_as_the_tiers(smol, qwen2b, gib, tier_micro):
    hw = gpu(gib)
    for shape in (smol, qwen2b):
        s = choose_train_settings(TrainConfig(), ModelConfig(mode="qlora"), hw, shape, seq_len=128, image_size=448)
        assert s.micro_batch * s.grad_accum == 16
        assert s.micro_batch >= tier_micro, (shape.model_type, gib, s)
        chosen = plan(shape, PlanInputs(mode="qlora", batch=s.micro_batch, seq_len=128, image_size=448, margin=SAFETY,
                                        checkpointing=s.gradient_checkpointing, gpu_memory_bytes=hw.memory_budget_bytes))
        assert chosen.fits, s.reason
        assert "planner" in s.reason


def test_a_bigger_micro_batch_does_not_fit_where_the_planner_stops(qwen2b):
    hw = gpu(8)
    s = choose_train_settings(TrainConfig(), ModelConfig(mode="qlora"), hw, qwen2b, seq_len=128, image_size=448)
    bigger = [d for d in (2, 4, 8, 16) if d > s.micro_batch]
    for b in bigger:
        p = plan(qwen2b, PlanInputs(mode="qlora", batch=b, seq_len=128, image_size=448, checkpointing=True,
                            gpu_memory_bytes=hw.memory_budget_bytes, margin=SAFETY))
        assert not p.fits


def test_free_memory_not_total_memory_is_the_budget(qwen2b):
    busy = Hardware("cuda", [GPU("Busy GPU", 24 * GiB, (8, 6), True, free_memory_bytes=6 * GiB)])
    idle = gpu(24, (8, 6))
    cfg, mc = TrainConfig(), ModelConfig(mode="qlora")
    assert (choose_train_settings(cfg, mc, busy, qwen2b, image_size=448).micro_batch
            < choose_train_settings(cfg, mc, idle, qwen2b, image_size=448).micro_batch)


def test_explicit_batch_and_checkpointing_are_respected(smol):
    s = choose_train_settings(TrainConfig(batch_size=3, effective_batch_size=16), ModelConfig(), gpu(80), smol)
    assert (s.micro_batch, s.grad_accum) == (3, 6)
    assert "becomes 18" in s.reason
    s = choose_train_settings(TrainConfig(batch_size=2, gradient_checkpointing=True), ModelConfig(), gpu(80), smol)
    assert (s.micro_batch, s.grad_accum, s.gradient_checkpointing) == (2, 8, True)
    s = choose_train_settings(TrainConfig(gradient_checkpointing=False), ModelConfig(), gpu(12), smol)
    assert s.gradient_checkpointing is False and s.micro_batch * s.grad_accum == 16
    s = choose_train_settings(TrainConfig(gradient_checkpointing=True), HUB_ONLY, gpu(40))
    assert (s.micro_batch, s.gradient_checkpointing) == (8, True)


def test_nothing_fits_falls_back_to_one_with_checkpointing_and_says_why(qwen2b):
    s = choose_train_settings(TrainConfig(), ModelConfig(mode="full"), gpu(2), qwen2b, image_size=448)
    assert (s.micro_batch, s.grad_accum, s.gradient_checkpointing) == (1, 16, True)
    assert "does not fit" in s.reason and "model.mode: qlora" in s.reason and "GiB" in s.reason


@pytest.mark.parametrize(("hw", "train", "model", "expected"), [
    (gpu(24, (8, 0)), "auto", "auto", "bf16"),
    (gpu(16, (7, 5)), "auto", "auto", "fp16"),
    (CPU, "auto", "auto", "fp32"),
    (gpu(24, (8, 0)), "fp32", "auto", "fp32"),
    (gpu(24, (8, 0)), "auto", "float16", "fp16"),
])
def test_precision(hw, train, model, expected):
    assert choose_precision(TrainConfig(precision=train), ModelConfig(compute_dtype=model), hw) == expected


def test_model_config_is_read_from_a_local_model_folder(tmp_path):
    import shutil

    shutil.copy(SHAPE_JSON, tmp_path / "config.json")
    s = choose_train_settings(TrainConfig(), ModelConfig(name_or_path=str(tmp_path)), gpu(24))
    assert "planner" in s.reason
    missing = choose_train_settings(TrainConfig(), ModelConfig(name_or_path=str(tmp_path / "absent")), gpu(24))
    assert "tier" in missing.reason


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_yaml_loads(path):
    import yaml

    from pipeline.config import parse_config

    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if "project" in data:  # a benchmark's parameters around an ordinary project config
        cfg = parse_config(data["project"], origin=f"{path}: project", root=ROOT)
    else:
        cfg = load_config(path, root=ROOT)
    assert cfg.model.name_or_path and cfg.train.effective_batch_size >= 1


def test_cli_plan_and_hardware():
    import json

    from typer.testing import CliRunner

    from flows.cli.main import app

    runner = CliRunner()
    res = runner.invoke(app, ["plan", "--model", str(SHAPE_JSON), "--mode", "qlora", "--gpu-memory", "16GiB",
                              "--batch", "4", "--image-size", "512"], env={"COLUMNS": "160"})
    assert res.exit_code == 0, res.output
    assert "weights_nf4" in res.output and "Peak training memory" in res.output and "yes" in res.output
    res = runner.invoke(app, ["hardware", "--json", "-c", str(ROOT / "configs" / "smolvlm-qlora.yaml")])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output[res.output.index("{"):])
    assert out["settings"]["micro_batch"] * out["settings"]["grad_accum"] == 16
    assert out["hardware"]["device"] in ("cpu", "cuda")
