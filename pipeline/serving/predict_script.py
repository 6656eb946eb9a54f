"""predict.py: answer images with a model `tamis export-model` wrote, with transformers, peft, torch and Pillow only.

    python predict.py IMAGES_OR_FOLDERS... [--out predictions.csv] [--model merged|adapter] [--base BASE]

It reads predict_config.json beside it: the question, the answers, the chat template the rounds trained with, the
processor settings tamis passed, and how tamis prepared images (EXIF rotation, RGB, longest side N, square padding).
Every image is prepared that way and the question wrapped in that template. A closed answer set is scored as tamis
scores it: every token of every answer after the prompt, the mean log-probability per token, softmaxed over the
answers (scoring only an answer's first token fails wherever the answers share it, e.g. a leading space). Open answers
are generated greedily. One CSV row per image: file, answer, probability, mean_logprob, error, then each answer's
probability. This file is copied from tamis (pipeline/serving/predict_script.py) and imports nothing of it.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path

import torch
from PIL import Image, ImageOps

HERE = Path(__file__).resolve().parent
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


# ------------------------------------------------------------------------------------------------ images
def to_rgb(img: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """Any mode → RGB; transparency composited on tamis's background colour."""
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, background)
        canvas.paste(rgba, mask=rgba.getchannel("A"))
        return canvas
    return img.convert("RGB")


def prepare_image(path: str | Path, image_cfg: dict) -> Image.Image:
    """As tamis's preprocess stage prepares an image: EXIF-rotated, RGB, longest side `size` (aspect kept; area
    averaging when shrinking ≥ 2×, bilinear below that, bicubic when enlarging), centred on a `pad_color` square when
    `pad` is "square"."""
    size = int(image_cfg["size"])
    img = Image.open(path)
    w, h = img.size
    if img.format == "JPEG" and size / max(w, h) < 0.5:  # decode no larger than needed, as tamis does
        img.draft(img.mode, (math.ceil(w * size / max(w, h)), math.ceil(h * size / max(w, h))))
    img = to_rgb(ImageOps.exif_transpose(img), tuple(image_cfg.get("background", (255, 255, 255))))
    w, h = img.size
    scale = size / max(w, h)
    factor = max(w, h) / size
    method = Image.Resampling.BOX if factor >= 2 else (
        Image.Resampling.BILINEAR if factor > 1 else Image.Resampling.BICUBIC)
    new = (max(1, round(w * scale)), max(1, round(h * scale)))  # albumentations' LongestMaxSize rounds so
    if new != (w, h):
        img = img.resize(new, method)
    if image_cfg.get("pad") != "square":
        return img
    canvas = Image.new("RGB", (size, size), tuple(image_cfg["pad_color"]))
    canvas.paste(img, ((size - img.width) // 2, (size - img.height) // 2))
    return canvas


# ------------------------------------------------------------------------------------------------ prompts
def render(processor, cfg: dict, answer: str | None = None) -> str:
    """The text the model saw in training: the user turn (image + question), then the answer or the assistant cue."""
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": cfg["question"]}]}
    kw = {"chat_template": cfg["chat_template"], "tokenize": False}
    cue = processor.apply_chat_template([user], add_generation_prompt=True, **kw)
    if answer is None:
        return cue
    turn = {"role": "assistant", "content": [{"type": "text", "text": answer}]}
    full = processor.apply_chat_template([user, turn], add_generation_prompt=False, **kw)
    # A template whose answered turn does not start with its generation prompt: the answer follows the cue.
    return full if full.startswith(cue) else cue + cfg["answer_prefix"] + answer + cfg["end_token"]


def answer_tokens(processor, cfg: dict) -> list[list[int]]:
    """Every answer's tokens as they follow the prompt, up to (not including) the end-of-turn token."""
    tok = processor.tokenizer
    end = tok.convert_tokens_to_ids(cfg["end_token"])
    prompt = tok(render(processor, cfg), add_special_tokens=False)["input_ids"]
    out = []
    for a in cfg["answers"]:
        full = tok(render(processor, cfg, a), add_special_tokens=False)["input_ids"]
        if full[: len(prompt)] != prompt:
            raise SystemExit(f"the prompt's tokens change when the answer {a!r} follows it; cannot score it")
        rest = full[len(prompt):]
        out.append(rest[: rest.index(end)] if end in rest else rest)
    return out


def encode(processor, cfg: dict, images: list[Image.Image], texts: list[str], padding_side: str = "right"):
    return processor(images=[[im] for im in images], text=texts, padding=True, padding_side=padding_side,
                     return_tensors="pt", **cfg["processor_kwargs"])


# ------------------------------------------------------------------------------------------------ scoring
ANSWER_ROWS = 8  # answers scored per forward: each row holds the image's tokens too


@torch.no_grad()
def score_answers(model, processor, cfg: dict, image: Image.Image, cand: list[list[int]]) -> list[float]:
    """Each answer's log-likelihood after the prompt: the sum of its tokens' log-probabilities, divided by its number
    of tokens when `length_normalize` (tamis's default). One row per answer (prompt + answer), ANSWER_ROWS a forward;
    only the positions after the prompt become log-probabilities (a vocabulary-wide row per token is large)."""
    device = next(model.parameters()).device
    plen = encode(processor, cfg, [image], [render(processor, cfg)])["input_ids"].shape[1]
    out = []
    for lo in range(0, len(cand), ANSWER_ROWS):
        answers = cfg["answers"][lo: lo + ANSWER_ROWS]
        enc = encode(processor, cfg, [image] * len(answers), [render(processor, cfg, a) for a in answers]).to(device)
        logits = model(**enc).logits[:, plen - 1:]  # position plen - 1 + t predicts answer token t
        logp = torch.log_softmax(logits.float(), dim=-1)
        for j, toks in enumerate(cand[lo: lo + ANSWER_ROWS]):
            got = enc["input_ids"][j, plen: plen + len(toks)].tolist()
            if got != toks:
                raise SystemExit(f"answer {answers[j]!r}: tokens {got} after the prompt, expected {toks}")
            ll = sum(float(logp[j, t, tok]) for t, tok in enumerate(toks))
            out.append(ll / len(toks) if cfg.get("length_normalize", True) else ll)
    return out


def softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    e = [math.exp(x - top) for x in xs]
    return [v / sum(e) for v in e]


@torch.no_grad()
def generate_answer(model, processor, cfg: dict, image: Image.Image) -> tuple[str, float]:
    """(greedy answer, mean log-probability of its tokens), stopping at the end-of-turn token or EOS."""
    tok = processor.tokenizer
    stop = [tok.convert_tokens_to_ids(cfg["end_token"])] + ([tok.eos_token_id] if tok.eos_token_id is not None else [])
    enc = encode(processor, cfg, [image], [render(processor, cfg)], "left").to(next(model.parameters()).device)
    out = model.generate(**enc, max_new_tokens=int(cfg.get("max_new_tokens", 16)), min_new_tokens=1, do_sample=False,
                         eos_token_id=stop, pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else stop[0],
                         output_logits=True, return_dict_in_generate=True)
    new = out.sequences[0, enc["input_ids"].shape[1]:].tolist()
    kept = []
    for t, tid in enumerate(new):
        if tid in stop:
            break
        kept.append(float(torch.log_softmax(out.logits[t][0].float(), -1)[tid]))
    text = tok.decode(new[: len(kept)], skip_special_tokens=True).strip()
    return text, (sum(kept) / len(kept) if kept else float("nan"))


def predict_one(model, processor, cfg: dict, image: Image.Image, cand: list[list[int]] | None) -> dict:
    """One CSV row's answer, probability, mean_logprob and (closed answers) every answer's probability."""
    if cand is None:
        text, mean = generate_answer(model, processor, cfg, image)
        return {"answer": text, "probability": math.exp(mean) if math.isfinite(mean) else "", "mean_logprob": mean}
    probs = softmax(score_answers(model, processor, cfg, image, cand))
    best = max(range(len(probs)), key=probs.__getitem__)
    return {"answer": cfg["answers"][best], "probability": probs[best], "mean_logprob": "",
            **{f"p:{a}": p for a, p in zip(cfg["answers"], probs, strict=True)}}


# ------------------------------------------------------------------------------------------------ loading
def base_kwargs(cfg: dict, dtype, device: str, full_precision: bool) -> dict:
    """from_pretrained keywords for the adapter's base: 4-bit NF4 as tamis trained a qlora adapter against it (with
    bitsandbytes installed), else the full-precision base, whose answers differ a little (the merged/ folder holds
    the 4-bit weights the adapter was trained against, dequantized)."""
    quant = cfg.get("base_quantization")
    if not quant or full_precision:
        return {"dtype": dtype}
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError:
        print("predict.py: the adapter was trained on a 4-bit base and bitsandbytes is not installed: using the "
              "full-precision base, whose answers differ a little; install bitsandbytes or use merged/",
              file=sys.stderr)
        return {"dtype": dtype}
    return {"dtype": dtype, "quantization_config": BitsAndBytesConfig(**quant, bnb_4bit_compute_dtype=dtype),
            "device_map": {"": device}}


def load(export: Path, cfg: dict, args: argparse.Namespace):
    """(model, processor) from the export: merged/ as it is, or adapter/ on its base (`--base`, else the one
    adapter_config.json names)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (
        torch.bfloat16 if args.device.startswith("cuda") and torch.cuda.is_bf16_supported() else torch.float32)
    folder = export / args.model
    if args.model == "merged":
        model = AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype).to(args.device)
    else:
        from peft import PeftModel

        base = args.base or json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
        kwargs = base_kwargs(cfg, dtype, args.device, args.full_precision_base)
        model = AutoModelForImageTextToText.from_pretrained(base, **kwargs)
        model = PeftModel.from_pretrained(model if "device_map" in kwargs else model.to(args.device), folder)
    return model.eval(), AutoProcessor.from_pretrained(folder)


def image_files(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        out += sorted(f for f in p.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES) if p.is_dir() else [p]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("images", nargs="+", help="image files or folders (searched recursively)")
    ap.add_argument("--out", help="CSV to write (default: standard output)")
    ap.add_argument("--model", choices=("merged", "adapter"), help="default: merged/ when the export has one")
    ap.add_argument("--base", help="the base model for --model adapter (default: adapter_config.json's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 on a bf16 GPU, else float32), float16, ...")
    ap.add_argument("--full-precision-base", action="store_true",
                    help="--model adapter of a 4-bit (qlora) project: load the base unquantized")
    ap.add_argument("--config", default=str(HERE / "predict_config.json"))
    args = ap.parse_args(argv)
    cfg = json.loads(Path(args.config).read_text(encoding="utf-8"))
    if cfg.get("images_per_sample", 1) > 1:  # before loading anything: its answers would not be the model's
        print(f"predict.py: this model was trained on samples of {cfg['images_per_sample']} images each (and their "
              "question); predict.py asks about one image at a time, so its answers would not be what the model "
              "learned. Use `tamis predict -c CONFIG samples.jsonl` (a file in the project's trl / sharegpt / swift "
              "format, one sample of several images per record) on a machine with tamis.", file=sys.stderr)
        return 2
    export = Path(args.config).resolve().parent
    args.model = args.model or ("merged" if (export / "merged" / "config.json").is_file() else "adapter")
    model, processor = load(export, cfg, args)
    cand = answer_tokens(processor, cfg) if cfg.get("answers") else None
    columns = ["file", "answer", "probability", "mean_logprob", "error", *(f"p:{a}" for a in cfg.get("answers") or [])]
    out = open(args.out, "w", newline="", encoding="utf-8") if args.out else sys.stdout  # noqa: SIM115
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for f in image_files(args.images):
        try:
            image = prepare_image(f, cfg["image"])
        except OSError as exc:  # not an image, unreadable, truncated: a row with its reason, never a crash
            writer.writerow({"file": str(f), "error": f"{type(exc).__name__}: {exc}"})
            continue
        writer.writerow({"file": str(f), "error": "", **predict_one(model, processor, cfg, image, cand)})
    if out is not sys.stdout:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
