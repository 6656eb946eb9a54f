"""The demo dataset: scikit-learn's 1,797 handwritten digits (8×8, bundled with scikit-learn, no download) as a visual
question-answering task. Pool rows carry no answer; their answers sit in ground_truth.jsonl for the simulated
annotator, keyed by the same sample_id ingestion computes.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.schema import sample_id_for
from pipeline.store import atomic_write_bytes, atomic_write_jsonl

log = logging.getLogger(__name__)

DIGITS_QUESTION = "Which digit is shown in the image?"
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
# Open-answer variant: one question per image, each answered with a short free-text string (no closed answer set).
OPEN_QUESTIONS: dict[str, Any] = {
    "Write the digit shown in words.": lambda d: NUMBER_WORDS[d],
    "Is the digit even or odd?": lambda d: "odd" if d % 2 else "even",
    "What is the digit plus one, in words?": lambda d: NUMBER_WORDS[d + 1],
}


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def _write_if_changed(path: Path, data: bytes) -> None:
    # Re-runs leave identical files untouched (no rewrite, no fsync), so a second call is cheap and byte-identical.
    if not (path.is_file() and path.read_bytes() == data):
        atomic_write_bytes(path, data)


def _balanced(target: np.ndarray, limit: int | None) -> np.ndarray:
    """Indices of the first `limit` samples taken round-robin over the classes (all of them when limit is None)."""
    if limit is None or limit >= len(target):
        return np.arange(len(target))
    if limit < 1:
        raise ValueError(f"limit must be ≥ 1, got {limit}")
    classes = np.unique(target)
    per_class = [np.flatnonzero(target == c) for c in classes]
    take = [limit // len(classes) + (k < limit % len(classes)) for k in range(len(classes))]
    return np.sort(np.concatenate([idx[:n] for idx, n in zip(per_class, take, strict=True)]))


def _stratified_test(target: np.ndarray, test_fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of test rows: the same fraction of every class, chosen by a seeded shuffle."""
    rng = np.random.default_rng(seed)
    test = np.zeros(len(target), dtype=bool)
    for c in np.unique(target):
        idx = np.flatnonzero(target == c)
        # Half-up rounding, and at least one test row per class, so tiny slices still evaluate every digit.
        n = int(np.floor(len(idx) * test_fraction + 0.5))
        if test_fraction > 0 and len(idx) > 1:
            n = max(n, 1)
        test[rng.permutation(idx)[:n]] = True
    return test


def write_digits(out_dir: str | Path, *, limit: int | None = None, test_fraction: float = 0.25, seed: int = 0,
                 open_answers: bool = False) -> Path:
    """Write images/<index>.png, manifest.jsonl and ground_truth.jsonl under `out_dir`; returns `out_dir`.

    Split is fixed by `seed`: a stratified `test_fraction` of each digit is "test" (answer given), the rest "pool"
    (no answer). `limit` keeps a small slice balanced over the digits, for tests. `open_answers` asks each image one
    of OPEN_QUESTIONS (a seeded draw) whose answer is free text ("seven", "odd", "eight"): the data for a project
    with `data.answers: null`.
    """
    from sklearn.datasets import load_digits

    if not 0 <= test_fraction < 1:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    out_dir = Path(out_dir)
    digits = load_digits()
    # Raw values are 0..16 (counts of set pixels in 4×4 blocks); stretch to the full 8-bit grey range.
    images = np.rint(digits.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    keep = _balanced(digits.target, limit)
    test = _stratified_test(digits.target[keep], test_fraction, seed)
    manifest, truth = [], []
    asked = np.random.default_rng(seed + 1).integers(0, len(OPEN_QUESTIONS), len(keep))
    questions = list(OPEN_QUESTIONS)
    for i, is_test, q in zip(keep, test, asked, strict=True):
        rel = f"images/{int(i)}.png"
        data = _png(images[i])
        _write_if_changed(out_dir / rel, data)
        digit = int(digits.target[i])
        question = questions[q] if open_answers else DIGITS_QUESTION
        answer = OPEN_QUESTIONS[question](digit) if open_answers else str(digit)
        row = {"image": rel, "question": question, "split": "test" if is_test else "pool"}
        manifest.append({**row, "answer": answer} if is_test else row)
        truth.append({"sample_id": sample_id_for(data, question), "image": rel, "answer": answer})
    atomic_write_jsonl(out_dir / "manifest.jsonl", manifest)
    atomic_write_jsonl(out_dir / "ground_truth.jsonl", truth)
    log.info("demo digits%s: %d images (%d test, %d pool) in %s", " (open answers)" if open_answers else "",
             len(keep), int(test.sum()), int((~test).sum()), out_dir)
    return out_dir
