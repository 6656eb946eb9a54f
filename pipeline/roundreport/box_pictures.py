"""A box project's pictures in the round report: each prepared picture with its labeled boxes (green) and the
model's boxes (orange, read from its answer text by the family's codec) drawn where they lie, so the contact sheet
and the error gallery show what was labeled and what the model found, not only the answer text.

The boxes are in the original image's pixels (the ledger's box label, the codec's reading); the picture is the
prepared canvas, so each box goes through the row's geometry (pipeline/boxes/rows.py: row_geometry). A codec that
counts the processor's pixels (Qwen2.5-VL's) needs the processor's frame, which the report does not load: its
answers stay text and only the labeled boxes are drawn."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

from PIL import Image, ImageDraw

from pipeline.boxes.answer import parse_box_label
from pipeline.boxes.box import GEOMETRY_COLUMNS, Box, Geometry
from pipeline.boxes.codecs import get_codec
from pipeline.boxes.rows import row_geometry
from pipeline.errors import DataError
from pipeline.roundreport.pictures import _font

LABELED = (0, 160, 60)
PREDICTED = (240, 100, 0)


def draw_boxes(png: bytes, geometry: Geometry, labeled: Sequence[Box], predicted: Sequence[Box]) -> bytes:
    """`png` (the prepared canvas) with the labeled boxes in green and the predicted ones in orange, each named by
    its class (and a predicted box's score) at its top-left corner."""
    img = Image.open(io.BytesIO(png)).convert("RGB")
    draw = ImageDraw.Draw(img)
    # Drawn at the canvas's scale, seen as a ~100 px thumbnail: lines and captions sized to survive the shrink.
    width, font = max(1, round(max(img.size) / 70)), _font(max(10, round(max(img.size) / 13)))
    sx, sy = img.width, img.height  # to_frame's fractions of the canvas → this picture's pixels
    for boxes, colour in ((labeled, LABELED), (predicted, PREDICTED)):
        for b in boxes:
            (x1, y1), (x2, y2) = geometry.to_frame(b.x, b.y), geometry.to_frame(b.x + b.w, b.y + b.h)
            rect = (x1 * sx, y1 * sy, max(x1 * sx, x2 * sx - 1), max(y1 * sy, y2 * sy - 1))
            draw.rectangle(rect, outline=colour, width=width)
            text = b.label if b.score is None else f"{b.label} {b.score:.2f}"
            if img.width >= 96:  # on a tiny canvas a caption would hide the box
                # The label's caption at the top, the prediction's at the bottom: a good prediction shares the corner.
                at = rect[1] + width if colour == LABELED else rect[3] - width - font.size
                draw.text((rect[0] + width + 1, at), text, fill=colour, font=font)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _boxes(read: Any, text: str | None) -> list[Box]:
    """The boxes a label or an answer holds; none for a missing or unreadable one (the page shows its text)."""
    if not text:
        return []
    try:
        return list(read(text))
    except (DataError, ValueError):
        return []


def overlay(pngs: Mapping[str, bytes], geometries: Mapping[str, Mapping[str, Any]], labels: Mapping[str, str | None],
            answers: Mapping[str, str | None], codec_name: str) -> dict[str, bytes]:
    """`pngs` (sample ID → prepared picture) with each sample's labeled boxes (`labels`: box label JSON) and the
    model's boxes (`answers`: the codec's text) drawn; a sample without its geometry is left as it is."""
    codec = get_codec(codec_name)
    out = dict(pngs)
    for sid, png in pngs.items():
        row = geometries.get(sid) or {}
        if not all(row.get(c) is not None for c in GEOMETRY_COLUMNS):
            continue
        g = row_geometry(row)
        labeled = _boxes(parse_box_label, labels.get(sid))
        predicted = _boxes(lambda t, g=g: codec.decode(t, g), answers.get(sid)) if codec.relative else []
        if labeled or predicted:
            out[sid] = draw_boxes(png, g, labeled, predicted)
    return out


def box_errors(rows: Sequence[Mapping[str, Any]], geometries: Mapping[str, Mapping[str, Any]], codec_name: str,
               top: int) -> list[dict[str, Any]] | None:
    """A box project's error gallery: the test rows (the evaluation's predictions.jsonl) whose boxes the model got
    wrong (pipeline/boxes/mistakes.py: missed, wrong class, misplaced, extra), the most errors first, then the most
    confident; each row gains `errors` (the sentence) and `error_counts`. None when the codec's boxes cannot be read
    here (a codec counting the processor's pixels): the caller falls back to comparing the text."""
    from pipeline.boxes.mistakes import box_mistakes

    codec = get_codec(codec_name)
    if not codec.relative:
        return None
    out = []
    for r in rows:
        row = geometries.get(str(r["sample_id"])) or {}
        if not all(row.get(c) is not None for c in GEOMETRY_COLUMNS):
            continue
        g = row_geometry(row)
        m = box_mistakes(_boxes(parse_box_label, r.get("answer")),
                         _boxes(lambda t, g=g: codec.decode(t, g), r.get("prediction")))
        if m.count:
            out.append({**r, "errors": m.sentence(), "error_counts": m.counts(), "error_total": m.count})
    conf = lambda r: r.get("confidence") if r.get("confidence") is not None else -1.0  # noqa: E731
    return sorted(out, key=lambda r: (-r["error_total"], -conf(r), str(r["sample_id"])))[:top]
