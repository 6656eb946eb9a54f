"""Data-parallel training on the CPU with gloo: batch arithmetic, the collectives, and (slow) 2 ranks vs 1 process."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from test_model_train import adapter_weights, digit_rows, make_cfg

from pipeline.errors import ConfigError, ModelError
from pipeline.model.distributed import free_port, launch, launched_rank, shard
from pipeline.model.hardware import GPU, Hardware, choose_train_settings, resolve_num_processes
from pipeline.model.train import TrainSpec, step_indices, train_adapter
from pipeline.store import VERIFIED_NAME

GiB = 1 << 30
CPU = Hardware("cpu", [], 2, 24 * GiB, 20 * GiB)


def gpus(*free_gib: float) -> Hardware:
    return Hardware("cuda", [GPU(f"gpu{i}", 24 * GiB, (8, 6), True, int(f * GiB)) for i, f in enumerate(free_gib)],
                    16, 64 * GiB, 60 * GiB)


# ----------------------------------------------------------------------------------------- pure parts
def test_each_rank_takes_a_contiguous_share_of_the_step():
    idx = step_indices(3, 10, 4, seed=0)
    parts = [shard(idx, r, 2) for r in range(2)]
    assert parts[0] + parts[1] == idx and len(parts[0]) == 2
    with pytest.raises(ValueError, match="4 samples per step do not split evenly over 3 processes"):
        shard(idx, 0, 3)


def test_num_processes_auto_is_the_visible_gpus():
    assert resolve_num_processes("auto", CPU) == 1
    assert resolve_num_processes("auto", gpus(20, 20, 20, 20)) == 4
    assert resolve_num_processes(2, CPU) == 2  # gloo processes on the CPU
    with pytest.raises(ConfigError, match="train.num_processes is 3 but 2 GPU"):
        resolve_num_processes(3, gpus(20, 20))


def test_effective_batch_is_kept_across_processes():
    from pipeline.config import ModelConfig, TrainConfig

    one = choose_train_settings(TrainConfig(batch_size=2, effective_batch_size=16), ModelConfig(), gpus(20))
    four = choose_train_settings(TrainConfig(batch_size=2, effective_batch_size=16), ModelConfig(), gpus(20, 20, 20, 20),
                                 num_processes=4)
    assert (one.micro_batch, one.grad_accum, one.num_processes) == (2, 8, 1)
    assert (four.micro_batch, four.grad_accum, four.num_processes) == (2, 2, 4)
    assert one.effective_batch == four.effective_batch == 16
    assert "× 4 processes = effective batch 16" in four.reason
    # A per-device micro-batch larger than a device's share is lowered to the share: the effective batch stays.
    demo = choose_train_settings(TrainConfig(batch_size=8, effective_batch_size=8), ModelConfig(), CPU, num_processes=2)
    assert (demo.micro_batch, demo.grad_accum, demo.effective_batch) == (4, 1, 8)
    # Not a multiple: rounded up (as for train.batch_size), never silently smaller.
    odd = choose_train_settings(TrainConfig(batch_size=1, effective_batch_size=10), ModelConfig(), gpus(20, 20, 20),
                                num_processes=3)
    assert odd.effective_batch == 12


def test_plan_is_per_device_on_the_least_free_gpu():
    from pipeline.config import ModelConfig, TrainConfig
    from pipeline.model.planner import analyze

    shape = analyze(Path(__file__).resolve().parent.parent / "configs" / "smolvlm-256m-shape.json")
    cfg, mc = TrainConfig(effective_batch_size=16), ModelConfig(mode="qlora")
    idle = choose_train_settings(cfg, mc, gpus(20, 20), shape, num_processes=2, image_size=512)
    busy = choose_train_settings(cfg, mc, gpus(20, 1.5), shape, num_processes=2, image_size=512)
    assert idle.effective_batch == busy.effective_batch == 16
    assert busy.micro_batch < idle.micro_batch
    assert gpus(20, 1.5).process_budget_bytes(2) == int(1.5 * GiB)
    assert CPU.process_budget_bytes(2) == CPU.ram_available_bytes // 2


# ------------------------------------------------------------------------- the collectives, 2 real ranks
def _collectives_rank(out: str, queue) -> None:
    """Each rank: a linear layer's gradient on its half of a batch, summed → compared with the whole batch's."""
    from pipeline.model.distributed import init_rank
    from pipeline.model.train import _checkpoints, _save_checkpoint

    rank = launched_rank()
    comm, _ = init_rank(rank, "cpu")
    torch.manual_seed(100 + rank.rank)  # different starts: broadcast_ must make them rank 0's
    layer = torch.nn.Linear(3, 2)
    unused = torch.nn.Parameter(torch.ones(2))  # no rank gives it a gradient: it must stay None
    comm.broadcast_(list(layer.parameters()))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)
    whole = torch.nn.Linear(3, 2)
    whole.load_state_dict(layer.state_dict())
    ((whole(x) - y) ** 2).sum().backward()
    part = slice(4 * rank.rank, 4 * rank.rank + 4)
    ((layer(x[part]) - y[part]) ** 2).sum().backward()
    comm.sum_grads([*layer.parameters(), unused])
    opt = torch.optim.AdamW(layer.parameters())
    opt.step()
    _save_checkpoint(Path(out), 1, layer, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), None,
                     {"fingerprint": "x"}, comm)
    queue.put({"rank": rank.rank,
               "grad_err": max(float((a.grad - b.grad).abs().max()) for a, b in zip(layer.parameters(),
                                                                                   whole.parameters(), strict=True)),
               "unused_grad_is_none": unused.grad is None, "weight0": float(layer.weight.flatten()[0]),
               "checkpoints": [p.name for _, p in _checkpoints(Path(out))],
               "sum": comm.sum([rank.rank + 1.0])[0], "any": comm.any(rank.rank == 1)})


def test_two_gloo_ranks_sum_gradients_and_only_rank0_writes(tmp_path):
    msgs = sorted(launch(_collectives_rank, (str(tmp_path),), 2), key=lambda m: m["rank"])
    assert [m["rank"] for m in msgs] == [0, 1]
    for m in msgs:
        assert m["grad_err"] < 1e-5 and m["unused_grad_is_none"]
        assert m["sum"] == 3.0 and m["any"] is True
        assert m["checkpoints"] == ["step-1"]
    assert msgs[0]["weight0"] == msgs[1]["weight0"]  # same start, same summed step
    ckpt = tmp_path / "checkpoints" / "step-1"
    assert sorted(p.name for p in ckpt.iterdir()) == ["optimizer.json", "optimizer.safetensors", "rng.safetensors",
                                                      "state.json", "trainable.safetensors"]
    from safetensors.torch import load_file

    assert sorted(load_file(ckpt / "rng.safetensors")) == ["cpu.rank0", "cpu.rank1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]  # nothing else, from no rank


def _failing_rank(queue) -> None:
    if launched_rank().rank == 1:
        raise ConfigError("rank 1 found a bad field")


def test_a_rank_error_reaches_the_caller_as_itself():
    with pytest.raises(ConfigError, match="rank 1 found a bad field"):
        launch(_failing_rank, (), 2)


# ------------------------------------------------------------------------- training, 2 ranks vs 1 (slow)
class KillRank:
    """oom_hook that SIGKILLs one rank before a micro-batch of the given step (picklable for the spawned ranks)."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def __call__(self, step: int, micro: int) -> None:
        r = launched_rank()
        if r is not None and r.rank == self.rank and step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture(scope="module")
def rows():
    return digit_rows(8)


def assert_same_adapter(a, b, rtol=1e-4, atol=1e-6):
    wa, wb = adapter_weights(a), adapter_weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=rtol, atol=atol)


@pytest.mark.slow
def test_two_processes_equal_one_with_the_same_effective_batch(tiny_models, rows, tmp_path):
    # 1 process: micro-batch 2 × accumulation 2; 2 processes: micro-batch 2 each; effective batch 4 in both.
    one_cfg = make_cfg(tiny_models["idefics3"], "qlora", batch_size=2, effective_batch_size=4, max_steps=4)
    two_cfg = make_cfg(tiny_models["idefics3"], "qlora", batch_size=2, effective_batch_size=4, max_steps=4,
                       num_processes=2)
    one = train_adapter(TrainSpec.of(one_cfg), rows, tmp_path / "one", progress=False)
    two = train_adapter(TrainSpec.of(two_cfg), rows, tmp_path / "two", progress=False)
    assert two.finished and two.info["num_processes"] == 2
    assert (two.settings["micro_batch"], two.settings["grad_accum"], two.settings["num_processes"]) == (2, 1, 2)
    assert one.losses[-1] < one.losses[0]
    np.testing.assert_allclose(two.losses, one.losses, rtol=1e-4)
    assert_same_adapter(one, two)
    # One set of outputs, written once: the same files as the one-process run, and no leftover checkpoints. The
    # parent verified the manifest rank 0 wrote, so its folder also holds the verification cache, which is no output.
    listing = lambda d: sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.name != VERIFIED_NAME)  # noqa: E731
    assert listing(tmp_path / "two") == listing(tmp_path / "one")
    assert len(two.info["utilisation"]["per_process"]["peak_rss_mb"]) == 2
    # The manifest matches: a second call returns at once without spawning.
    again = train_adapter(TrainSpec.of(two_cfg), rows, tmp_path / "two", progress=False)
    assert again.manifest is not None and again.losses == two.losses


@pytest.mark.slow
def test_sigkill_of_one_rank_then_resume_matches_uninterrupted(tiny_models, rows, tmp_path):
    cfg = make_cfg(tiny_models["idefics3"], "qlora", batch_size=1, effective_batch_size=4, max_steps=5,
                   checkpoint_every=2, num_processes=2)
    cfg.model.lora_dropout = 0.1  # each rank's restored RNG state must replay its own dropout masks
    whole = train_adapter(TrainSpec.of(cfg), rows, tmp_path / "whole", progress=False)
    out = tmp_path / "killed"
    with pytest.raises(ModelError, match=r"training process 1 of 2 failed \(killed by SIGKILL\)"):
        train_adapter(TrainSpec.of(cfg), rows, out, progress=False, oom_hook=KillRank(rank=1, step=3))
    assert not (out / "adapter").exists() and not (out / "manifest.json").exists()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-2"]
    resumed = train_adapter(TrainSpec.of(cfg), rows, out, progress=False)
    assert resumed.info["resumed_from_step"] == 2
    np.testing.assert_allclose(resumed.losses, whole.losses, rtol=1e-5)
    assert_same_adapter(whole, resumed, rtol=1e-5)


@pytest.mark.slow
def test_two_process_checkpoint_resumes_in_one_process(tiny_models, rows, tmp_path):
    """A run stopped on 2 processes continues on 1 (the same effective batch): the step order is the step's alone."""
    two = make_cfg(tiny_models["idefics3"], "qlora", batch_size=2, effective_batch_size=4, max_steps=4,
                   checkpoint_every=2, num_processes=2)
    part = train_adapter(TrainSpec.of(two), rows, tmp_path / "run", progress=False, stop_after_steps=2)
    assert not part.finished and part.steps == 2 and len(part.losses) == 2
    one = make_cfg(tiny_models["idefics3"], "qlora", batch_size=2, effective_batch_size=4, max_steps=4,
                   checkpoint_every=2)
    resumed = train_adapter(TrainSpec.of(one), rows, tmp_path / "run", progress=False)
    whole = train_adapter(TrainSpec.of(one), rows, tmp_path / "whole", progress=False)
    assert resumed.info["resumed_from_step"] == 2 and resumed.info["num_processes"] == 1
    np.testing.assert_allclose(resumed.losses, whole.losses, rtol=1e-4)
    assert_same_adapter(whole, resumed)


def test_spawned_ranks_need_picklable_hooks(tiny_models, rows, tmp_path):
    cfg = make_cfg(tiny_models["idefics3"], "qlora", max_steps=1, num_processes=2)
    with pytest.raises(ModelError, match="on_step must be picklable"):
        train_adapter(TrainSpec.of(cfg), rows, tmp_path / "x", progress=False, on_step=lambda s, _total, loss: None)


def test_planner_adds_the_allreduce_buffer_per_device():
    from pipeline.model.planner import PlanInputs, analyze, plan

    shape = analyze(Path(__file__).resolve().parent.parent / "configs" / "smolvlm-256m-shape.json")
    one = plan(shape, PlanInputs(mode="full", batch=2, image_size=512))
    four = plan(shape, PlanInputs(mode="full", batch=2, image_size=512, processes=4))
    assert "gradient_allreduce" not in one.terms and four.terms["gradient_allreduce"] == four.terms["gradients"]
    assert four.total == one.total + four.terms["gradients"] and four.as_dict()["processes"] == 4


@pytest.mark.slow
def test_tamis_train_under_a_launcher_joins_as_each_rank(tiny_models, rows, tmp_path):
    """A launcher runs `tamis train` twice; train_adapter joins as each rank (no spawn). On GPUs `accelerate launch
    --multi_gpu` is torchrun (torch.distributed.run) underneath; its CPU mode needs MPI, so torchrun stands in here:
    the same RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR contract, read by accelerate's PartialState."""
    import json
    import subprocess
    import sys

    from datasets import Dataset

    from pipeline.store import read_manifest

    cfg = make_cfg(tiny_models["idefics3"], "qlora", batch_size=2, effective_batch_size=4, max_steps=3)
    one = train_adapter(TrainSpec.of(cfg), rows, tmp_path / "one", progress=False)
    (tmp_path / "cfg.yaml").write_text(cfg.to_yaml())
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "labeled"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "OMP_NUM_THREADS": "1"}
    tamis = str(Path(sys.executable).parent / "tamis")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
                          "--master_addr", "127.0.0.1", "--master_port", str(free_port()), tamis, "train",
                          "-c", str(tmp_path / "cfg.yaml"), "--dataset", str(tmp_path / "labeled"),
                          "--out", str(tmp_path / "two")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    printed = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(printed) == 1 and printed[0]["num_processes"] == 2 and printed[0]["steps"] == 3  # rank 0 only
    m = read_manifest(tmp_path / "two")  # written once, by rank 0, and valid
    assert m.info["num_processes"] == 2
    np.testing.assert_allclose(m.info["losses"], one.losses, rtol=1e-4)
    two = train_adapter(TrainSpec.of(cfg), rows, tmp_path / "two", progress=False)  # the same key: reused, nothing trains
    assert two.manifest is not None and two.info["num_processes"] == 2
    assert_same_adapter(one, two)


LAUNCHER = """
import json, sys
from pipeline.config import parse_config
from pipeline.model.train import TrainSpec, train_adapter
cfg = parse_config(json.loads(open(sys.argv[1]).read()))
rows = json.loads(open(sys.argv[2]).read())
for r in rows:
    r["prepared"] = bytes.fromhex(r["prepared"])
if __name__ == "__main__":
    train_adapter(TrainSpec.of(cfg), rows, sys.argv[3], progress=False)
"""


@pytest.mark.slow
def test_ranks_die_with_a_killed_launcher_and_the_rerun_resumes(tiny_models, rows, tmp_path):
    """The round flow's process is SIGKILLed mid-training: its ranks must not live on (they would keep writing
    checkpoints into the folder the re-run resumes from). torch's spawn wrapper sets PR_SET_PDEATHSIG (SIGINT) for
    them. The launcher starts with SIGINT ignored, as under `nohup tamis run &` or any background job: the ranks
    inherited that, the death signal did nothing, and they trained on to the end (the adapter was there after the
    kill) until each rank restored SIGINT's handler."""
    import json
    import subprocess
    import sys
    import time

    import psutil

    # 400 steps, and the poll waits for any checkpoint (training keeps only the last KEEP_CHECKPOINTS, so step-2
    # alone can come and go between two polls): the kill lands mid-training.
    cfg = make_cfg(tiny_models["idefics3"], "qlora", batch_size=2, effective_batch_size=4, max_steps=400,
                   checkpoint_every=2, num_processes=2)
    (tmp_path / "cfg.json").write_text(json.dumps(cfg.model_dump(mode="json")))
    (tmp_path / "rows.json").write_text(json.dumps([{**r, "prepared": r["prepared"].hex()} for r in rows]))
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    child = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"), str(tmp_path / "cfg.json"),
                              str(tmp_path / "rows.json"), str(out)], env=env,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.monotonic() + 300
    while not any((out / "checkpoints").glob("step-*")):
        assert child.poll() is None, "the launcher exited before the first checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.1)
    ranks = [p for p in psutil.Process(child.pid).children() if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(ranks) == 2
    child.send_signal(signal.SIGKILL)
    child.wait()
    _, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive, "training ranks outlived their killed launcher"
    assert not (out / "adapter").exists()
    resumed = train_adapter(TrainSpec.of(cfg), rows, out, progress=False)
    assert resumed.finished and resumed.info["resumed_from_step"] >= 2
