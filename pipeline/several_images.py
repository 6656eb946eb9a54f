"""Samples of several images on the prepared-data floor (issue 51 item 2; library parts, not yet a stage's).

- **Each image prepared as the first is** (`prepare_more_batch`): longest side `size`, aspect kept, padded square if
  configured, by the same ImagePreparer, into `more_prepared` (PNGs) and their sizes, content boxes and errors, one
  list entry per image of `more_images` (pipeline/schema.py). A sample whose later image fails keeps the reason on
  that image (`more_prep_error`), as the first image's `prep_error` does.
- **One embedding per sample** (`sample_embedding`): the mean of its images' L2-normalised embeddings, normalised
  again. Stated so a selection space is defined for any number of images: each picture weighs the same, the order
  does not matter, and a one-image sample's embedding is its image's (normalised) embedding, so a one-image
  project's selection space is the one it had (selection distances are cosine).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np

from pipeline.config import PreprocessConfig
from pipeline.errors import DataError
from pipeline.preprocess import ImagePreparer, encode_png

if TYPE_CHECKING:
    import datasets

MORE_PREPARED = ("more_prepared", "more_prep_width", "more_prep_height", "more_prep_box", "more_prep_error")


def more_prepared_features() -> dict[str, Any]:
    from datasets import List, Value

    i = Value("int32")
    return {"more_prepared": List(Value("binary")), "more_prep_width": List(i), "more_prep_height": List(i),
            "more_prep_box": List(List(i)), "more_prep_error": List(Value("string"))}


def add_more_prepared_features(features: datasets.Features) -> datasets.Features:
    from datasets import Features

    return Features({**features, **more_prepared_features()})


def prepare_more_batch(batch: dict[str, list[Any]], *, cfg: PreprocessConfig, size: int,
                       max_pixels: int) -> dict[str, list[Any]]:
    """The MORE_PREPARED columns of a batch of ingested rows (each a list, one entry per image of `more_images`)."""
    prep = ImagePreparer(cfg, size=size, max_pixels=max_pixels)
    out: dict[str, list[Any]] = {k: [] for k in MORE_PREPARED}
    for more in batch["more_images"]:
        row: dict[str, list[Any]] = {k: [] for k in MORE_PREPARED}
        for m in more or []:
            try:
                rgb, box = prep(m["image"])
                png, err = encode_png(rgb), ""
            except (DataError, ValueError, OSError, cv2.error) as exc:
                rgb, box, png = np.zeros((0, 0, 3), np.uint8), (0, 0, 0, 0), None
                err = getattr(exc, "reason", None) or f"{exc.__class__.__name__}: {exc}"
            for k, v in zip(MORE_PREPARED, (png, rgb.shape[1], rgb.shape[0], list(box), err), strict=True):
                row[k].append(v)
        for k in MORE_PREPARED:
            out[k].append(row[k])
    return out


def sample_embedding(per_image: Sequence[np.ndarray]) -> np.ndarray:
    """[d] a sample's embedding from its images' [d] embeddings (module docstring)."""
    if not per_image:
        raise DataError("sample_embedding: a sample has at least one image; got none")
    x = np.stack([np.asarray(v, dtype=np.float32) for v in per_image])
    x /= np.clip(np.linalg.norm(x, axis=1, keepdims=True), 1e-12, None)
    m = x.mean(axis=0)
    return m / max(float(np.linalg.norm(m)), 1e-12)
