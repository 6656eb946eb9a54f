"""Training on tiny checkpoints: which weights move, the loss falls, resume, OOM recovery, warm starts, bad rows."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from pipeline.config import parse_config
from pipeline.errors import DataError, ModelError
from pipeline.model.loading import load_model
from pipeline.model.optim import build_optimizer, optimizer_state, optimizer_state_bytes, optimizer_tensors
from pipeline.model.train import (
    TrainSpec,
    _enable_activation_checkpointing,
    _optimizer_step,
    step_indices,
    train_adapter,
)
from pipeline.store import read_manifest

QUESTION = "Which digit is shown in the image?"


def digit_rows(n: int, classes: int = 4) -> list[dict]:
    """Real handwritten digits (scikit-learn's bundled 8x8 set) upscaled to 32 px, as prepared PNG rows."""
    from sklearn.datasets import load_digits

    d = load_digits()
    picked = [i for i in range(len(d.target)) if d.target[i] < classes][:n]
    rows = []
    for i in picked:
        im = Image.fromarray(np.rint(d.images[i] * 255 / 16).astype(np.uint8)).convert("RGB").resize((32, 32))
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        rows.append({"sample_id": f"d{i}", "prepared": buf.getvalue(), "question": QUESTION,
                     "answer": str(d.target[i])})
    return rows


def make_cfg(model_dir: Path, mode: str = "lora", **train) -> object:
    base = {"batch_size": 2, "effective_batch_size": 4, "max_steps": 4, "learning_rate": 0.01,
            "warmup_ratio": 0.0, "scheduler": "constant", "gradient_checkpointing": False, "checkpoint_every": 2}
    return parse_config({"model": {"name_or_path": str(model_dir), "mode": mode, "lora_dropout": 0.0},
                         "train": {**base, **train}})


def adapter_weights(result) -> dict[str, torch.Tensor]:
    return load_file(result.adapter_dir / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def rows():
    return digit_rows(8)


@pytest.fixture(scope="module")
def trained(tiny_models, rows, tmp_path_factory):
    """One finished lora run on a fixed batch (every step sees the same 4 rows)."""
    cfg = make_cfg(tiny_models["idefics3"], "qlora", batch_size=4, max_steps=5)
    out = tmp_path_factory.mktemp("train") / "run"
    return cfg, train_adapter(TrainSpec.of(cfg), rows[:4], out, progress=False)


# ------------------------------------------------------------------------------------------ what moves
@pytest.mark.parametrize("family,mode", [
    ("idefics3", "qlora"), ("qwen2_vl", "qlora"), ("qwen2_5_vl", "qlora"), ("qwen2_vl", "lora"), ("idefics3", "full"),
])
def test_training_steps_change_only_trainable_weights(tiny_models, rows, family, mode):
    cfg = make_cfg(tiny_models[family], mode)
    loaded = load_model(cfg.model, trainable=True)
    model = loaded.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    # Two steps: LoRA's B starts at zero, so A only receives a gradient from the second step on.
    for step in range(2):
        _optimizer_step(model, loaded.processor, loaded.family, rows, [0], 1, torch.device("cpu"), "cpu",
                        "fp32", opt, None, 1.0, step, None)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed == trainable
    if mode != "full":
        assert all("lora_" in n for n in changed)


# ------------------------------------------------------------------------------------- loss and outputs
def test_loss_falls_and_adapter_is_recorded(trained):
    cfg, result = trained
    assert result.finished and result.steps == 5 == len(result.losses)
    assert result.losses[-1] < 0.5 * result.losses[0], result.losses
    m = read_manifest(result.out_dir)  # verifies the adapter against its recorded digest
    assert m.stage == "train" and "adapter" in m.outputs
    assert m.info["settings"]["micro_batch"] == 4 and m.info["losses"] == result.losses
    assert (result.adapter_dir / "adapter_config.json").is_file()
    assert not (result.out_dir / "checkpoints").exists()


def test_finished_training_is_reused(trained, rows):
    cfg, result = trained
    calls = []
    again = train_adapter(TrainSpec.of(cfg), rows[:4], result.out_dir, progress=False, on_step=lambda s, _total, loss: calls.append(s))
    assert calls == [] and again.losses == result.losses
    assert again.manifest.outputs["adapter"].digest == read_manifest(result.out_dir).outputs["adapter"].digest


def test_trained_adapter_loads_for_inference(trained, rows):
    cfg, result = trained
    tuned = load_model(cfg.model, adapter=result.adapter_dir)
    base = load_model(cfg.model)
    assert not tuned.model.training and tuned.info["trainable_params"] == 0
    # MC dropout at scoring time switches these on; they must exist (lora_dropout > 0 in real configs).
    assert any("lora_dropout" in n for n, _ in tuned.model.named_modules())
    image = Image.open(io.BytesIO(rows[0]["prepared"]))
    enc = tuned.family.encode(tuned.processor, [image], [QUESTION])
    with torch.no_grad():
        p_tuned = tuned.model(**enc).logits[0, -1].softmax(-1)
        p_base = base.model(**enc).logits[0, -1].softmax(-1)
    answer = tuned.family.answer_token_ids(tuned.processor, QUESTION, rows[0]["answer"])[0]
    assert p_tuned[answer] > p_base[answer]


def test_warm_start_continues_from_previous_adapter(trained, rows, tmp_path):
    cfg, first = trained
    warm_cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"init": "warm", "max_steps": 1})})
    fresh_cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps": 1})})
    warm = train_adapter(TrainSpec.of(warm_cfg), rows[:4], tmp_path / "warm", init_adapter=first.adapter_dir, progress=False)
    fresh = train_adapter(TrainSpec.of(fresh_cfg), rows[:4], tmp_path / "fresh", init_adapter=first.adapter_dir, progress=False)
    assert warm.losses[0] < 0.5 * fresh.losses[0]  # fresh ignores init_adapter: init is "fresh"
    assert read_manifest(warm.out_dir).inputs["init_adapter"] != ""
    assert read_manifest(fresh.out_dir).inputs["init_adapter"] == ""


def test_full_mode_saves_a_loadable_model(tiny_models, rows, tmp_path):
    cfg = make_cfg(tiny_models["qwen2_vl"], "full", max_steps=1)
    result = train_adapter(TrainSpec.of(cfg), rows, tmp_path / "full", progress=False)
    assert (result.adapter_dir / "config.json").is_file()
    reloaded = load_model(cfg.model, adapter=result.adapter_dir)
    assert reloaded.info["source"] == str(result.adapter_dir)


# ------------------------------------------------------------------------------------------------ resume
def test_activation_checkpointing_is_enabled_without_a_deprecation_warning(tiny_models):
    import warnings

    model = load_model(make_cfg(tiny_models["idefics3"], "lora").model, trainable=True).model
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers 5's gradient_checkpointing_enable warns
        _enable_activation_checkpointing(model)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_resume_after_interruption_matches_uninterrupted(tiny_models, rows, tmp_path):
    # Dropout on: the restored RNG state must reproduce the same dropout masks after resuming.
    # Gradient checkpointing on as well: recomputed forwards must replay the same dropout masks.
    cfg = make_cfg(tiny_models["qwen2_vl"], "lora", max_steps=4, effective_batch_size=2, gradient_checkpointing=True)
    cfg.model.lora_dropout = 0.1
    whole = train_adapter(TrainSpec.of(cfg), rows, tmp_path / "whole", progress=False)

    part = train_adapter(TrainSpec.of(cfg), rows, tmp_path / "resumed", progress=False, stop_after_steps=3)
    assert not part.finished and part.steps == 3
    ckpt = tmp_path / "resumed" / "checkpoints" / "step-2"
    assert sorted(p.suffix for p in ckpt.iterdir()) == [".json", ".json", ".safetensors", ".safetensors",
                                                         ".safetensors"]
    calls = []
    resumed = train_adapter(TrainSpec.of(cfg), rows, tmp_path / "resumed", progress=False, on_step=lambda s, _total, _: calls.append(s))
    assert calls == [3, 4]  # continued after the step-2 checkpoint; step 3 is redone
    np.testing.assert_allclose(resumed.losses, whole.losses, rtol=1e-5)
    a, b = adapter_weights(whole), adapter_weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_stale_checkpoints_of_other_rows_are_not_resumed(tiny_models, rows, tmp_path):
    cfg = make_cfg(tiny_models["qwen2_vl"], "lora", max_steps=2, checkpoint_every=1, effective_batch_size=2)
    train_adapter(TrainSpec.of(cfg), rows, tmp_path / "run", progress=False, stop_after_steps=1)
    calls = []
    train_adapter(TrainSpec.of(cfg), rows[:6], tmp_path / "run", progress=False, on_step=lambda s, _total, _: calls.append(s))
    assert calls == [1, 2]


def test_the_progress_bar_counts_the_loops_own_steps(tiny_models, rows, tmp_path):
    """An effective batch of 3 in micro-batches of 2 trains batches of 4 (2 × 2 accumulated): one epoch of 8 rows is
    2 steps, not the 3 that the configured effective batch gives. The Prefect UI's bar reads the loop's total, so it
    ends at step 2 / 2, 100 % (it stopped at 2 / 3 when the stage counted the steps itself)."""
    from pipeline.report import StepReporter

    cfg = make_cfg(tiny_models["idefics3"], "qlora", batch_size=2, effective_batch_size=3, max_steps=None, epochs=1.0)
    reports, opened = [], []
    reporter = StepReporter(lambda total: opened.append(total) or (lambda p, text: reports.append((p, text))))
    result = train_adapter(TrainSpec.of(cfg), rows, tmp_path / "run", progress=False, on_step=reporter)
    assert result.steps == 2 and opened == [2]
    assert reports[-1][0] == 100.0 and reports[-1][1].startswith("step 2 / 2"), reports


# ----------------------------------------------------------------------------------------- OOM recovery
def test_oom_halves_micro_batch_and_keeps_the_effective_batch(tiny_models, rows, tmp_path):
    cfg = make_cfg(tiny_models["qwen2_vl"], "lora", max_steps=3, effective_batch_size=2)
    clean = train_adapter(TrainSpec.of(cfg), rows, tmp_path / "clean", progress=False)
    seen = []

    def oom_once(step: int, micro: int) -> None:
        seen.append((step, micro))
        if step == 1 and micro == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")

    recovered = train_adapter(TrainSpec.of(cfg), rows, tmp_path / "oom", progress=False, oom_hook=oom_once)
    assert recovered.info["ooms"] == [{"step": 1, "micro_batch": 1, "grad_accum": 2}]
    assert recovered.settings["micro_batch"] == 1 and recovered.settings["grad_accum"] == 2
    assert (1, 1) in seen and (2, 1) in seen
    # Same samples per step and the loss is averaged over the step's tokens, so the split does not matter.
    np.testing.assert_allclose(recovered.losses, clean.losses, rtol=1e-4)


def test_oom_at_micro_batch_one_gives_up_clearly(tiny_models, rows, tmp_path):
    cfg = make_cfg(tiny_models["idefics3"], "lora", max_steps=2)

    def always(step: int, micro: int) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")

    with pytest.raises(ModelError, match="out of GPU memory at step 0 even with micro-batch 1"):
        train_adapter(TrainSpec.of(cfg), rows, tmp_path / "oom", progress=False, oom_hook=always)


# --------------------------------------------------------------------------------------------- inputs
def test_step_indices_cover_each_epoch_and_depend_only_on_the_step():
    n, eff = 10, 4
    stream = [i for s in range(5) for i in step_indices(s, n, eff, seed=3)]
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
    assert step_indices(2, n, eff, seed=3) == stream[8:12]
    assert step_indices(0, n, eff, seed=4) != step_indices(0, n, eff, seed=3)


def test_bad_rows_are_reported(tiny_models, rows, tmp_path):
    cfg = make_cfg(tiny_models["idefics3"], "lora", max_steps=1)
    with pytest.raises(DataError, match="no labeled rows"):
        train_adapter(TrainSpec.of(cfg), [], tmp_path / "a", progress=False)
    unlabeled = [dict(rows[0]), {**rows[1], "answer": None}]
    with pytest.raises(DataError, match=r"training row 1 \(sample d\d+\): field 'answer' is None"):
        train_adapter(TrainSpec.of(cfg), unlabeled, tmp_path / "b", progress=False)
    broken = [{**r, "prepared": b"not a png"} for r in rows[:4]]
    with pytest.raises(DataError, match=r"sample d\d+\): image bytes do not decode"):
        train_adapter(TrainSpec.of(cfg), broken, tmp_path / "c", progress=False)


# ------------------------------------------------------------------------------------- kill and resume
CHILD = """
import json, sys, time
from pipeline.config import parse_config
from pipeline.model.train import TrainSpec, train_adapter
cfg = parse_config(json.loads(sys.argv[1]))
rows = json.loads(open(sys.argv[2]).read())
for r in rows:
    r["prepared"] = bytes.fromhex(r["prepared"])
train_adapter(TrainSpec.of(cfg), rows, sys.argv[3], progress=False, on_step=lambda s, _total, loss: time.sleep(0.5))
"""


@pytest.mark.slow
def test_sigkill_between_steps_then_resume_matches(tiny_models, rows, tmp_path):
    cfg = make_cfg(tiny_models["idefics3"], "qlora", max_steps=6, checkpoint_every=2)
    cfg.model.lora_dropout = 0.1
    whole = train_adapter(TrainSpec.of(cfg), rows, tmp_path / "whole", progress=False)

    rows_file = tmp_path / "rows.json"
    rows_file.write_text(json.dumps([{**r, "prepared": r["prepared"].hex()} for r in rows]))
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(cfg.model_dump(mode="json")), str(rows_file),
                              str(out)], env=env)
    deadline = time.monotonic() + 300
    while not (out / "checkpoints" / "step-2").is_dir():
        assert child.poll() is None, "the training child exited before its first checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.1)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not (out / "adapter").exists()

    calls = []
    resumed = train_adapter(TrainSpec.of(cfg), rows, out, progress=False, on_step=lambda s, _total, _: calls.append(s))
    assert calls[0] in (3, 5) and calls[-1] == 6
    np.testing.assert_allclose(resumed.losses, whole.losses, rtol=1e-5)
    a, b = adapter_weights(whole), adapter_weights(resumed)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ optimizers
OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw", "paged_adamw_8bit")


def _flat_state(opt) -> dict[str, torch.Tensor]:
    tensors, meta = optimizer_tensors(opt)
    return {**tensors, **{k: torch.tensor(v) for k, v in meta["scalars"].items()}}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_state_round_trips_exactly_through_safetensors(name, tmp_path):
    """Save (safetensors + JSON), restore into a fresh optimizer: identical state, identical next steps."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    shapes = [(64, 128), (96, 64), (10,)]  # the first two take 8-bit state, the small one keeps fp32 state

    def params():
        g = torch.Generator().manual_seed(1)
        return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]

    def grads(step):
        g = torch.Generator().manual_seed(100 + step)
        return [torch.randn(*s, generator=g) for s in shapes]

    a = params()
    opt_a = build_optimizer(name, a, 1e-2, 0.01)
    for step in range(3):
        for p, g in zip(a, grads(step), strict=True):
            p.grad = g
        opt_a.step()
    tensors, meta = optimizer_tensors(opt_a)
    if name.endswith("8bit"):
        assert any(t.dtype == torch.uint8 for t in tensors.values()), "8-bit state is stored as uint8"
    save_file(tensors, tmp_path / "optimizer.safetensors")
    (tmp_path / "optimizer.json").write_text(json.dumps(meta))
    from safetensors.torch import load_file

    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = build_optimizer(name, b, 1e-2, 0.01)
    opt_b.load_state_dict(optimizer_state(load_file(tmp_path / "optimizer.safetensors"),
                                           json.loads((tmp_path / "optimizer.json").read_text())))
    sa, sb = _flat_state(opt_a), _flat_state(opt_b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    for step in range(3, 5):
        for pa, pb, g in zip(a, b, grads(step), strict=True):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(a, b, strict=True):
        assert torch.equal(pa, pb)


def test_8bit_state_is_about_a_quarter_of_adamw():
    ps = [torch.nn.Parameter(torch.randn(256, 256)) for _ in range(4)]
    sizes = {}
    for name in ("adamw", "adamw_8bit"):
        opt = build_optimizer(name, ps, 1e-3, 0.0)
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
        sizes[name] = optimizer_state_bytes(opt)
    # uint8 moments + one fp32 absmax per 256 values (+ the quantization maps): ~2 bytes per value vs 8.
    assert 0.24 < sizes["adamw_8bit"] / sizes["adamw"] < 0.30, sizes


def test_full_training_resumes_exactly_with_8bit_state(tiny_models, rows, tmp_path):
    """model.mode full with the 8-bit optimizer: stopped after 3 steps and resumed from the step-2 checkpoint, the
    run ends with the same losses and weights as one that ran through."""
    cfg = make_cfg(tiny_models["idefics3"], "full", max_steps=4, effective_batch_size=2, optimizer="adamw_8bit",
                   learning_rate=1e-3)
    whole = train_adapter(TrainSpec.of(cfg), rows, tmp_path / "whole", progress=False)
    assert whole.settings["optimizer"] == "adamw_8bit" and whole.info["optimizer_state_mb"] > 0

    part = train_adapter(TrainSpec.of(cfg), rows, tmp_path / "resumed", progress=False, stop_after_steps=3)
    ckpt = tmp_path / "resumed" / "checkpoints" / "step-2"
    saved = load_file(ckpt / "optimizer.safetensors")
    assert any(t.dtype == torch.uint8 for t in saved.values())
    assert json.loads((ckpt / "state.json").read_text())["optimizer"] == "adamw_8bit"
    assert not part.finished
    resumed = train_adapter(TrainSpec.of(cfg), rows, tmp_path / "resumed", progress=False)
    assert resumed.info["resumed_from_step"] == 2
    assert resumed.losses == whole.losses
    a = load_file(whole.adapter_dir / "model.safetensors")
    b = load_file(resumed.adapter_dir / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_checkpoints_of_another_optimizer_are_not_resumed(tiny_models, rows, tmp_path):
    cfg = make_cfg(tiny_models["qwen2_vl"], "lora", max_steps=2, checkpoint_every=1, effective_batch_size=2)
    train_adapter(TrainSpec.of(cfg), rows, tmp_path / "run", progress=False, stop_after_steps=1)
    other = cfg.model_copy(update={"train": cfg.train.model_copy(update={"optimizer": "adamw_8bit"})})
    calls = []
    train_adapter(TrainSpec.of(other), rows, tmp_path / "run", progress=False, on_step=lambda s, _total, _: calls.append(s))
    assert calls == [1, 2]


def test_default_optimizer_follows_the_mode():
    from pipeline.model.hardware import GPU, Hardware, resolve_optimizer

    cpu, gpu = Hardware("cpu"), Hardware("cuda", [GPU("A100", 40 << 30, (8, 0), True)])
    picks = {(mode, hw.device): resolve_optimizer(make_cfg(Path("m"), mode).train, make_cfg(Path("m"), mode).model, hw)
             for mode in ("full", "lora", "qlora") for hw in (cpu, gpu)}
    assert picks == {("full", "cpu"): "adamw_8bit", ("full", "cuda"): "adamw_8bit", ("lora", "cpu"): "adamw",
                     ("lora", "cuda"): "adamw", ("qlora", "cpu"): "adamw", ("qlora", "cuda"): "paged_adamw"}
    explicit = make_cfg(Path("m"), "full", optimizer="paged_adamw_8bit")
    assert resolve_optimizer(explicit.train, explicit.model, cpu) == "paged_adamw_8bit"


def test_activation_offload_is_a_no_op_on_the_cpu(caplog):
    from pipeline.model.hardware import GPU, Hardware, choose_train_settings

    cfg = make_cfg(Path("m"), "lora", activation_offload=True)
    with caplog.at_level("INFO", logger="pipeline.model.hardware"):
        cpu = choose_train_settings(cfg.train, cfg.model, Hardware("cpu"))
    assert cpu.activation_offload is False
    assert "no-op on the CPU" in caplog.text
    gpu = choose_train_settings(cfg.train, cfg.model, Hardware("cuda", [GPU("A100", 40 << 30, (8, 0), True)]))
    assert gpu.activation_offload is True


@pytest.mark.parametrize("train", ["language+projector", "all"])
def test_training_the_projector_and_tower_moves_their_adapters(tiny_models, rows, tmp_path, train):
    """model.train end to end with a bitsandbytes optimizer: the loss falls and the projector's (and the tower's)
    adapters are trained and saved."""
    cfg = make_cfg(tiny_models["qwen2_vl"], "qlora", batch_size=4, effective_batch_size=4, max_steps=5,
                   optimizer="paged_adamw_8bit")
    cfg.model.train = train
    result = train_adapter(TrainSpec.of(cfg), rows[:4], tmp_path / "run", progress=False)
    assert result.losses[-1] < 0.7 * result.losses[0], result.losses
    weights = adapter_weights(result)
    merger = [k for k in weights if "visual.merger" in k and "lora_B" in k]
    blocks = [k for k in weights if "visual.blocks" in k and "lora_B" in k]
    assert merger and all(weights[k].abs().sum() > 0 for k in merger)  # B starts at zero: non-zero means trained
    assert bool(blocks) == (train == "all")
    assert all(weights[k].abs().sum() > 0 for k in blocks)
