"""Does the 4-bit model still say what the original says? Same batch through NF4 and 16-bit (fp32 on CPU) weights.

Reports top-1 agreement of next-token predictions and the mean KL(reference ‖ 4-bit), over every real prompt position
and over the last one alone (the position that predicts the answer, which scoring reads).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from pipeline.config import ModelConfig
from pipeline.errors import DataError
from pipeline.model.loading import load_model

log = logging.getLogger(__name__)


def synthetic_images(n: int, size: int = 64, seed: int = 0) -> list[Image.Image]:
    """Seeded noise plus a bright rectangle: varied, content-bearing inputs when no data is at hand."""
    rng = np.random.default_rng(seed)
    images = []
    for _ in range(n):
        arr = rng.integers(0, 80, (size, size, 3), dtype=np.uint8)
        y, x = rng.integers(0, size // 2, 2)
        arr[y: y + size // 3, x: x + size // 3] = rng.integers(150, 256, 3, dtype=np.uint8)
        images.append(Image.fromarray(arr))
    return images


def _batch(rows: Sequence[Any]) -> tuple[list[Image.Image], list[str]]:
    images, questions = [], []
    for i, r in enumerate(rows):
        if isinstance(r, tuple):
            image, question = r
        else:
            data = r.get("prepared") or r.get("image")
            if not data:
                raise DataError(f"check-quant row {i}: no image bytes in 'prepared' or 'image'")
            image, question = Image.open(io.BytesIO(data)), r.get("question")
        if not isinstance(question, str) or not question:
            raise DataError(f"check-quant row {i}: question is {question!r}; a non-empty string is needed")
        images.append(image.convert("RGB"))
        questions.append(question)
    if not images:
        raise DataError("check-quant needs at least one row")
    return images, questions


@torch.no_grad()
def _logprobs(model_cfg: ModelConfig, images: list[Image.Image], questions: list[str], hw: Any) -> tuple[Any, ...]:
    loaded = load_model(model_cfg, hw=hw)
    enc = loaded.family.encode(loaded.processor, images, questions)
    device = next(loaded.model.parameters()).device
    out = loaded.model(**{k: v.to(device) for k, v in enc.items()})
    logp = torch.log_softmax(out.logits.float(), dim=-1).cpu()
    info = loaded.info
    del loaded, out
    return logp, enc["attention_mask"].bool(), info


def check_quant(model_cfg: ModelConfig, rows: Sequence[Any], *, hw: Any = None) -> dict[str, Any]:
    """Compare the NF4 model with the 16-bit one (fp32 on CPU) on `rows` ((image, question) pairs or row dicts)."""
    images, questions = _batch(rows)
    ref_cfg = model_cfg.model_copy(update={"mode": "lora"})
    q_cfg = model_cfg.model_copy(update={"mode": "qlora"})
    ref, mask, ref_info = _logprobs(ref_cfg, images, questions, hw)
    q, _, q_info = _logprobs(q_cfg, images, questions, hw)
    kl = (ref.exp() * (ref - q)).sum(-1)  # [n, t]
    agree = ref.argmax(-1) == q.argmax(-1)
    last = torch.zeros_like(mask)
    last[:, -1] = True  # prompts are left-padded: the last column is every row's final prompt token
    result = {
        "model": ref_info["source"],
        "family": ref_info["family"],
        "n_samples": len(images),
        "positions": int(mask.sum()),
        "top1_agreement": float(agree[mask].float().mean()),
        "top1_agreement_last": float(agree[last].float().mean()),
        "mean_kl": float(kl[mask].mean()),
        "mean_kl_last": float(kl[last].mean()),
        "max_kl": float(kl[mask].max()),
        "reference_dtype": ref_info["weights_dtype"],
        "quantized": "nf4 + double quantization",
        "compute_dtype": q_info["compute_dtype"],
        "reference_footprint_mb": ref_info["memory_footprint_mb"],
        "quantized_footprint_mb": q_info["memory_footprint_mb"],
        "footprint_ratio": round(q_info["memory_footprint_mb"] / max(ref_info["memory_footprint_mb"], 1e-9), 4),
    }
    log.info("4-bit vs %s: top-1 agreement %.3f (last position %.3f), mean KL %.4g", result["reference_dtype"],
             result["top1_agreement"], result["top1_agreement_last"], result["mean_kl"])
    return result
