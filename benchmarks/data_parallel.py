"""Data-parallel training on the CPU: per-process peak memory and time of 2 gloo processes vs 1, same effective batch.

The tiny random-weight Idefics3 in 4-bit (the demo's model settings: LoRA rank 64 on vision and text layers) trains
`--steps` optimizer steps of `--effective` samples of real digits through pipeline.model.train.train_adapter, once
with train.num_processes 1 (micro-batch × accumulation 2) and once with 2 (micro-batch × 1 on each rank). Each run is
a fresh subprocess, so every peak is that process's own (VmHWM): the launcher process of the 2-process run holds the
rows and the imports but no model; each rank holds one model, its optimizer and its half of each step. It also
reports the largest difference between the two adapters (same seed: they should agree to float rounding).

    python benchmarks/data_parallel.py --json-out benchmarks/results/data_parallel.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "DO_NOT_TRACK": "1"}.items():
    os.environ.setdefault(_k, _v)


def digit_rows(n: int) -> list[dict]:
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    rows = []
    for i in range(n):
        im = Image.fromarray(np.rint(d.images[i] * 255 / 16).astype(np.uint8)).convert("RGB").resize((32, 32))
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        rows.append({"sample_id": f"d{i}", "prepared": buf.getvalue(), "question": "Which digit is shown in the image?",
                     "answer": str(d.target[i])})
    return rows


def child(args: argparse.Namespace) -> None:
    import torch

    from pipeline.config import parse_config
    from pipeline.model.train import TrainSpec, train_adapter
    from pipeline.model.utilisation import peak_rss_mb

    torch.set_num_threads(args.threads * args.processes)  # the launcher gives each rank threads // processes
    micro = args.effective // 2
    cfg = parse_config({
        "model": {"name_or_path": args.model, "family": "idefics3", "mode": "qlora", "lora_r": 64, "lora_alpha": 128,
                  "lora_dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "fc1",
                                                          "fc2", "proj", "gate_proj", "up_proj", "down_proj"]},
        "train": {"batch_size": micro, "effective_batch_size": args.effective, "max_steps": args.steps,
                  "learning_rate": 0.002, "warmup_ratio": 0.0, "scheduler": "constant",
                  "gradient_checkpointing": False, "num_processes": args.processes},
    })
    res = train_adapter(TrainSpec.of(cfg), digit_rows(args.rows), args.out, progress=False)
    util = res.info["utilisation"]
    ranks = util.get("per_process", {}).get("peak_rss_mb") or [util["peak_rss_mb"]]
    print(json.dumps({
        "processes": args.processes, "settings": res.settings, "seconds": res.info["seconds"],
        "losses": [round(x, 6) for x in res.losses],
        # With 1 process the training runs in this process: its peak is the rank's.
        "rank_peak_rss_mb": ranks, "launcher_peak_rss_mb": peak_rss_mb() if args.processes > 1 else None,
        "adapter": str(res.adapter_dir),
    }))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--effective", type=int, default=8, help="effective batch (even)")
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per training process")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return {}

    import torch
    from safetensors.torch import load_file

    from benchmarks._results import write_result
    from pipeline.model.tiny import make_tiny_model

    started = time.time()
    runs = {}
    with tempfile.TemporaryDirectory(prefix="tamis-dp-") as tmp:
        model = make_tiny_model("idefics3", Path(tmp) / "tiny-idefics3")
        for n in (1, 2):
            cmd = [sys.executable, __file__, "--child", "--processes", str(n), "--model", str(model),
                   "--out", str(Path(tmp) / f"run-{n}"), "--steps", str(args.steps), "--effective",
                   str(args.effective), "--rows", str(args.rows), "--threads", str(args.threads)]
            t0 = time.monotonic()
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ,
                                                                                      "PYTHONPATH": str(ROOT)})
            runs[n] = {**json.loads(out.stdout.strip().splitlines()[-1]),
                       "wall_seconds": round(time.monotonic() - t0, 1)}
        a = load_file(Path(runs[1]["adapter"]) / "adapter_model.safetensors")
        b = load_file(Path(runs[2]["adapter"]) / "adapter_model.safetensors")
        diff = max(float((a[k] - b[k]).abs().max()) for k in a)
        scale = max(float(a[k].abs().max()) for k in a)
    one, two = runs[1], runs[2]
    result = {
        "benchmark": "data_parallel", "device": "cpu", "backend": "gloo", "model": "tiny idefics3, 4-bit NF4, LoRA r64",
        "steps": args.steps, "effective_batch": args.effective, "threads_per_process": args.threads,
        "torch": torch.__version__,
        # seconds: the training loop; wall_seconds: the whole child (imports, spawning the ranks, model loads).
        "one_process": {k: one[k] for k in ("settings", "seconds", "wall_seconds", "rank_peak_rss_mb", "losses")},
        "two_processes": {k: two[k] for k in ("settings", "seconds", "wall_seconds", "rank_peak_rss_mb",
                                              "launcher_peak_rss_mb", "losses")},
        "rank_peak_ratio_2_vs_1": round(max(two["rank_peak_rss_mb"]) / one["rank_peak_rss_mb"][0], 3),
        "total_rss_ratio_2_vs_1": round((sum(two["rank_peak_rss_mb"]) + two["launcher_peak_rss_mb"])
                                        / one["rank_peak_rss_mb"][0], 3),
        "adapter_max_abs_diff": diff, "adapter_max_abs_weight": scale,
        "max_loss_rel_diff": max(abs(x - y) / abs(x) for x, y in zip(one["losses"], two["losses"], strict=True)),
    }
    # A fresh temp folder: nothing reused, every figure measured in this run.
    return write_result(result, args.json_out, started=started, reused_s=0.0,
                        config={k: getattr(args, k) for k in ("steps", "effective", "rows", "threads")})


if __name__ == "__main__":
    main()
