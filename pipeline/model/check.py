"""`tamis check-model`: load a user's checkpoint the way a round would and say what tamis will do with it.

Each step is one row of a report (what was checked, what was found, ok / warn / fail). A failing step that later
steps depend on stops the check there: its row says why, and names the fix. The report is `ok` when no row failed,
i.e. when a round would get past loading, prompting, scoring and training with this checkpoint and config.
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from pipeline.config import DataConfig, ModelConfig, PreprocessConfig, TrainConfig
from pipeline.errors import TamisError

log = logging.getLogger(__name__)
Status = Literal["ok", "warn", "fail"]
SAMPLE_ANSWER = "a small red square"


@dataclass
class Row:
    check: str
    status: Status
    found: str


@dataclass
class CheckReport:
    model: str
    rows: list[Row] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(r.status == "fail" for r in self.rows)

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if r.status == "fail"]

    def add(self, check: str, status: Status, found: str) -> None:
        self.rows.append(Row(check, status, found))
        (log.warning if status != "ok" else log.info)("check-model: %s: %s (%s)", check, found, status)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "ok": self.ok,
                "rows": [{"check": r.check, "status": r.status, "found": r.found} for r in self.rows]}


class _Stop(Exception):
    """A failed step that later steps depend on."""


def _step(report: CheckReport, check: str, fn: Callable[[], tuple[Status, str, Any]]) -> Any:
    """Run one step; a TamisError or a library exception becomes its failed row and stops the check."""
    try:
        status, found, value = fn()
    except TamisError as exc:
        report.add(check, "fail", str(exc))
        raise _Stop from None
    except Exception as exc:  # noqa: BLE001 - a third-party failure is the finding itself
        report.add(check, "fail", f"{type(exc).__name__}: {exc}")
        raise _Stop from None
    report.add(check, status, found)
    if status == "fail":
        raise _Stop
    return value


def check_model(model: ModelConfig, *, preprocess: PreprocessConfig, data: DataConfig, train: TrainConfig,
                hw: Any = None) -> CheckReport:
    """Check `model` with the preprocess (size, pad), data (question, answers) and train settings a round uses."""
    from pipeline.model.hardware import detect_hardware

    hw = hw or detect_hardware()
    report = CheckReport(model=model.name_or_path)
    try:
        _run(report, model, preprocess, data, train, hw)
    except _Stop:
        pass
    return report


def _sample_images(size: int) -> list[Any]:
    from pipeline.model.quant_check import synthetic_images

    square, wide = synthetic_images(2, size, seed=0)
    return [square, wide.resize((size, max(1, size // 2)))]


def check_files(model: ModelConfig) -> CheckReport:
    """The checks that read the checkpoint's files and load no weights (the folder, its family, its processor, its
    chat template): seconds. `tamis init` runs them before it writes a config that names the model."""
    report = CheckReport(model=model.name_or_path)
    try:
        _file_steps(report, model)
    except _Stop:
        pass
    return report


def _file_steps(report: CheckReport, model: ModelConfig) -> tuple[Path, Any, Any]:
    path = _step(report, "checkpoint", lambda: _source(model.name_or_path))
    fam = _step(report, "family", lambda: _family(model, path))
    proc = _step(report, "processor", lambda: _processor(path))
    _step(report, "chat template", lambda: _template(proc, fam))
    return path, fam, proc


def _run(report: CheckReport, model: ModelConfig, preprocess: PreprocessConfig, data: DataConfig,
         train: TrainConfig, hw: Any) -> None:
    """The steps that need no model weights (the folder, the family, the processor and the prompt), then the
    model's own."""
    path, fam, proc = _file_steps(report, model)
    size = _step(report, "image size", lambda: (
        "ok", f"{preprocess.size} px (preprocess.size)", preprocess.size) if preprocess.size else (
        "ok", f"{fam.default_image_size} px (the {fam.name} default; preprocess.size unset)", fam.default_image_size))
    images = _sample_images(size)
    answer = data.answers[0] if data.answers else SAMPLE_ANSWER
    _step(report, "image tokens", lambda: _image_tokens(fam, proc, images, data.question, size, preprocess.pad))
    _step(report, "prompt / answer", lambda: _boundaries(fam, proc, images, data.question, answer))
    _model_steps(report, model, train, data, fam, path, images, size, hw)


def _source(src: str) -> tuple[Status, str, Any]:
    from pipeline.model.families import read_model_type

    path = Path(src)
    if not path.is_dir():
        return "fail", (f"{src}: not a local folder; check-model reads a local checkpoint (offline machines cannot "
                        "reach the hub): download it and set model.name_or_path to the folder"), None
    if not (path / "config.json").is_file():
        return "fail", f"{src}: no config.json; point model.name_or_path at a saved checkpoint folder", None
    return "ok", f"{src} (model_type {read_model_type(path)})", path


def _family(model: ModelConfig, path: Path) -> tuple[Status, str, Any]:
    from pipeline.model.loading import resolve_family

    fam = resolve_family(model, str(path))
    how = ("model.family: auto, generic fallback" if fam.name == "auto" else
           "model.family: auto, registered family" if model.family == "auto" else
           "model.family in the config" if model.family else "detected from config.json model_type")
    guesses = getattr(fam, "guesses", None)
    found = f"{fam.name} ({how})"
    if guesses:
        found += "; guessed: " + "; ".join(f"{k}: {v}" for k, v in guesses.items())
    return ("warn" if guesses else "ok"), found, fam


def _processor(path: Path) -> tuple[Status, str, Any]:
    from transformers import AutoProcessor

    try:
        proc = AutoProcessor.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as exc:
        return "fail", (f"the processor does not load ({type(exc).__name__}: {exc}); the folder needs the "
                        "processor's files (preprocessor_config.json, tokenizer files, processor_config.json) as "
                        "`processor.save_pretrained` writes them"), None
    if not hasattr(proc, "image_processor") or not hasattr(proc, "tokenizer"):
        return "fail", (f"AutoProcessor gives a {type(proc).__name__}: no image processor and tokenizer; save "
                        "the model's multimodal processor into the folder"), None
    return "ok", f"{type(proc).__name__} ({type(proc.image_processor).__name__})", proc


def _template(proc: Any, fam: Any) -> tuple[Status, str, Any]:
    if getattr(proc, "chat_template", None):
        return "ok", "the checkpoint's own", None
    return "fail", (f"the checkpoint has no chat template (no chat_template.jinja, none in the processor or "
                    f"tokenizer config); tamis would fall back to its copy of the {fam.name} instruct template, "
                    "which is right only if this checkpoint was trained on that format. Add the instruct "
                    "checkpoint's chat_template.jinja to the folder"), None


def _image_tokens(fam: Any, proc: Any, images: list[Any], question: str, size: int,
                  pad: str) -> tuple[Status, str, Any]:
    enc = fam.encode(proc, images[:1], [question])
    image_id = proc.tokenizer.convert_tokens_to_ids(fam.image_token) if fam.image_token else None
    n = int((enc["input_ids"][0] == image_id).sum()) if image_id is not None else 0
    total = int(enc["attention_mask"][0].sum())
    if not n:
        return "warn", f"no {fam.image_token or 'image'} placeholder counted; the prompt is {total} tokens", None
    wide = fam.encode(proc, images[1:], [question])
    n_wide = int((wide["input_ids"][0] == image_id).sum())
    return "ok", (f"{n} image tokens for a {size}×{size} image ({n_wide} for {images[1].width}×"
                  f"{images[1].height}); prompt {total} tokens; square_tiles={fam.square_tiles}"
                  + (" (set preprocess.pad: square)" if fam.square_tiles and pad != "square" else "")), None


def _boundaries(fam: Any, proc: Any, images: list[Any], question: str, answer: str) -> tuple[Status, str, Any]:
    enc = fam.encode(proc, images[:1], [question], [answer])
    start = int(enc["answer_start"][0])
    labels = enc["labels"][0]
    kept = labels[labels != -100].tolist()
    tok = proc.tokenizer
    cue = tok.decode(enc["input_ids"][0, max(0, start - 6):start])
    said = tok.decode(kept)
    how = fam.answer_rendering(proc, question, answer)
    if not kept or kept[-1] != fam.end_token_id(proc):
        return "fail", f"the labels {said!r} do not end on the end-of-turn token {fam.end_token!r}", None
    note = "" if how == "template" else (" (the template renders the answered turn differently from the "
                                         "generation prompt: the answer is appended to the prompt)")
    return ("ok" if how == "template" else "warn"), (
        f"answer starts at token {start} after …{cue!r}; labels {said!r} ({len(kept)} tokens, end "
        f"{fam.end_token!r}); candidate {answer!r} = {len(fam.answer_token_ids(proc, question, answer))} "
        f"token(s){note}"), None


def _model_steps(report: CheckReport, model: ModelConfig, train: TrainConfig, data: DataConfig, fam: Any,
                 path: Path, images: list[Any], size: int, hw: Any) -> None:
    """The steps on the loaded model: LoRA, 4-bit agreement, one training step, one scoring batch, planned memory."""
    loading = model.model_copy(update={"name_or_path": str(path), "build_tiny_if_missing": False})
    ld = _step(report, "load + LoRA", lambda: _load(loading, fam, hw))
    _step(report, "check-quant", lambda: _quant(loading, images, data.question, hw))
    # Train before scoring: after a no-grad forward, a backward through biased 4-bit layers failed in bitsandbytes'
    # CPU path (seen with LoRA on Gemma 3's SigLIP tower); a round trains and scores in separate loads anyway.
    _step(report, "training step", lambda: _train_step(ld, fam, images, data, train.learning_rate))
    _step(report, "scoring batch", lambda: _scoring(ld, images, data, model.max_new_tokens))
    _step(report, "planned memory", lambda: _memory(path, model, train, fam, size, hw))


def _load(model: ModelConfig, fam: Any, hw: Any) -> tuple[Status, str, Any]:
    from pipeline.model.loading import load_model

    ld = load_model(model, trainable=True, hw=hw)
    info = ld.info
    lora = sorted({n.rsplit(".", 1)[-1] for n, m in ld.model.named_modules() if hasattr(m, "lora_A")})
    n_lora = sum(1 for _, m in ld.model.named_modules() if hasattr(m, "lora_A"))
    if model.mode != "full" and not n_lora:
        return "fail", (f"no LoRA layer was attached (target {model.target_modules or fam.lora_target()!r} "
                        "matched nothing); set model.target_modules"), None
    what = f"LoRA on {n_lora} layers ({', '.join(lora)})" if n_lora else "all weights"
    return "ok", (f"{model.mode}, {'4-bit NF4' if info['quantized'] else info['weights_dtype']} on "
                  f"{info['device']}: {what}; trainable {info['trainable_params']:,} of "
                  f"{info['total_params']:,} ({info['trainable_percent']}%), {info['memory_footprint_mb']} MB"), ld


def _quant(model: ModelConfig, images: list[Any], question: str, hw: Any) -> tuple[Status, str, Any]:
    from pipeline.model.quant_check import check_quant

    if model.mode != "qlora":
        return "ok", f"skipped (model.mode is {model.mode})", None
    r = check_quant(model, [(im, question) for im in images], hw=hw)
    low = r["top1_agreement_last"] < 0.5
    return ("warn" if low else "ok"), (f"top-1 agreement {r['top1_agreement']:.3f} (last prompt position "
                                       f"{r['top1_agreement_last']:.3f}), mean KL {r['mean_kl']:.4f}, "
                                       f"footprint ×{r['footprint_ratio']}"), None


def _train_step(ld: Any, fam: Any, images: list[Any], data: DataConfig, lr: float) -> tuple[Status, str, Any]:
    target = data.answers[0] if data.answers else SAMPLE_ANSWER
    enc = fam.encode(ld.processor, images, [data.question] * len(images), [target] * len(images))
    device = next(ld.model.parameters()).device
    inputs = {k: v.to(device) for k, v in enc.items() if k != "answer_start"}
    params = [p for p in ld.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    ld.model.train()
    out = ld.model(**inputs)
    out.loss.backward()
    loss = float(out.loss.detach())
    grad = math.sqrt(sum(float(p.grad.float().pow(2).sum()) for p in params if p.grad is not None))
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        after = float(ld.model(**inputs).loss)
    ld.model.eval()
    if not (math.isfinite(loss) and math.isfinite(grad) and grad > 0):
        return "fail", f"loss {loss}, gradient norm {grad}: no usable gradient reaches the adapter", None
    return "ok", f"loss {loss:.4f} → {after:.4f} after one step at lr {lr}, gradient norm {grad:.3g}", None


def _scoring(ld: Any, images: list[Any], data: DataConfig, max_new_tokens: int) -> tuple[Status, str, Any]:
    from pipeline.scoring import ClosedSetScorer, OpenAnswerScorer

    rows = []
    for i, im in enumerate(images):
        buf = io.BytesIO()
        im.save(buf, "PNG")
        rows.append({"sample_id": f"check-{i}", "prepared": buf.getvalue(), "question": data.question})
    ld.model.eval()
    answers = data.answers
    if answers:
        res = ClosedSetScorer(ld, answers).score(rows, batch_size=2)
        ok = bool(torch.isfinite(torch.as_tensor(res.probs)).all())
        return ("ok" if ok else "fail"), (f"closed set of {len(answers)} answers: probabilities "
                                          f"{[round(float(p), 3) for p in res.probs[0][:4]]}…, embeddings "
                                          f"{tuple(res.embeddings.shape)}"), None
    res = OpenAnswerScorer(ld, max_new_tokens=min(4, max_new_tokens), min_new_tokens=1).score(rows, batch_size=2)
    return "ok", f"open answers {res.answers!r}, embeddings {tuple(res.embeddings.shape)}", None


def _memory(path: Path, model: ModelConfig, train: TrainConfig, fam: Any, size: int,
            hw: Any) -> tuple[Status, str, Any]:
    from pipeline.model.hardware import choose_train_settings
    from pipeline.model.planner import PlanInputs, analyze, plan

    shape = analyze(path)
    s = choose_train_settings(train, model, hw, shape, image_size=size)
    targets = list(model.target_modules) if model.target_modules else fam.lora_target()
    budget = hw.memory_budget_bytes or None
    p = plan(shape, PlanInputs(mode=model.mode, batch=s.micro_batch, image_size=size, lora_r=model.lora_r,
                               target_modules=targets, checkpointing=s.gradient_checkpointing, precision=s.precision,
                               device=hw.device, gpu_memory_bytes=budget, lora_dropout=model.lora_dropout))
    where = "GPU" if hw.device == "cuda" else "RAM"
    found = (f"{p.total / 2**30:.2f} GiB peak at micro-batch {s.micro_batch} × accumulation {s.grad_accum}, "
             f"checkpointing {'on' if s.gradient_checkpointing else 'off'}, {s.precision} ({s.reason}); "
             + (f"{where} budget {p.budget / 2**30:.2f} GiB" if budget else f"no {where} budget known"))
    if p.fits is False:
        return "fail", found + ": does not fit; lower preprocess.size or train.effective_batch_size, or use " \
                               "model.mode: qlora", None
    return "ok", found, None
