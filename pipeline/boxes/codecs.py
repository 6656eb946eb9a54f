"""Box codecs: boxes in original-image pixels ↔ the answer text a model family writes for them.

One small base class, one implementation per format and a plain name → class dict (`CODECS`); a model family names
its codec (`Family.box_codec` in pipeline/model/families.py), so no caller tests a family's name. The formats and
where they come from:

| codec             | text                                                            | coordinates              |
|-------------------|-----------------------------------------------------------------|--------------------------|
| `qwen2_vl_tokens` | `<|object_ref_start|>cat<|object_ref_end|><|box_start|>(x1,y1),(x2,y2)<|box_end|>` | 0–1000 |
| `qwen2_5_vl_json` | `[{"bbox_2d": [x1, y1, x2, y2], "label": "cat"}]`               | pixels of the processor's smart-resized image |
| `json_1000`       | `[{"bbox_2d": [x1, y1, x2, y2], "label": "cat"}]`               | 0–1000                   |
| `internvl_ref`    | `<ref>cat</ref><box>[[x1, y1, x2, y2]]</box>`                   | 0–1000                   |

Sources: Qwen2-VL's special tokens and 0–1000 range (QwenLM/Qwen3-VL issue #189; ms-swift PR #6178: "qwen2-vl,
internvl2.5 normalise bbox coordinates to thousandths"); Qwen2.5-VL drops the special tokens for JSON (QwenLM/Qwen3-VL
issue #733) with absolute coordinates of the image after smart_resize (ms-swift PR #6178; QwenLM/Qwen3-VL issue #1427:
"for Qwen2.5-VL adjust the gt bbox to the image size after smart_resize"); Qwen3-VL keeps the JSON and goes back to
0–1000 relative coordinates (QwenLM/Qwen3-VL issue #1427 and its cookbooks/2d_grounding.ipynb; issue #1741 notes an
Alibaba Cloud page saying 0–999: tamis writes 0–1000 as the cookbook divides by 1000); InternVL's grounding data
`<ref>…</ref><box>[[x1, y1, x2, y2]]</box>` normalised to 0–1000 (internvl.readthedocs.io, "Chat Data Format",
grounding). Idefics3/SmolVLM, Gemma 3 and LLaVA-OneVision have no grounding format of their own: tamis teaches them
`json_1000`, Qwen3-VL's, because relative coordinates survive their square resizes and tilings unchanged.

Decoding is lenient, as model output must be: a malformed or unusable piece is dropped with its reason (`Decoded`),
the rest kept; coordinates are clamped to the image.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from pipeline.boxes.box import Box, Geometry
from pipeline.errors import DataError

RELATIVE_SCALE = 1000
_NUM = r"(-?\d+(?:\.\d+)?)"
Raw = tuple[str, list[float]]  # (label, [x1, y1, x2, y2]) in the codec's units, as the text wrote them


@dataclass(frozen=True)
class Decoded:
    """What a model's answer text held: the boxes (original pixels, clamped to the image) and one reason per piece
    that was dropped (malformed, incomplete, or with no area inside the image)."""

    boxes: tuple[Box, ...]
    dropped: tuple[str, ...] = ()


class BoxCodec:
    """Boxes ↔ one answer format. `relative`: coordinates are 0–1000 of the whole image (else pixels of the
    geometry's frame). A format implements `_write` (quantised corners → text) and `_parse` (text → corners and the
    reasons of the pieces it could not read)."""

    name: ClassVar[str]
    relative: ClassVar[bool] = True

    def units(self, geometry: Geometry) -> tuple[int, int]:
        """How many text units span the frame's width and height."""
        return (RELATIVE_SCALE, RELATIVE_SCALE) if self.relative else geometry.frame_size

    def encode(self, boxes: Sequence[Box], geometry: Geometry) -> str:
        """The answer text for `boxes` (original pixels; clamped to the image, scores not written)."""
        ux, uy = self.units(geometry)
        items: list[tuple[str, list[int]]] = []
        for box in boxes:
            b = box.clamped(geometry.width, geometry.height)
            (fx1, fy1), (fx2, fy2) = geometry.to_frame(b.x, b.y), geometry.to_frame(b.x2, b.y2)
            items.append((b.label, [_quantise(fx1, ux), _quantise(fy1, uy), _quantise(fx2, ux), _quantise(fy2, uy)]))
        return self._write(items)

    def read(self, text: str, geometry: Geometry) -> Decoded:
        """Every box the text holds, in original pixels clamped to the image; what could not be used, with why."""
        raw, dropped = self._parse(text)
        ux, uy = self.units(geometry)
        boxes = []
        for label, (x1, y1, x2, y2) in raw:
            if not all(math.isfinite(v) for v in (x1, y1, x2, y2)):
                dropped.append(f"{label!r}: coordinates {[x1, y1, x2, y2]} are not finite numbers")
                continue
            ox1, oy1 = geometry.from_frame(x1 / ux, y1 / uy)
            ox2, oy2 = geometry.from_frame(x2 / ux, y2 / uy)
            box = Box.from_corners(label, ox1, oy1, ox2, oy2).clamped(geometry.width, geometry.height)
            if box.w <= 0 or box.h <= 0:
                dropped.append(f"{label!r}: box {[x1, y1, x2, y2]} has no area inside the image")
                continue
            boxes.append(box)
        return Decoded(tuple(boxes), tuple(dropped))

    def decode(self, text: str, geometry: Geometry) -> list[Box]:
        """The boxes of `read`, without the reasons."""
        return list(self.read(text, geometry).boxes)

    def _write(self, items: list[tuple[str, list[int]]]) -> str:
        raise NotImplementedError

    def _parse(self, text: str) -> tuple[list[Raw], list[str]]:
        raise NotImplementedError


def _quantise(fraction: float, units: int) -> int:
    return min(max(round(fraction * units), 0), units)


def _corners(values: Sequence[object]) -> list[float] | None:
    """Four numbers, or None (booleans are not numbers here, though Python says they are)."""
    if len(values) != 4 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return None
    return [float(v) for v in values]  # type: ignore[arg-type]


class JsonCodec(BoxCodec):
    """A JSON list of {"bbox_2d": [x1, y1, x2, y2], "label": ...}, 0–1000 (Qwen3-VL's format; tamis's for families
    without one). Reads each {...} object on its own, so one broken object (or a cut-off last one) costs only
    itself; ```json fences and prose around the list are ignored."""

    name = "json_1000"
    _OBJECT = re.compile(r"\{[^{}]*\}")

    def _write(self, items: list[tuple[str, list[int]]]) -> str:
        return json.dumps([{"bbox_2d": corners, "label": label} for label, corners in items], ensure_ascii=False)

    def _parse(self, text: str) -> tuple[list[Raw], list[str]]:
        raw: list[Raw] = []
        dropped: list[str] = []
        found = self._OBJECT.findall(text)
        for piece in found:
            try:
                obj = json.loads(piece)
            except json.JSONDecodeError as exc:
                dropped.append(f"{piece[:60]!r}: not JSON ({exc.msg})")
                continue
            corners = _corners(obj.get("bbox_2d", obj.get("bbox", ())) or ())
            if corners is None:
                dropped.append(f"{piece[:60]!r}: no bbox_2d of four numbers")
                continue
            label = obj.get("label", "")
            raw.append((label if isinstance(label, str) else str(label), corners))
        unclosed = text.count("{") - len(found)
        dropped += [f"an object left unclosed (cut-off answer?) in {text[-60:]!r}"] * max(unclosed, 0)
        return raw, dropped


class Qwen25JsonCodec(JsonCodec):
    """Qwen2.5-VL: the same JSON, in absolute pixels of the processor's smart-resized image (the geometry's frame)."""

    name = "qwen2_5_vl_json"
    relative = False


class Qwen2TokenCodec(BoxCodec):
    """Qwen2-VL: `<|object_ref_start|>label<|object_ref_end|><|box_start|>(x1,y1),(x2,y2)<|box_end|>`, 0–1000. A
    label applies to the boxes that follow it until the next label."""

    name = "qwen2_vl_tokens"
    # A piece never spans another marker, so a box left open does not swallow the good box after it.
    _PIECE = re.compile(r"<\|object_ref_start\|>((?:(?!<\|).)*?)<\|object_ref_end\|>"
                        r"|<\|box_start\|>((?:(?!<\|).)*?)<\|box_end\|>", re.S)
    _PAIR = re.compile(rf"^\s*\(\s*{_NUM}\s*,\s*{_NUM}\s*\)\s*,\s*\(\s*{_NUM}\s*,\s*{_NUM}\s*\)\s*$")

    def _write(self, items: list[tuple[str, list[int]]]) -> str:
        return "".join(f"<|object_ref_start|>{label}<|object_ref_end|><|box_start|>({x1},{y1}),({x2},{y2})"
                       "<|box_end|>" for label, (x1, y1, x2, y2) in items)

    def _parse(self, text: str) -> tuple[list[Raw], list[str]]:
        raw: list[Raw] = []
        dropped: list[str] = []
        label, boxes = "", 0
        for m in self._PIECE.finditer(text):
            if m.group(1) is not None:
                label = m.group(1).strip()
                continue
            boxes += 1
            pair = self._PAIR.match(m.group(2))
            if pair is None:
                dropped.append(f"{label!r}: box {m.group(2)[:60]!r} is not (x1,y1),(x2,y2)")
            else:
                raw.append((label, [float(v) for v in pair.groups()]))
        unclosed = text.count("<|box_start|>") - boxes
        dropped += [f"a <|box_start|> without its <|box_end|> in {text[-60:]!r}"] * max(unclosed, 0)
        return raw, dropped


class InternVLRefCodec(BoxCodec):
    """InternVL: `<ref>label</ref><box>[[x1, y1, x2, y2], ...]</box>`, 0–1000; one <box> may hold several boxes."""

    name = "internvl_ref"
    _PIECE = re.compile(r"<ref>((?:(?!<ref>|<box>).)*?)</ref>|<box>((?:(?!<box>|<ref>).)*?)</box>", re.S)
    _LIST = re.compile(r"\[([^\[\]]*)\]")

    def _write(self, items: list[tuple[str, list[int]]]) -> str:
        return "\n".join(f"<ref>{label}</ref><box>[[{x1}, {y1}, {x2}, {y2}]]</box>"
                         for label, (x1, y1, x2, y2) in items)

    def _parse(self, text: str) -> tuple[list[Raw], list[str]]:
        raw: list[Raw] = []
        dropped: list[str] = []
        label, boxes = "", 0
        for m in self._PIECE.finditer(text):
            if m.group(1) is not None:
                label = m.group(1).strip()
                continue
            boxes += 1
            lists = self._LIST.findall(m.group(2))
            if not lists:
                dropped.append(f"{label!r}: box {m.group(2)[:60]!r} holds no [x1, y1, x2, y2]")
            for inner in lists:
                corners = _numbers(inner)
                if corners is None:
                    dropped.append(f"{label!r}: [{inner[:60]}] is not four numbers")
                else:
                    raw.append((label, corners))
        unclosed = text.count("<box>") - boxes
        dropped += [f"a <box> without its </box> in {text[-60:]!r}"] * max(unclosed, 0)
        return raw, dropped


def _numbers(inner: str) -> list[float] | None:
    parts = [p.strip() for p in inner.split(",")]
    if len(parts) != 4 or not all(re.fullmatch(_NUM, p) for p in parts):
        return None
    return [float(p) for p in parts]


CODECS: dict[str, type[BoxCodec]] = {c.name: c for c in (JsonCodec, Qwen25JsonCodec, Qwen2TokenCodec,
                                                          InternVLRefCodec)}


def get_codec(name: str) -> BoxCodec:
    if name not in CODECS:
        raise DataError(f"unknown box codec {name!r}; known: {', '.join(CODECS)}")
    return CODECS[name]()


def answer_classes(text: str | None) -> list[str]:
    """The classes a box answer names, one per box it can read, whichever codec's format the text is in: the formats
    differ in their markup (JSON, Qwen2-VL's tokens, InternVL's tags), and a class is read the same way whatever the
    coordinates' unit, so no geometry is needed. What class-balanced selection counts."""
    if not text:
        return []
    best: list[str] = []
    for codec in CODECS.values():
        raw, _ = codec()._parse(text)
        if len(raw) > len(best):
            best = [label for label, _ in raw]
    return best
