"""benchmarks/gpu_check.py on a machine without a GPU: a clean refusal, and (slow) the --dry-run code paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check as gc_

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_refuses_and_says_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        gc_.main(["--json-out", str(tmp_path / "a.json")])
    assert exit_.value.code == 2
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert written == json.loads((tmp_path / "a.json").read_text()) == json.loads(capsys.readouterr().out)
    assert "no CUDA device" in written["error"] and "--dry-run" in written["error"]


def test_a_failing_section_is_recorded_and_the_run_goes_on():
    out: dict = {}
    deadline = gc_.Deadline(60)
    assert gc_.section(out, "bad", deadline, lambda: 1 / 0) is None
    assert out["bad"]["error"].startswith("ZeroDivisionError") and out["bad"]["traceback"]
    assert gc_.section(out, "good", deadline, lambda: {"x": 1}) == {"x": 1, "seconds": out["good"]["seconds"]}
    gc_.section(out, "late", gc_.Deadline(5), lambda: {"x": 2}, need_s=30)
    assert "time budget" in out["late"]["skipped"]


@pytest.mark.slow
def test_dry_run_exercises_every_section_on_cpu(tmp_path):
    res = gc_.main(["--dry-run", "--models", "smolvlm_256m,qwen2_vl_2b", "--json-out", str(tmp_path / "g.json")])
    assert res["matmul"]["tflops"] > 0 and res["environment"]["device"] == "cpu"
    for name, m in res["models"].items():
        assert not any("error" in v or "skipped" in v for v in m.values()), (name, m)
        sc = m["scoring"]
        # The batched scorer and the naive loop compute the same candidate probabilities, the batched one faster.
        assert sc["max_abs_prob_diff"] < 1e-4 and sc["speedup"] > 1 and 0 < sc["flop_fraction"]
        cases = m["training"]["cases"]
        assert {(c["mode"], c["gradient_checkpointing"]) for c in cases} == {
            (mo, ck) for mo in ("full", "lora", "qlora") for ck in (False, True)}
        assert all("error" not in c and c["steps_per_s"] > 0 and c["planned_mb"] > 0 for c in cases), cases
        assert m["load_4bit"]["quantized"] is True
    # The 2-process training path, once, on 2 gloo processes: the same losses as 1 process, a peak per process.
    dp = res["models"]["smolvlm_256m"]["data_parallel"]
    assert dp["max_loss_rel_diff"] < 1e-4 and len(dp["processes_2"]["peak_per_process"]["peak_rss_mb"]) == 2
