"""The ingested columns of samples with several images or turns (pipeline/schema.py: `more_images`, `context`).

They exist only in a project with a conversation source (`has_more`, decided by the config, not the rows: every
shard of a project has the same columns), so a one-image project's dataset, shards and keys are what they were.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.config import DataConfig
from pipeline.data.conversations import CONVERSATION_KINDS
from pipeline.data.images import ImageRejected, open_image
from pipeline.data.readers import RawRow

if TYPE_CHECKING:
    import datasets


def has_more(data: DataConfig) -> bool:
    """Whether the project's rows carry `more_images` and `context`: some source is a conversation kind."""
    return any(s.kind in CONVERSATION_KINDS for s in data.sources)


def more_features() -> dict[str, Any]:
    from datasets import List, Value

    s = Value("string")
    return {"more_images": List({"image": Value("binary"), "image_path": s, "width": Value("int32"),
                                 "height": Value("int32"), "mode": s}),
            "context": List({"role": s, "text": s})}


def row_key_more(item: RawRow) -> list[Any]:
    """What a row's later images and turns add to its description (none for a one-image row: its key is unchanged)."""
    if not item.more and not item.context:
        return []
    return [[[m.image_path, m.image_digest] for m in item.more], [list(c) for c in item.context]]


def more_columns(row: RawRow, max_pixels: int) -> dict[str, Any] | str:
    """The row's `more_images` (each decoded to check it, as the first is) and `context`, or the reason to quarantine
    it (naming which image of how many)."""
    more = []
    for i, m in enumerate(row.more, 2):
        try:
            img = open_image(m.image, max_pixels=max_pixels)
        except ImageRejected as exc:
            return f"image {i} of {len(row.more) + 1} ({m.image_path}): {exc.reason}; replace or remove the image"
        more.append({"image": m.image, "image_path": m.image_path, "width": img.width, "height": img.height,
                     "mode": img.mode})
        img.close()
    return {"more_images": more, "context": [{"role": r, "text": t} for r, t in row.context]}


def add_more_features(features: datasets.Features) -> datasets.Features:
    from datasets import Features

    return Features({**features, **more_features()})
