"""A box project's codec and frame for a model family: what pipeline/boxes/rows.py needs to turn box labels into the
family's answer text (training) and the model's text back into boxes (evaluation, scoring, export).

The codec is the family's (`Family.box_codec`). A relative codec (0-1000 of the image) needs no frame; an absolute
one (Qwen2.5-VL: pixels of the processor-resized image) needs the processor's frame for each prepared canvas, which
`Family.box_frame` computes from the processor. Prepared images are passed at their own size, so the frame is
taken with the canvas's longest side as the image size, as the family's processor call does.
"""

from __future__ import annotations

from typing import Any

from pipeline.boxes.codecs import BoxCodec, get_codec
from pipeline.boxes.rows import Frame
from pipeline.config import ModelConfig
from pipeline.model.families import Family


def codec_and_frame(family: Family, processor: Any | None) -> tuple[BoxCodec, Frame | None]:
    """The family's codec, and the frame function when its coordinates count the processor's pixels."""
    codec = get_codec(family.box_codec)
    if codec.relative:
        return codec, None
    if processor is None:
        raise ValueError(f"{family.name}: its box codec {codec.name!r} writes pixels of the processor's frame, and "
                         "no processor was given; pass the model's processor")
    return codec, lambda width, height: family.box_frame(processor, width, height)


def training_codec(model_cfg: ModelConfig) -> tuple[BoxCodec, Frame | None]:
    """codec_and_frame for the configured base model, loading its processor only when the codec needs it."""
    from pipeline.model.loading import resolve_family

    family = resolve_family(model_cfg)
    if get_codec(family.box_codec).relative:
        return codec_and_frame(family, None)
    from transformers import AutoProcessor

    return codec_and_frame(family, AutoProcessor.from_pretrained(model_cfg.name_or_path))
