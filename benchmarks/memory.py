"""Peak memory of one training step per mode × gradient checkpointing × optimizer, next to the planner's estimate.

One random-weight model of the SmolVLM-256M shape (configs/smolvlm-256m-shape.json), saved once; then each case
runs in a fresh subprocess (its own RSS high-water mark): load as pipeline.model.loading does (4-bit NF4 + LoRA for
qlora, with the checkpoint's memory map released; LoRA on the language model; full), build the optimizer with
pipeline.model.train.build_optimizer, create its state with one step on zero gradients (the gradients stay
allocated, as in gradient accumulation), then one measured step on a synthetic batch (one 512 px tile, text
tokens, loss on the answer half). The peak is taken per phase (forward, backward, optimizer step) and the case's
peak is the largest.

On the CPU the peak is the child's VmHWM (fp32 compute), reset after loading and between phases with
/proc/self/clear_refs, so loading does not hide the step; on CUDA it is torch.cuda.max_memory_allocated (bf16).
RSS counts resident pages, not tensors: it includes the imported libraries (the planner's `runtime` term). The
child fixes glibc's mmap threshold as CPU training does (pipeline.model.hardware.bound_cpu_allocator), so freed
activations leave RSS at once. The measured step is the first of its process (kernel set-up included).

Activation offload and Liger are CUDA features (a documented no-op / never applied on the CPU): the grid adds them
only on a CUDA device. Cases can be chosen with --cases (mode:ckpt:optimizer, comma-separated); each case row
carries the planner's estimate and its error, and the summary the headline ratios.

    nice -n 10 python benchmarks/memory.py --json-out benchmarks/results/memory.json
    python benchmarks/memory.py --quick    # 6 text / 2 vision layers, shorter text: a quick look
    python benchmarks/memory.py --replan benchmarks/results/memory.json   # planner columns only, no measuring

The per-process peak of data-parallel training (train.num_processes 2 vs 1) is benchmarks/data_parallel.py's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
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
# The grid, most informative first (a run out of --budget-s time skips the tail): the optimizer matters for full
# training (its state is 8 bytes per parameter); for LoRA it changes a few MB, so fewer pairs are measured there.
GRID = [
    ("full", "adamw"), ("full", "adamw_8bit"), ("lora", "adamw"), ("qlora", "adamw"),
    ("qlora", "paged_adamw_8bit"), ("full", "paged_adamw_8bit"), ("full", "paged_adamw"), ("lora", "adamw_8bit"),
]


def _config(args: argparse.Namespace):
    from pipeline.model.planner import load_model_config

    cfg = load_model_config(Path(args.config))
    if args.text_layers:
        cfg.text_config.num_hidden_layers = args.text_layers
    if args.vision_layers:
        cfg.vision_config.num_hidden_layers = args.vision_layers
    return cfg


def _status_mb() -> dict[str, float]:
    out = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) / 1024
    return out


def _reset_rss_peak() -> None:
    import ctypes

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the OS, so the phase starts from what is live
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def run_case(args: argparse.Namespace) -> dict:
    """In the child: load, create the optimizer state, one measured step. Returns one JSON-able dict."""
    import torch
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForImageTextToText

    from pipeline.config import ModelConfig
    from pipeline.model.families import get_family
    from pipeline.model.hardware import Hardware
    from pipeline.model.loading import build_bnb_config, build_lora_config, release_checkpoint_map
    from pipeline.model.optim import build_optimizer, optimizer_state_bytes
    from pipeline.model.train import _enable_activation_checkpointing

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    if not cuda:
        from pipeline.model.hardware import bound_cpu_allocator

        bound_cpu_allocator()  # as pipeline.model.train does on the CPU: RSS tracks live tensors
    dtype = torch.bfloat16 if cuda else torch.float32
    hw = Hardware("cuda" if cuda else "cpu")
    model_cfg = ModelConfig(name_or_path=args.model_dir, mode=args.mode, lora_r=args.lora_r, lora_alpha=2 * args.lora_r,
                            compute_dtype="bfloat16" if cuda else "float32")
    kwargs: dict = {"dtype": dtype, "attn_implementation": "sdpa"}
    bnb = build_bnb_config(model_cfg, hw)
    if bnb is not None:
        kwargs["quantization_config"] = bnb
    if cuda:
        kwargs["device_map"] = {"": 0}
    model = AutoModelForImageTextToText.from_pretrained(args.model_dir, **kwargs)
    if bnb is not None:
        release_checkpoint_map(model)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if args.mode in ("lora", "qlora"):
        model = get_peft_model(model, build_lora_config(model_cfg, get_family("idefics3")))
    if args.ckpt:
        _enable_activation_checkpointing(model)
    model.config.use_cache = False
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(args.optimizer, params, 1e-5, 0.0)
    # The optimizer's state, created by a step on zero gradients; the gradients stay allocated (zeroed, not freed)
    # as they are for every micro-batch after the first of an accumulating step.
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    state_bytes = optimizer_state_bytes(opt)

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

    def reset() -> float:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated() / MiB
        _reset_rss_peak()
        return _status_mb()["VmRSS"]

    def peak() -> float:
        if cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / MiB
        return _status_mb()["VmHWM"]

    before = reset()
    status = {} if cuda else _status_mb()
    t0 = time.perf_counter()
    loss = model(input_ids=ids, pixel_values=pixels, pixel_attention_mask=pmask, labels=labels).loss
    phases = {"forward": peak()}
    loss.backward()
    phases["backward"] = peak()
    del loss
    step_start = reset()
    t1 = time.perf_counter()
    opt.step()
    phases["optimizer_step"] = peak()
    seconds = time.perf_counter() - t0
    return {"peak_mb": round(max(phases.values()), 1), "before_step_mb": round(before, 1),
            "phase_peak_mb": {k: round(v, 1) for k, v in phases.items()},
            "peak_phase": max(phases, key=phases.get), "optimizer_step_start_mb": round(step_start, 1),
            "rss_anon_mb": round(status["RssAnon"], 1) if status else None,
            "rss_file_mb": round(status["RssFile"], 1) if status else None,
            "step_seconds": round(seconds, 2), "optimizer_step_seconds": round(time.perf_counter() - t1, 2),
            "optimizer_state_mb": round(state_bytes / MiB, 1), "trainable_params": sum(p.numel() for p in params),
            "measure": "torch.cuda.max_memory_allocated" if cuda else "VmHWM, reset after loading and per phase"}


def _summary(cases: list[dict]) -> dict:
    def case(mode: str, ckpt: bool, optimizer: str = "adamw") -> dict | None:
        return next((c for c in cases if c["mode"] == mode and c["gradient_checkpointing"] == ckpt
                     and c["optimizer"] == optimizer and "peak_mb" in c), None)

    def ratio(a: dict | None, b: dict | None, key: str = "peak_mb") -> float | None:
        return None if a is None or b is None else round(a[key] / b[key], 3)

    modes = dict.fromkeys(c["mode"] for c in cases)
    saving = {m: ratio(case(m, True), case(m, False)) for m in modes}
    errors = [c["planned_error"] for c in cases if c.get("planned_error") is not None]
    full8 = case("full", False, "adamw_8bit")
    return {
        "qlora_over_full": ratio(case("qlora", False), case("full", False)),
        "qlora_over_full_8bit": ratio(case("qlora", False), full8),
        "checkpointing_saving": {m: None if r is None else round(1 - r, 3) for m, r in saving.items()},
        "optimizer_state_ratio_8bit": ratio(full8, case("full", False), "optimizer_state_mb"),
        "optimizer_8bit_peak_saving": None if ratio(full8, case("full", False)) is None
        else round(1 - ratio(full8, case("full", False)), 3),
        "planner_max_abs_error": max((abs(e) for e in errors), default=None),
        "planner_within_15_percent": bool(errors) and all(abs(e) <= 0.15 for e in errors),
    }


def _add_plan(case: dict, shape, args: argparse.Namespace, device: str, image_size: int):
    from pipeline.model.planner import RUNTIME_BYTES, PlanInputs, plan

    p = plan(shape, PlanInputs(
        mode=case["mode"], batch=args.batch, seq_len=args.seq_len, image_size=image_size, lora_r=args.lora_r,
        checkpointing=case["gradient_checkpointing"], optimizer=case["optimizer"],
        precision="bf16" if device == "cuda" else "fp32", device=device))
    # max_memory_allocated excludes the CUDA context; RSS includes the Python/torch runtime.
    planned = p.total - (RUNTIME_BYTES["cuda"] if device == "cuda" else 0)
    case["planned_mb"] = round(planned / MiB, 1)
    case["planned_phase"] = p.phase
    case["planned_terms_mb"] = {k: round(v / MiB, 1) for k, v in p.terms.items()}
    case["planned_optimizer_state_mb"] = round(p.optimizer_state / MiB, 1)
    if "peak_mb" in case:
        case["planned_error"] = round((planned / MiB - case["peak_mb"]) / case["peak_mb"], 3)
    return p


def _cases(args: argparse.Namespace) -> list[tuple[str, bool, str]]:
    if args.cases:
        out = []
        for item in args.cases.split(","):
            mode, ckpt, opt = item.split(":")
            out.append((mode, ckpt in ("1", "on", "true"), opt))
        return out
    modes = args.modes.split(",")
    return [(m, c, o) for m, o in GRID if m in modes for c in (False, True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "smolvlm-256m-shape.json"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=64, help="text tokens per sample (image tokens are added)")
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text-layers", type=int, default=0, help="override the layer count (0 = the config's)")
    ap.add_argument("--vision-layers", type=int, default=0)
    ap.add_argument("--modes", default="full,lora,qlora")
    ap.add_argument("--cases", default="", help="mode:ckpt:optimizer,... instead of the grid (ckpt 0/1)")
    ap.add_argument("--budget-s", type=float, default=2700, help="skip the remaining cases after this many seconds")
    ap.add_argument("--quick", action="store_true", help="6 text / 2 vision layers, 32 text tokens")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--replan", type=Path, help="recompute the planner columns of this result JSON (same shape flags)")
    ap.add_argument("--note", default="", help="a sentence recorded with a merged result (how it was measured)")
    ap.add_argument("--merge", type=Path, nargs="+", help="combine the cases of these result JSONs (same model, batch "
                    "and text length; the first measurement of a case wins) and recompute the planner columns")
    # Internal: one case in a child process.
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--optimizer", default="adamw", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.text_layers, args.vision_layers = args.text_layers or 6, args.vision_layers or 2
        args.seq_len = 32
    if args.child:
        print(json.dumps(run_case(args)))
        return
    from benchmarks._results import write_result
    from pipeline.model.planner import analyze

    started = time.time()
    if args.merge:
        # Runs of parts of the grid (a shared machine cannot run all of it in one sitting): each case keeps the
        # commit and wall time of the run that measured it.
        parts = [json.loads(path.read_text()) for path in args.merge]
        first = parts[0]
        for part in parts[1:]:
            if (part["batch"], part["seq_len"], part["model"]) != (first["batch"], first["seq_len"], first["model"]):
                raise SystemExit(f"--merge: {part['model']}, batch {part['batch']}, text {part['seq_len']} differs "
                                 f"from {first['model']}, batch {first['batch']}, text {first['seq_len']}")
        cases, seen = [], set()
        for part in parts:
            for case in part["cases"]:
                key = (case["mode"], case["gradient_checkpointing"], case["optimizer"])
                if key in seen or "peak_mb" not in case:
                    continue
                seen.add(key)
                cases.append({**case, "measured_commit": case.get("measured_commit") or part.get("commit")})
        merged = {**{k: first.get(k) for k in ("device", "model", "batch", "seq_len", "image_tokens", "measured",
                                               "config")},
                  "cases": cases, "measured_commits": sorted({c["measured_commit"] for c in cases if
                                                              c["measured_commit"]}),
                  "measured_wall_s": sum(p.get("wall_s") or 0 for p in parts), "note": args.note or None}
        tmp = Path(tempfile.mkdtemp()) / "merged.json"
        tmp.write_text(json.dumps(merged))
        args.replan = tmp
    if args.replan:
        # Planner changed, measurements did not: recompute planned_* in an earlier result without re-measuring.
        out = json.loads(args.replan.read_text())
        args.batch, args.seq_len = out["batch"], out["seq_len"]
        args.text_layers, args.vision_layers = out["model"]["text_layers"], out["model"]["vision_layers"]
        cfg = _config(args)
        shape = analyze(cfg)
        device = "cpu" if out["device"] == "cpu" else "cuda"
        for case in out["cases"]:
            _add_plan(case, shape, args, device, cfg.vision_config.image_size)
        keep = {k: out[k] for k in ("device", "model", "batch", "seq_len", "image_tokens", "cases", "measured",
                                    "note") if k in out}
        # The measurements belong to the commit that took them; write_result records the replanning one.
        keep["measured_commit"] = out.get("measured_commit") or out.get("commit")
        if "measured_commits" in out:
            keep["measured_commits"] = out["measured_commits"]
        keep["measured_wall_s"] = out.get("measured_wall_s") or out.get("wall_s")
        write_result({**keep, **_summary(out["cases"]), "replanned": True}, args.json_out or args.replan,
                     config=out.get("config"), started=started, code_versions=out.get("measured_commits"))
        return

    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = _config(args)
    shape = analyze(cfg)
    cases = []
    image_tokens = None
    with tempfile.TemporaryDirectory(prefix="tamis-membench-") as tmp:
        from transformers import AutoModelForImageTextToText

        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(cfg)
        model.save_pretrained(tmp)  # fp32 random weights; every child loads the same ones
        del model
        for mode, ckpt, optimizer in _cases(args):
            case: dict = {"mode": mode, "gradient_checkpointing": ckpt, "optimizer": optimizer,
                          "activation_offload": False, "liger": False}
            if time.time() - started > args.budget_s:
                case["skipped"] = f"time budget of {args.budget_s:.0f} s spent"
                cases.append(case)
                continue
            cmd = [sys.executable, __file__, "--child", "--mode", mode, "--ckpt", str(int(ckpt)),
                   "--optimizer", optimizer, "--model-dir", tmp, "--device", device, "--batch", str(args.batch),
                   "--seq-len", str(args.seq_len), "--lora-r", str(args.lora_r), "--threads", str(args.threads),
                   "--config", args.config]
            t0 = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-3000:])
                case["error"] = f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
            else:
                case.update(json.loads(proc.stdout.strip().splitlines()[-1]))
            case["case_seconds"] = round(time.time() - t0, 1)
            p = _add_plan(case, shape, args, device, cfg.vision_config.image_size)
            image_tokens = p.image_tokens
            cases.append(case)
            print(json.dumps(case), file=sys.stderr, flush=True)

    out = {
        "device": device if device == "cpu" else torch.cuda.get_device_name(0),
        "model": {"config": str(Path(args.config).relative_to(ROOT) if Path(args.config).is_relative_to(ROOT)
                                else args.config),
                  "params": shape.params, "text_layers": shape.text.layers,
                  "vision_layers": shape.vision.layers if shape.vision else 0},
        "batch": args.batch, "seq_len": args.seq_len, "image_tokens": image_tokens,
        "measured": "CPU: peak RSS (VmHWM) of one step, fp32; activation offload and Liger are CUDA-only"
        if device == "cpu" else "CUDA: torch.cuda.max_memory_allocated of one step, bf16",
        "cases": cases,
        **_summary(cases),
    }
    config = {k: getattr(args, k) for k in ("batch", "seq_len", "lora_r", "threads", "text_layers",
                                            "vision_layers", "modes", "cases")}
    config["config"] = out["model"]["config"]  # relative to the repository, not this machine's path
    out["config"] = config
    write_result(out, args.json_out, config=config, started=started)


if __name__ == "__main__":
    main()
