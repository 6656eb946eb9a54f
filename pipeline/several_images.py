"""Samples of several images on the prepared-data floor (issue 51 item 2).

- **Each image prepared as the first is** (pipeline/preprocess.py `prepare_more_batch`, which the preprocess stage
  runs on a project with a conversation source): longest side `size`, aspect kept, padded square if configured, by
  the same ImagePreparer, into `more_prepared` (PNGs) and their sizes, content boxes and errors, one list entry per
  image of `more_images` (pipeline/schema.py). A sample whose later image fails keeps the reason on
  that image (`more_prep_error`), as the first image's `prep_error` does.
- **One embedding per sample** (`sample_embedding`): the mean of its images' L2-normalised embeddings, normalised
  again. Stated so a selection space is defined for any number of images: each picture weighs the same, the order
  does not matter, and a one-image sample's embedding is its image's (normalised) embedding, so a one-image
  project's selection space is the one it had (selection distances are cosine).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.errors import DataError


def sample_embedding(per_image: Sequence[np.ndarray]) -> np.ndarray:
    """[d] a sample's embedding from its images' [d] embeddings (module docstring)."""
    if not per_image:
        raise DataError("sample_embedding: a sample has at least one image; got none")
    x = np.stack([np.asarray(v, dtype=np.float32) for v in per_image])
    x /= np.clip(np.linalg.norm(x, axis=1, keepdims=True), 1e-12, None)
    m = x.mean(axis=0)
    return m / max(float(np.linalg.norm(m)), 1e-12)
