"""Generated scenes for box work: shapes pasted at known places on canvases of mixed aspect ratio, so a demo, a
benchmark or a test has boxes whose truth is exact, with no data set to download.

A scene is its layout (`Scene`: the canvas size and one `Box` per object, in pixels) and its picture (`render`:
a noisy, slightly tinted background with each shape filled in a random colour inside its box). Objects never
overlap, so each box's pixels are its shape's alone. The classes are the shapes (`SHAPES`); the aspect ratios run
from 2:1 wide to 1:2 tall (`CANVASES`), the case that breaks a box codec which forgets the padding.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.boxes.box import Box
from pipeline.boxes.readers import BoxSet

if TYPE_CHECKING:
    from PIL.Image import Image

SHAPES = ("disc", "square", "triangle")
CANVASES = ((640, 480), (480, 640), (800, 400), (512, 512), (300, 600), (720, 405))


@dataclass(frozen=True)
class Scene:
    name: str
    width: int
    height: int
    boxes: tuple[Box, ...]
    seed: int


def _free(box: tuple[float, float, float, float], placed: Sequence[Box], gap: float) -> bool:
    x, y, w, h = box
    return all(x + w + gap <= b.x or b.x2 + gap <= x or y + h + gap <= b.y or b.y2 + gap <= y for b in placed)


def make_scene(name: str, seed: int, *, labels: Sequence[str] = SHAPES, canvases: Sequence[tuple[int, int]] = CANVASES,
               objects: tuple[int, int] = (1, 5), size: tuple[float, float] = (0.12, 0.35)) -> Scene:
    """One scene's layout: a canvas from `canvases`, `objects` (min, max) shapes of classes `labels`, each box's
    side a fraction `size` (min, max) of the canvas's shorter side, placed without overlap (a shape that finds no
    free place in 50 tries is left out, so a crowded canvas may hold fewer)."""
    rng = random.Random(seed)
    width, height = rng.choice(list(canvases))
    short = min(width, height)
    placed: list[Box] = []
    for _ in range(rng.randint(*objects)):
        for _try in range(50):
            w = round(rng.uniform(*size) * short)
            h = round(w * rng.uniform(0.7, 1.4))
            h = min(h, height - 2)
            x, y = rng.randint(1, width - w - 1), rng.randint(1, height - h - 1)
            if _free((x, y, w, h), placed, gap=4):
                placed.append(Box(rng.choice(list(labels)), float(x), float(y), float(w), float(h)))
                break
    return Scene(name, width, height, tuple(placed), seed)


def make_scenes(n: int, seed: int = 0, **kwargs: object) -> list[Scene]:
    """`n` scenes named scene_0000.png…, each from its own seed (the same `seed` gives the same scenes)."""
    return [make_scene(f"scene_{i:04d}.png", seed * 1_000_003 + i, **kwargs) for i in range(n)]  # type: ignore[arg-type]


def render(scene: Scene) -> Image:
    """The scene's picture: each shape fills its box (a disc its inscribed ellipse, a triangle pointing up) in a
    colour far from the background's."""
    import numpy as np
    from PIL import Image as PILImage
    from PIL import ImageDraw

    rng = np.random.default_rng(scene.seed)
    base = rng.integers(90, 140, size=3)
    noise = rng.normal(0, 12, size=(scene.height, scene.width, 3))
    canvas = PILImage.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(canvas)
    for b in scene.boxes:
        colour = tuple(int(c) for c in rng.choice([20, 230], size=3))
        x1, y1, x2, y2 = b.x, b.y, b.x2 - 1, b.y2 - 1
        if b.label == "disc":
            draw.ellipse((x1, y1, x2, y2), fill=colour)
        elif b.label == "triangle":
            draw.polygon([((x1 + x2) / 2, y1), (x2, y2), (x1, y2)], fill=colour)
        else:
            draw.rectangle((x1, y1, x2, y2), fill=colour)
    return canvas


def write_scenes(folder: str | Path, scenes: Sequence[Scene]) -> BoxSet:
    """Render `scenes` into `folder` (PNG, under each scene's name) and return their boxes as a BoxSet, ready for
    pipeline/boxes/writers.py (COCO, YOLO, Label Studio)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = BoxSet(labels=tuple(dict.fromkeys(b.label for s in scenes for b in s.boxes)))
    for s in scenes:
        render(s).save(folder / s.name)
        out.images[s.name] = list(s.boxes)
        out.sizes[s.name] = (s.width, s.height)
    return out


def scene_labels(scenes: Sequence[Scene], names: Sequence[str]) -> BoxSet:
    """What an annotator would hand back for a batch of scenes: the true boxes of the scenes named `names` (the
    batch's original file names, names.json), the class list in SHAPES' order, ready for write_coco."""
    truth = {s.name: s for s in scenes}
    return BoxSet(labels=SHAPES, images={n: list(truth[n].boxes) for n in names},
                  sizes={n: (truth[n].width, truth[n].height) for n in names})
