"""A box in original-image pixels, and the geometry that carries it to the pixels a model sees and back.

Three frames, one after the other:
  original image (width × height)
  → tamis's prepared canvas (pipeline/preprocess.py: longest side resized to N with the aspect kept, then optionally
    padded to a square; `content` is the `prep_box` the prepare stage records: where the image sits in the canvas)
  → the processor's own resize of the canvas (`frame`): Qwen2-VL-style processors smart-resize it to multiples of
    their merged-patch size, which is the pixel grid Qwen2.5-VL's absolute coordinates count. Processors that resize
    to a fixed square or cut tiles need no frame: their families answer in coordinates relative to the whole image
    (0–1000), which any stretch of the canvas leaves unchanged, so `frame` is the canvas there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.errors import DataError


@dataclass(frozen=True)
class Box:
    """An axis-aligned box in the original image's pixels: top-left (x, y), size (w, h); `score` for predictions."""

    label: str
    x: float
    y: float
    w: float
    h: float
    score: float | None = None

    @property
    def x2(self) -> float:
        return self.x + self.w

    @property
    def y2(self) -> float:
        return self.y + self.h

    @classmethod
    def from_corners(cls, label: str, x1: float, y1: float, x2: float, y2: float,
                     score: float | None = None) -> Box:
        """From two opposite corners in any order (models sometimes write them swapped)."""
        left, right, top, bottom = min(x1, x2), max(x1, x2), min(y1, y2), max(y1, y2)
        return cls(label, left, top, right - left, bottom - top, score)

    def clamped(self, width: float, height: float) -> Box:
        """This box cut to the image [0, width] × [0, height] (zero-sized when it lies wholly outside)."""
        x1, y1 = min(max(self.x, 0.0), width), min(max(self.y, 0.0), height)
        x2, y2 = min(max(self.x2, 0.0), width), min(max(self.y2, 0.0), height)
        return Box(self.label, x1, y1, x2 - x1, y2 - y1, self.score)


def smart_resize(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) that Qwen2-VL-style image processors resize an image to: both sides multiples of `factor`
    (patch × merge), the pixel count within [min_pixels, max_pixels], the aspect kept as closely as the grid allows.

    The rule of transformers' `models/qwen2_vl/image_processing_qwen2_vl.py:smart_resize` (also
    qwen_vl_utils.smart_resize), restated here so the box codecs need no transformers import; the tests check it
    against the real processor's `image_grid_thw`."""
    if min(height, width) <= 0:
        raise DataError(f"smart_resize: image of {width}×{height} px has an empty side")
    h_bar = round(height / factor) * factor  # a side under factor / 2 rounds to 0: the min_pixels branch fixes it
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# A prepared row's columns a Geometry is built from (pipeline/preprocess.py writes them)
GEOMETRY_COLUMNS = ("width", "height", "prep_box", "prep_width", "prep_height")


@dataclass(frozen=True)
class Geometry:
    """Original image → prepared canvas → the processor's frame, as plain numbers.

    `width`, `height`: the original image. `content`: (x, y, w, h) of the image inside the canvas (the prepare
    stage's `prep_box`). `canvas`: (w, h) of the prepared image (`prep_width`, `prep_height`). `frame`: (w, h) the
    processor resizes the canvas to (the family's `box_frame`); the canvas itself when not given.
    """

    width: int
    height: int
    content: tuple[int, int, int, int]
    canvas: tuple[int, int]
    frame: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        cx, cy, cw, ch = self.content
        if min(self.width, self.height, cw, ch) <= 0 or min(self.canvas) <= 0:
            raise DataError(f"box geometry: empty image (original {self.width}×{self.height}, content {self.content}"
                            f", canvas {self.canvas}); boxes need the prepared row's prep_box and prep_width/height")
        if cx < 0 or cy < 0 or cx + cw > self.canvas[0] or cy + ch > self.canvas[1]:
            raise DataError(f"box geometry: content {self.content} does not fit the canvas {self.canvas}; pass the "
                            "prepare stage's prep_box with its own prep_width/prep_height")
        if self.frame is not None and min(self.frame) <= 0:
            raise DataError(f"box geometry: frame {self.frame} is empty; pass the processor's resized size")

    @property
    def frame_size(self) -> tuple[int, int]:
        return self.frame or self.canvas

    def to_frame(self, x: float, y: float) -> tuple[float, float]:
        """Original pixels → fractions (0..1) of the frame, which are fractions of the canvas too."""
        cx, cy, cw, ch = self.content
        return ((cx + x * cw / self.width) / self.canvas[0], (cy + y * ch / self.height) / self.canvas[1])

    def from_frame(self, fx: float, fy: float) -> tuple[float, float]:
        """Fractions (0..1) of the frame → original pixels (not clamped: the caller clamps to the image)."""
        cx, cy, cw, ch = self.content
        return ((fx * self.canvas[0] - cx) * self.width / cw, (fy * self.canvas[1] - cy) * self.height / ch)
