"""GPU check: what tamis does on one CUDA GPU (written for the H200 machine), in one run of under 8 minutes.

For a SmolVLM-256M-shaped and a Qwen2-VL-2B-shaped random-weight model (configs/smolvlm-256m-shape.json and the
Qwen2-VL-2B-Instruct shape below; the tokenizer is tamis' tiny offline one, the processors use each model's real
image geometry), it prints one JSON with:
- environment: GPU, memory, versions; the measured bf16 matmul rate (8192³, CUDA events);
- load_4bit: time and footprint of an NF4 load through pipeline.model.loading.load_model;
- scoring: pool scoring samples/s with the batched ClosedSetScorer vs the naive loop (one forward per sample and
  candidate), their largest probability difference, and the batched throughput as a fraction of the FLOP limit
  (2 × params × tokens per sample at the measured bf16 matmul rate; also a text/vision split of the same estimate);
- training: peak memory (torch.cuda.max_memory_allocated) and steps/s per mode (full / lora / qlora) × gradient
  checkpointing off / on, plus the knobs (full with adamw_8bit, qlora with paged_adamw_8bit, qlora with activation
  offload, lora with Liger when liger_kernel is installed), next to pipeline.model.planner's estimate and its error;
- data_parallel: qlora training through pipeline.model.train with train.num_processes 2 vs 1 at the same effective
  batch (per-process peak memory, seconds, loss agreement) when the machine has ≥ 2 CUDA devices; otherwise recorded
  as not measured. In --dry-run it runs 2 gloo processes on the CPU.
Every section fails soft (its error is recorded and the rest runs); sections are skipped once --budget-s is spent.
The JSON goes to stdout, to --json-out, and to $OUT/gpu_check.json when $OUT is set.

`--dry-run` runs the same code paths on the CPU in fp32 with shrunken shapes (2 layers, width 64, small images), to
check the script before spending GPU time; without CUDA and without --dry-run it exits with status 2 and says so.

The GPU image has torch, transformers, peft and accelerate, but no bitsandbytes and no pydantic (pipeline.config):
they travel as wheels in .whl/ (git-ignored). Fetch them here once:

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl bitsandbytes==0.50.2 pydantic==2.14.4 pydantic-core==2.50.5 \
      annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0

then, in a session whose task has a GPU, the device tool's `run` with carry [".whl"] and timeout_s 560:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl && export PYTHONPATH=/tmp/site || exit; export PYTHONUNBUFFERED=1; \
      python3 benchmarks/gpu_check.py 2>&1 | tee $OUT/gpu_check.log

and copy the JSON it returns to benchmarks/results/gpu_check.json. On CPU: python benchmarks/gpu_check.py --dry-run
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1"}.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

MiB = 1 << 20
QUESTION = "Which digit is shown in the image?"
DIGITS = [str(d) for d in range(10)]
MODES = ("full", "lora", "qlora")
# Qwen2-VL-2B-Instruct's shape (as in its config.json); only the shape matters, the weights are random.
QWEN2_VL_2B = {
    "model_type": "qwen2_vl", "tie_word_embeddings": True,
    "text_config": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                    "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936, "rms_norm_eps": 1e-6,
                    "max_position_embeddings": 32768,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}},
    "vision_config": {"depth": 32, "embed_dim": 1280, "hidden_size": 1536, "num_heads": 16, "mlp_ratio": 4,
                      "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
}
MODELS = {"smolvlm_256m": ("idefics3", ROOT / "configs" / "smolvlm-256m-shape.json"),
          "qwen2_vl_2b": ("qwen2_vl", QWEN2_VL_2B)}
QWEN_IMAGE = 448  # tamis' default longest side for Qwen2-VL (16 × 28 px merged patches)


# ------------------------------------------------------------------------------------------------ plumbing
class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    @property
    def left(self) -> float:
        return self.end - time.monotonic()


def section(out: dict[str, Any], name: str, deadline: Deadline, fn: Callable[[], Any], *, need_s: float = 0) -> Any:
    """Run one section into out[name]; a failure is recorded (type, message, traceback tail), never raised."""
    if deadline.left < need_s:
        out[name] = {"skipped": f"time budget: {deadline.left:.0f} s left, this section needs ~{need_s:.0f} s"}
        return None
    t0 = time.monotonic()
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - fail soft: record and go on to the next section
        out[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000],
                     "traceback": traceback.format_exc().strip().splitlines()[-8:],
                     "seconds": round(time.monotonic() - t0, 2)}
        print(f"[gpu_check] {name}: FAILED {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return None
    finally:
        _free()
    if isinstance(result, dict):
        result.setdefault("seconds", round(time.monotonic() - t0, 2))
    out[name] = result
    print(f"[gpu_check] {name}: done in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    return result


def _free() -> None:

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class Env:
    device: str
    dtype: Any  # compute dtype
    dry_run: bool

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def sync(self) -> None:

        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:

        if self.cuda:
            self.sync()
            torch.cuda.reset_peak_memory_stats()

    def peak_mb(self) -> float | None:

        return round(torch.cuda.max_memory_allocated() / MiB, 1) if self.cuda else None

    def allocated_mb(self) -> float | None:

        return round(torch.cuda.memory_allocated() / MiB, 1) if self.cuda else None


def environment(env: Env) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {"device": env.device, "dry_run": env.dry_run, "python": platform.python_version(),
                            "torch": torch.__version__, "transformers": transformers.__version__,
                            "compute_dtype": str(env.dtype).removeprefix("torch."), "cpus": os.cpu_count()}
    for name in ("peft", "accelerate", "bitsandbytes", "pydantic"):
        try:
            info[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - a missing package is a finding, not a crash
            info[name] = f"missing ({type(exc).__name__}: {exc})"
    if env.cuda:
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_mb=round(p.total_memory / MiB), capability=f"{p.major}.{p.minor}",
                    multiprocessors=p.multi_processor_count, bf16=torch.cuda.is_bf16_supported(),
                    cuda=torch.version.cuda)
    return info


def matmul_rate(env: Env) -> dict[str, Any]:
    """TFLOP/s of one square matmul in the compute dtype (mean of timed repeats after warm-ups)."""

    n, reps = (8192, 10) if env.cuda else (512, 3)
    a = torch.randn(n, n, device=env.device, dtype=env.dtype)
    b = torch.randn(n, n, device=env.device, dtype=env.dtype)
    for _ in range(3):
        a @ b
    env.sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    env.sync()
    secs = (time.perf_counter() - t0) / reps
    return {"n": n, "dtype": str(env.dtype).removeprefix("torch."), "tflops": round(2 * n**3 / secs / 1e12, 2)}


# ------------------------------------------------------------------------------------------------ models
def shape_config(family: str, source: Any, tok: Any, *, dry_run: bool) -> tuple[Any, int]:
    """(transformers config of the real shape, or shrunken for --dry-run, with tamis' tokenizer's special-token
    IDs; image size the processor must produce)."""
    from pipeline.model.planner import load_model_config

    data = json.loads(Path(source).read_text(encoding="utf-8")) if isinstance(source, Path) else json.loads(
        json.dumps(source))
    ids = {t: int(tok.convert_tokens_to_ids(t)) for t in ("<image>", "<|image_pad|>", "<|video_pad|>",
                                                         "<|vision_start|>", "<|vision_end|>")
           if tok.convert_tokens_to_ids(t) not in (None, tok.unk_token_id)}
    text = data["text_config"]
    text.update(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision = data["vision_config"]
    if dry_run:
        # Widths stay multiples of 64 (bitsandbytes' CPU 4-bit kernels need them); 2 layers each.
        text.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16)
        if family == "qwen2_vl":
            text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [2, 3, 3]}
            vision.update(depth=2, embed_dim=64, hidden_size=64, num_heads=2, mlp_ratio=2)
        else:
            vision.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                          image_size=64)
    if family == "idefics3":
        data["image_token_id"] = ids["<image>"]
        image_size = int(vision.get("image_size", 512))
    else:
        data.update(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                    vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
        image_size = 56 if dry_run else QWEN_IMAGE
    return load_model_config(data), image_size


def make_processor(family: str, tok: Any, config: Any, image_size: int) -> Any:
    """The family's processor for this geometry: Idefics3 with one global tile (no splitting) of the vision
    tower's size; Qwen2-VL with the config's patch / merge sizes, pixel count capped at image_size²."""
    if family == "idefics3":
        from transformers import Idefics3ImageProcessor, Idefics3Processor

        v = config.vision_config
        ip = Idefics3ImageProcessor(size={"longest_edge": image_size}, max_image_size={"longest_edge": image_size},
                                    do_image_splitting=False)
        seq = (v.image_size // v.patch_size) ** 2 // config.scale_factor**2
        return Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=seq, chat_template=tok.chat_template)
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    v = config.vision_config
    unit = v.patch_size * v.spatial_merge_size
    geometry = {"patch_size": v.patch_size, "merge_size": v.spatial_merge_size,
                "temporal_patch_size": v.temporal_patch_size}
    size = {"shortest_edge": unit * unit, "longest_edge": image_size * image_size}
    return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(size=size, **geometry),
                            video_processor=Qwen2VLVideoProcessor(size=size, **geometry), tokenizer=tok,
                            chat_template=tok.chat_template)


def build_model(env: Env, name: str, out_dir: Path) -> dict[str, Any]:
    """Random-weight model of the shape + tokenizer + processor, saved where load_model can read it."""
    from transformers import AutoModelForImageTextToText

    from pipeline.model.families import get_family
    from pipeline.model.tiny import build_tokenizer

    family, source = MODELS[name]
    tok = build_tokenizer(get_family(family))
    config, image_size = shape_config(family, source, tok, dry_run=env.dry_run)
    t0 = time.monotonic()
    with torch.device(env.device):  # random init on the GPU: seconds instead of minutes on the CPU for 2B weights
        model = AutoModelForImageTextToText.from_config(config, dtype=env.dtype)
    model.save_pretrained(out_dir)
    make_processor(family, tok, config, image_size).save_pretrained(out_dir)
    params = sum(p.numel() for p in model.parameters())
    del model
    size = sum(f.stat().st_size for f in out_dir.glob("*.safetensors"))
    return {"family": family, "params": params, "image_size": image_size, "saved_mb": round(size / MiB, 1),
            "build_save_s": round(time.monotonic() - t0, 2)}


def model_cfg(path: Path, family: str, mode: str, **kw: Any) -> Any:
    from pipeline.config import ModelConfig

    return ModelConfig(name_or_path=str(path), family=family, mode=mode, lora_r=16, lora_alpha=32, **kw)


def make_rows(n: int, size: int, seed: int = 0) -> list[dict[str, Any]]:
    """benchmarks/scoring.py's rows (a digit drawn on noise, PNG at the model's native size) with their answer, which
    the training sections need."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from scoring import make_rows as scoring_rows

    return [{**r, "answer": str(i % 10)} for i, r in enumerate(scoring_rows(n, seed=seed, size=size))]


# ------------------------------------------------------------------------------------------------ sections
def load_4bit(env: Env, path: Path, family: str) -> tuple[dict[str, Any], Any]:
    from pipeline.model.loading import load_model

    _free()
    before = env.allocated_mb()
    env.sync()
    t0 = time.perf_counter()
    loaded = load_model(model_cfg(path, family, "qlora"))
    env.sync()
    secs = time.perf_counter() - t0
    after = env.allocated_mb()
    res = {"seconds": round(secs, 2), "footprint_mb": loaded.info["memory_footprint_mb"],
           "allocated_mb": None if after is None else round(after - (before or 0), 1),
           "quantized": loaded.info["quantized"], "compute_dtype": loaded.info["compute_dtype"],
           "attn_implementation": loaded.info["attn_implementation"], "total_params": loaded.info["total_params"]}
    return res, loaded


def naive_probs(loaded: Any, rows: list[dict[str, Any]], answers: list[str]) -> Any:
    """[n, c] candidate probabilities from one full forward over prompt + answer per (sample, candidate)."""
    import numpy as np

    from pipeline.scoring import decode_rgb

    fam, proc, model = loaded.family, loaded.processor, loaded.model
    device = next(model.parameters()).device
    out = np.empty((len(rows), len(answers)))
    with torch.no_grad():
        for i, row in enumerate(rows):
            image = decode_rgb(row["prepared"])
            for j, answer in enumerate(answers):
                enc = fam.encode(proc, [image], [row["question"]], [answer])
                start = int(enc.pop("answer_start")[0])
                n = len(fam.answer_token_ids(proc, row["question"], answer))
                enc.pop("labels")
                logits = model(**enc.to(device)).logits[0].float()
                pos = torch.arange(start, start + n, device=logits.device)
                ids = enc["input_ids"][0].to(device)
                out[i, j] = logits[pos - 1].log_softmax(-1).gather(-1, ids[pos].unsqueeze(-1)).sum().item() / n
    e = np.exp(out - out.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def scoring(env: Env, loaded: Any, image_size: int, n: int, n_naive: int, batch: int,
            tflops: float | None) -> dict[str, Any]:
    import numpy as np

    from pipeline.scoring import ClosedSetScorer, decode_rgb

    rows = make_rows(n, image_size)
    scorer = ClosedSetScorer(loaded, DIGITS)
    scorer.score(rows[:batch], batch_size=batch)  # warm-up: kernels, allocator, autotuning
    env.sync()
    t0 = time.perf_counter()
    batched = scorer.score(rows, batch_size=batch)
    env.sync()
    b_secs = time.perf_counter() - t0
    naive_probs(loaded, rows[:1], DIGITS[:2])  # warm-up of the one-sample path
    env.sync()
    t0 = time.perf_counter()
    naive = naive_probs(loaded, rows[:n_naive], DIGITS)
    env.sync()
    n_secs = time.perf_counter() - t0
    # Tokens one sample costs in the prefix pass: the prompt with its image tokens (text model) and the patches
    # the vision encoder sees.
    enc = loaded.family.encode(loaded.processor, [decode_rgb(rows[0]["prepared"])], [QUESTION])
    seq = int(enc["attention_mask"][0].sum())
    total = loaded.info["total_params"]
    vision_params, patches = _vision(loaded.model, enc)
    sps = n / b_secs
    flops_simple = 2 * total * seq
    flops_split = 2 * (total - vision_params) * seq + 2 * vision_params * patches
    res = {"n": n, "batch_size": batch, "batched_sps": round(sps, 2), "naive_n": n_naive,
           "naive_sps": round(n_naive / n_secs, 3), "speedup": round(sps * n_secs / n_naive, 1),
           "max_abs_prob_diff": float(np.abs(batched.probs[:n_naive] - naive).max()),
           "tokens_per_sample": seq, "vision_patches_per_sample": patches, "params": total,
           "vision_params": vision_params, "flops_per_sample_simple": flops_simple,
           "flops_per_sample_split": flops_split}
    if tflops:
        res["flop_fraction"] = round(sps * flops_simple / (tflops * 1e12), 4)
        res["flop_fraction_split"] = round(sps * flops_split / (tflops * 1e12), 4)
    return res


def _vision(model: Any, enc: Any) -> tuple[int, int]:
    """(vision-encoder parameters, 4-bit ones counted as loading counts them; patches it sees per sample)."""
    from pipeline.model.loading import count_parameters

    tower = next(m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in ("vision_model", "visual"))
    if "image_grid_thw" in enc:  # Qwen2-VL: t × h × w patches per image
        return count_parameters(tower)[1], int(enc["image_grid_thw"][0].prod())
    v = model.config.vision_config  # Idefics3: tiles of image_size², each cut into patch_size² patches
    return count_parameters(tower)[1], int(enc["pixel_values"].shape[1]) * (v.image_size // v.patch_size) ** 2


def train_step(env: Env, model: Any, enc: dict[str, Any], opt: Any, offload: bool = False) -> float:
    from pipeline.model.train import _offload

    with torch.autocast("cuda", dtype=env.dtype) if env.cuda else contextlib.nullcontext(), _offload(offload):
        loss = model(**enc).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach().item()


# Beyond adamw for every mode × checkpointing: (mode, optimizer, activation offload, liger) cases, the knobs
# train.optimizer, train.activation_offload and model.liger; offload and Liger only where CUDA has them.
KNOB_CASES = (("full", "adamw_8bit", False, False), ("qlora", "paged_adamw_8bit", False, False),
              ("qlora", "adamw", True, False), ("lora", "adamw", False, True))


def training(env: Env, path: Path, family: str, shape: Any, image_size: int, batch: int, steps: int) -> dict[str, Any]:
    """Peak memory and steps/s per mode × checkpointing (× the optimizer, offload and Liger knobs), with the
    planner's estimate of the same step."""

    from pipeline.model.loading import load_model
    from pipeline.model.planner import RUNTIME_BYTES, PlanInputs, plan
    from pipeline.scoring import decode_rgb

    rows = make_rows(batch, image_size, seed=1)
    images = [decode_rgb(r["prepared"]) for r in rows]
    cases = []
    import importlib.util

    from pipeline.model.optim import build_optimizer

    liger_ok = env.cuda and importlib.util.find_spec("liger_kernel") is not None
    runs = [(mode, [("adamw", False)], False) for mode in MODES]
    for mode, opt_name, offload, liger in KNOB_CASES:
        if (offload or liger) and not env.cuda:
            continue  # a no-op / never applied on the CPU: nothing to measure
        if liger and not liger_ok:
            cases.append({"mode": mode, "liger": True, "skipped": "liger_kernel is not installed"})
            continue
        if liger:
            runs.append((mode, [(opt_name, offload)], True))
        else:
            next(r for r in runs if r[0] == mode and not r[2])[1].append((opt_name, offload))
    for mode, variants, liger in runs:
        _free()
        try:
            loaded = load_model(model_cfg(path, family, mode, liger=liger), trainable=True)
        except Exception as exc:  # noqa: BLE001 - one mode failing (e.g. no bitsandbytes) leaves the others
            cases.append({"mode": mode, "error": f"load: {type(exc).__name__}: {exc}"[:600]})
            continue
        model, proc, fam = loaded.model, loaded.processor, loaded.family
        device = next(model.parameters()).device
        enc = dict(fam.encode(proc, images, [r["question"] for r in rows], [r["answer"] for r in rows]))
        enc.pop("answer_start")
        enc = {k: v.to(device) if torch.is_tensor(v) else v for k, v in enc.items()}
        image_token = getattr(model.config, "image_token_id", None)
        text_tokens = int(enc["input_ids"].shape[1] - (enc["input_ids"][0] == image_token).sum())
        if hasattr(model, "config"):
            model.config.use_cache = False
        # Every case without checkpointing first: once enabled and disabled again on the PEFT-wrapped model, a
        # step without it peaks at ~2x (1.77 -> 4.1 GB, 17.9 -> 33.4 GB on the H200), whatever the optimizer.
        for ckpt, (opt_name, offload) in ((c, v) for c in (False, True) for v in variants):
            case: dict[str, Any] = {"mode": mode, "gradient_checkpointing": ckpt, "optimizer": opt_name,
                                    "activation_offload": offload, "liger": loaded.info["liger"]["applied"],
                                    "batch": batch, "seq_len": int(enc["input_ids"].shape[1]),
                                    "text_tokens": text_tokens}
            try:
                if ckpt:
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                    if hasattr(model, "enable_input_require_grads"):
                        model.enable_input_require_grads()
                model.train()
                opt = build_optimizer(opt_name, [p for p in model.parameters() if p.requires_grad], 1e-5, 0.0)
                env.reset_peak()

                train_step(env, model, enc, opt, offload)  # warm-up: optimizer states, kernels
                env.sync()
                t0 = time.perf_counter()
                losses = [train_step(env, model, enc, opt, offload) for _ in range(steps)]
                env.sync()
                secs = time.perf_counter() - t0
                p = plan(shape, PlanInputs(
                    mode=mode, batch=batch, seq_len=text_tokens, image_size=image_size, lora_r=16, checkpointing=ckpt,
                    precision="bf16" if env.cuda else "fp32", device=env.device, optimizer=opt_name,
                    activation_offload=offload, liger=case["liger"]))
                # max_memory_allocated sees neither the CUDA context nor cuBLAS workspaces (the planner's runtime).
                planned = p.total - RUNTIME_BYTES["cuda"] if env.cuda else p.total
                peak = env.peak_mb()
                case.update(steps_per_s=round(steps / secs, 3), samples_per_s=round(steps * batch / secs, 2),
                            loss=round(losses[-1], 4), peak_allocated_mb=peak,
                            planned_mb=round(planned / MiB, 1), planned_total_mb=round(p.total / MiB, 1),
                            planned_over_measured=None if not peak else round(planned / MiB / peak, 3),
                            planned_error=None if not peak else round((planned / MiB - peak) / peak, 3),
                            planned_phase=p.phase, planned_terms_mb={k: round(v / MiB, 1) for k, v in p.terms.items()},
                            trainable_params=loaded.info["trainable_params"])
                del opt
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory in one case; the others still run
                case["error"] = f"{type(exc).__name__}: {exc}"[:600]
            finally:
                if ckpt:
                    model.gradient_checkpointing_disable()
                model.zero_grad(set_to_none=True)
                _free()
            cases.append(case)
            print(f"[gpu_check]   {json.dumps(case)}", file=sys.stderr, flush=True)
        del loaded, model, enc
    return {"cases": cases}


def data_parallel(env: Env, path: Path, family: str, image_size: int, batch: int, steps: int,
                  work: Path) -> dict[str, Any]:
    """train_adapter with 2 processes (one per GPU; gloo on the CPU in --dry-run) vs 1, same effective batch."""
    devices = torch.cuda.device_count() if env.cuda else 2
    if devices < 2:
        return {"not_measured": f"needs at least 2 CUDA devices; this machine has {devices}"}
    from pipeline.config import ProjectConfig
    from pipeline.model.train import TrainSpec, train_adapter

    rows = make_rows(2 * batch * steps, image_size, seed=2)
    runs: dict[str, Any] = {}
    for nproc in (1, 2):
        cfg = ProjectConfig.model_validate({
            "model": model_cfg(path, family, "qlora", lora_dropout=0.0).model_dump(mode="json"),
            "train": {"batch_size": batch, "effective_batch_size": 2 * batch, "max_steps": steps, "warmup_ratio": 0.0,
                      "scheduler": "constant", "gradient_checkpointing": False, "num_processes": nproc,
                      "precision": "bf16" if env.cuda else "fp32", "learning_rate": 1e-4},
        })
        res = train_adapter(TrainSpec.of(cfg), rows, work / f"dp-{nproc}", progress=False)
        util = res.info["utilisation"]
        runs[f"processes_{nproc}"] = {
            "seconds": res.info["seconds"], "samples_per_s": round(steps * 2 * batch / res.info["seconds"], 2),
            "losses": [round(x, 5) for x in res.losses], "settings": res.settings,
            "peak_per_process": util.get("per_process") or {k: [util[k]] for k in ("peak_allocated_mb", "peak_rss_mb")
                                                             if k in util}}
    a, b = runs["processes_1"]["losses"], runs["processes_2"]["losses"]
    runs["max_loss_rel_diff"] = round(max(abs(x - y) / max(abs(x), 1e-9) for x, y in zip(a, b, strict=True)), 6)
    runs["speedup"] = round(runs["processes_1"]["seconds"] / runs["processes_2"]["seconds"], 3)
    return runs


def check_model(env: Env, name: str, args: argparse.Namespace, deadline: Deadline, tflops: float | None,
                work: Path) -> dict[str, Any]:
    from pipeline.model.planner import analyze

    out: dict[str, Any] = {}
    path = work / name
    built = section(out, "build", deadline, lambda: build_model(env, name, path))
    if built is None:
        return out
    family, image_size = built["family"], built["image_size"]
    shape = analyze(path / "config.json")
    holder: dict[str, Any] = {}

    def load() -> dict[str, Any]:
        res, holder["loaded"] = load_4bit(env, path, family)
        return res

    section(out, "load_4bit", deadline, load, need_s=10)
    if "loaded" in holder:
        section(out, "scoring", deadline, lambda: scoring(env, holder["loaded"], image_size, args.score_n,
                                                           args.naive_n, args.score_batch, tflops), need_s=20)
        holder.clear()
    section(out, "training", deadline, lambda: training(env, path, family, shape, image_size, args.train_batch,
                                                         args.train_steps), need_s=30)
    if name in args.data_parallel_models:
        section(out, "data_parallel", deadline, lambda: data_parallel(env, path, family, image_size,
                                                                       args.train_batch, args.train_steps + 1,
                                                                       path.parent), need_s=60)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, fp32, shrunken shapes: check the script itself")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    ap.add_argument("--budget-s", type=float, default=450.0, help="skip sections once this much time is spent")
    ap.add_argument("--score-n", type=int, default=None, help="samples for the batched scorer (default 256; dry 8)")
    ap.add_argument("--naive-n", type=int, default=None, help="samples for the naive loop (default 16; dry 2)")
    ap.add_argument("--score-batch", type=int, default=None, help="scorer batch size (default 32; dry 4)")
    ap.add_argument("--train-batch", type=int, default=None, help="training micro-batch (default 8; dry 2)")
    ap.add_argument("--train-steps", type=int, default=None, help="timed steps per case (default 5; dry 1)")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)
    for k, real, dry in (("score_n", 256, 8), ("naive_n", 16, 2), ("score_batch", 32, 4), ("train_batch", 8, 2),
                         ("train_steps", 5, 1)):
        if getattr(args, k) is None:
            setattr(args, k, dry if args.dry_run else real)
    names = [m for m in args.models.split(",") if m]
    # The CPU dry run checks the 2-process path once (gloo, ~30 s); a multi-GPU machine measures every model.
    args.data_parallel_models = set(names[:1]) if args.dry_run else set(names)
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        ap.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")


    t0 = time.monotonic()
    result: dict[str, Any] = {"benchmark": "gpu_check", "dry_run": args.dry_run}
    if not args.dry_run and not torch.cuda.is_available():
        result["error"] = ("no CUDA device: this script measures a GPU (the H200 machine); run it there as its "
                           "docstring says, or use --dry-run to check it on the CPU")
        _emit(result, args.json_out)
        raise SystemExit(2)
    env = Env("cpu" if args.dry_run else "cuda", torch.float32 if args.dry_run else torch.bfloat16, args.dry_run)
    if args.dry_run:
        torch.set_num_threads(1)  # tiny shapes: one thread is as fast, and kinder to a shared machine
    deadline = Deadline(args.budget_s)
    section(result, "environment", deadline, lambda: environment(env))
    rate = section(result, "matmul", deadline, lambda: matmul_rate(env))
    tflops = rate and rate["tflops"]
    result["models"] = {}
    with tempfile.TemporaryDirectory(prefix="tamis-gpu-check-") as tmp:
        for name in names:
            result["models"][name] = check_model(env, name, args, deadline, tflops, Path(tmp))
    result["wall_seconds"] = round(time.monotonic() - t0, 1)
    result["budget_s"] = args.budget_s
    _emit(result, args.json_out)
    return result


def _emit(result: dict[str, Any], json_out: Path | None) -> None:
    print(json.dumps(result, indent=2, default=str))
    targets = [json_out] if json_out else []
    if os.environ.get("OUT"):
        targets.append(Path(os.environ["OUT"]) / "gpu_check.json")
    for path in targets:
        from pipeline.store import atomic_write_json

        atomic_write_json(path, json.loads(json.dumps(result, default=str)))


if __name__ == "__main__":
    main()
