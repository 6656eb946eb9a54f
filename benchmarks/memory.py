"""Peak memory of one training step, full vs lora vs qlora, with and without gradient checkpointing, next to the planner.

One random-weight model of the SmolVLM-256M shape (configs/smolvlm-256m-shape.json), saved once, then each case
runs in a fresh subprocess: load (4-bit for qlora), a warm-up optimizer step on a synthetic batch (one image, text
tokens), then the measured step, with the gradients and AdamW states of the warm-up alive as in gradient accumulation. On CUDA the peak is torch.cuda.max_memory_allocated (bf16 compute); on CPU it is the child's
peak RSS (fp32 compute), with the high-water mark reset after loading (Linux /proc/self/clear_refs) so that loading
does not hide the step. The planner's prediction for the same case is printed beside it.

How far to trust CPU RSS: it counts resident pages, not tensors. It includes the imported libraries (~0.85 GB),
memory glibc keeps after frees, and file pages of the memory-mapped checkpoint; a 4-bit model quantized while loading
from an fp32 checkpoint keeps ~0.7 GB of such residue. `step_mb` (peak minus the resident size before the measured
step) isolates what the step itself adds and is the better figure to compare across modes.

    python benchmarks/memory.py --json-out benchmarks/results/memory.json
    python benchmarks/memory.py --quick    # fewer layers, shorter text: a quick look

The per-process peak of data-parallel training (train.num_processes 2 vs 1) is benchmarks/data_parallel.py's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
MiB = 1 << 20
MODES = ("full", "lora", "qlora")


def _config(args: argparse.Namespace):
    from pipeline.model.planner import load_model_config

    cfg = load_model_config(Path(args.config))
    if args.text_layers:
        cfg.text_config.num_hidden_layers = args.text_layers
    if args.vision_layers:
        cfg.vision_config.num_hidden_layers = args.vision_layers
    return cfg


def _rss_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_case(args: argparse.Namespace) -> dict:
    """In the child: load, one step, peak memory. Prints one JSON line."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForImageTextToText, BitsAndBytesConfig

    from pipeline.model.families import get_family

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    kwargs: dict = {"dtype": dtype, "attn_implementation": "sdpa"}
    if args.mode == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
    if cuda:
        kwargs["device_map"] = {"": 0}
    model = AutoModelForImageTextToText.from_pretrained(args.model_dir, **kwargs)
    if args.mode == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if args.mode in ("lora", "qlora"):
        for p in model.parameters():
            p.requires_grad_(False)
        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.05,
                                                 target_modules=get_family("idefics3").lora_target(),
                                                 task_type="CAUSAL_LM"))
    if args.ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    cfg = model.config
    tile = cfg.vision_config.image_size
    n_img = (tile // cfg.vision_config.patch_size) ** 2 // cfg.scale_factor**2
    device = "cuda" if cuda else "cpu"
    ids = torch.randint(10, 1000, (args.batch, args.seq_len + n_img), device=device)
    ids[:, 4:4 + n_img] = cfg.image_token_id
    labels = ids.clone()
    labels[:, : 4 + n_img + args.seq_len // 2] = -100  # loss on the answer part only, as training does
    pixels = torch.randn(args.batch, 1, 3, tile, tile, device=device, dtype=dtype)
    pmask = torch.ones(args.batch, 1, tile, tile, dtype=torch.bool, device=device)

    def step() -> float:
        loss = model(input_ids=ids, pixel_values=pixels, pixel_attention_mask=pmask, labels=labels).loss
        loss.backward()
        opt.step()
        # Keep the (zeroed) gradients: the next micro-batch of an accumulating step runs with them alive.
        opt.zero_grad(set_to_none=False)
        return float(loss)

    # A warm-up step creates AdamW's states; the measured one then holds weights, gradients, optimizer states,
    # activations and logits at once, as every micro-batch after the first of a training step does.
    step()
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        reset = _reset_rss_peak()
        base = _rss_peak_mb() * MiB
    t0 = time.perf_counter()
    loss = step()
    seconds = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / MiB
        how = "torch.cuda.max_memory_allocated"
    else:
        peak = _rss_peak_mb()
        how = "ru_maxrss after clear_refs reset" if reset else "ru_maxrss (includes loading)"
    return {"peak_mb": round(peak, 1), "before_step_mb": round(base / MiB, 1), "step_seconds": round(seconds, 2),
            "loss": round(loss, 4), "measure": how}


def _summary(cases: list[dict]) -> dict:
    def case(mode: str, ckpt: bool) -> dict | None:
        return next((c for c in cases if c["mode"] == mode and c["gradient_checkpointing"] == ckpt), None)

    def ratio(a: dict | None, b: dict | None, key) -> float | None:
        return None if a is None or b is None else round(key(a) / key(b), 3)

    def step(c: dict) -> float:  # what the step adds over weights, gradients, optimizer states and runtime
        return c["peak_mb"] - c["before_step_mb"]

    modes = dict.fromkeys(c["mode"] for c in cases)
    saving = {m: ratio(case(m, True), case(m, False), lambda c: c["peak_mb"]) for m in modes}
    act_saving = {m: ratio(case(m, True), case(m, False), step) for m in modes}
    return {
        "qlora_over_full": ratio(case("qlora", False), case("full", False), lambda c: c["peak_mb"]),
        "checkpointing_saving": {m: None if r is None else round(1 - r, 3) for m, r in saving.items()},
        "checkpointing_activation_saving": {m: None if r is None else round(1 - r, 3) for m, r in act_saving.items()},
    }


def _add_plan(case: dict, shape, args: argparse.Namespace, device: str, image_size: int):
    from pipeline.model.planner import RUNTIME_BYTES, plan

    p = plan(shape, mode=case["mode"], batch=args.batch, seq_len=args.seq_len, image_size=image_size,
             lora_r=args.lora_r, checkpointing=case["gradient_checkpointing"],
             precision="bf16" if device == "cuda" else "fp32", device=device)
    # max_memory_allocated excludes the CUDA context; RSS includes the Python/torch runtime.
    planned = p.total - (RUNTIME_BYTES["cuda"] if device == "cuda" else 0)
    case["planned_mb"] = round(planned / MiB, 1)
    case["planned_terms_mb"] = {k: round(v / MiB, 1) for k, v in p.terms.items()}
    case["planned_error"] = round((planned / MiB - case["peak_mb"]) / case["peak_mb"], 3)
    # The dynamic part alone: what the step adds over the memory held before it, measured and planned.
    dynamic = ("activations", "logits", "dequant_buffer")
    planned_step = sum(p.terms.get(k, 0) for k in dynamic) + p.terms["runtime"] - RUNTIME_BYTES[device]
    case["step_mb"] = round(case["peak_mb"] - case["before_step_mb"], 1)
    case["planned_step_mb"] = round(planned_step / MiB, 1)
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "smolvlm-256m-shape.json"))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64, help="text tokens per sample (image tokens are added)")
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text-layers", type=int, default=0, help="override the layer count (0 = the config's)")
    ap.add_argument("--vision-layers", type=int, default=0)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--quick", action="store_true", help="6 text / 2 vision layers, 32 text tokens, batch 1")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--replan", type=Path, help="recompute the planner columns of this result JSON (same shape flags)")
    # Internal: one case in a child process.
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.text_layers, args.vision_layers = args.text_layers or 6, args.vision_layers or 2
        args.seq_len, args.batch = 32, 1
    if args.child:
        print(json.dumps(run_case(args)))
        return
    if args.replan:
        # Planner changed, measurements did not: recompute planned_* in an earlier result without re-measuring.
        from pipeline.model.planner import analyze
        from pipeline.store import atomic_write_json

        out = json.loads(args.replan.read_text())
        args.batch, args.seq_len = out["batch"], out["seq_len"]
        args.text_layers, args.vision_layers = out["model"]["text_layers"], out["model"]["vision_layers"]
        cfg = _config(args)
        shape = analyze(cfg)
        device = "cpu" if out["device"] == "cpu" else "cuda"
        for case in out["cases"]:
            _add_plan(case, shape, args, device, cfg.vision_config.image_size)
        out.update(_summary(out["cases"]))
        print(json.dumps(out, indent=2))
        atomic_write_json(args.json_out or args.replan, out)
        return

    import torch

    from pipeline.model.planner import analyze
    from pipeline.store import atomic_write_json

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = _config(args)
    shape = analyze(cfg)
    cases = []
    with tempfile.TemporaryDirectory(prefix="tamis-membench-") as tmp:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_config(cfg)
        model.save_pretrained(tmp)  # fp32 random weights; every child loads the same ones
        del model
        for mode in args.modes.split(","):
            for ckpt in (False, True):
                cmd = [sys.executable, __file__, "--child", "--mode", mode, "--ckpt", str(int(ckpt)),
                       "--model-dir", tmp, "--device", device, "--batch", str(args.batch),
                       "--seq-len", str(args.seq_len), "--lora-r", str(args.lora_r),
                       "--threads", str(args.threads), "--config", args.config]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    sys.stderr.write(proc.stderr[-3000:])
                    raise SystemExit(f"case {mode} ckpt={ckpt} failed (exit {proc.returncode})")
                measured = json.loads(proc.stdout.strip().splitlines()[-1])
                case = {"mode": mode, "gradient_checkpointing": ckpt, **measured}
                p = _add_plan(case, shape, args, device, cfg.vision_config.image_size)
                cases.append(case)
                print(json.dumps(case), file=sys.stderr)

    out = {
        "device": device if device == "cpu" else torch.cuda.get_device_name(0),
        "model": {"config": str(Path(args.config).relative_to(ROOT) if Path(args.config).is_relative_to(ROOT)
                                else args.config),
                  "params": shape.params, "text_layers": shape.text.layers,
                  "vision_layers": shape.vision.layers if shape.vision else 0},
        "batch": args.batch, "seq_len": args.seq_len, "image_tokens": p.image_tokens,
        "cases": cases,
        **_summary(cases),
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.json_out:
        atomic_write_json(args.json_out, out)


if __name__ == "__main__":
    main()
