"""The report's pictures as bytes: thumbnails and the batch's contact sheet (Pillow), the pool map, the confusion
matrix and the learning curve (matplotlib, Agg). No timestamps in the files, so the same round gives the same bytes."""

from __future__ import annotations

import base64
import io
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from pipeline.roundreport.gather import BatchItem
from pipeline.roundreport.poolmap import KINDS, PoolMap

THUMB = 96  # CSS pixels = image pixels: the page shows thumbnails at their own size (sharp, and checkable)
SHEET_CELL = (150, 208)  # the contact sheet's cell: a 138 px thumbnail and five lines of text
SHEET_COLUMNS = 8
SHEET_MAX = 40  # samples on the Prefect UI's contact sheet (the page shows the whole batch)


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


def _open(png: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(png))
    img.load()
    return img.convert("RGB")


def _fit(img: Image.Image, side: int) -> Image.Image:
    """Longest side → `side`: small images (28 px digits) grow by whole pixels (NEAREST keeps strokes crisp), large
    ones shrink smoothly."""
    scale = side / max(img.size)
    size = (max(1, round(img.width * scale)), max(1, round(img.height * scale)))
    return img.resize(size, Image.Resampling.NEAREST if scale >= 1 else Image.Resampling.LANCZOS)


def thumbnail(png: bytes, side: int = THUMB) -> tuple[bytes, str, tuple[int, int]]:
    """(encoded thumbnail, its MIME type, its size): PNG or JPEG (quality 85), whichever is smaller — flat digits
    compress best as PNG, photographs as JPEG."""
    img = _fit(_open(png), side)
    out = []
    for fmt, mime, opts in (("PNG", "image/png", {}), ("JPEG", "image/jpeg", {"quality": 85})):
        buf = io.BytesIO()
        img.save(buf, format=fmt, **opts)
        out.append((len(buf.getvalue()), buf.getvalue(), mime))
    _, data, mime = min(out, key=lambda o: o[0])
    return data, mime, img.size


def _font(size: int) -> Any:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: the bitmap font only
        return ImageFont.load_default()


def item_lines(item: BatchItem) -> list[str]:
    """The caption of a batch sample on the contact sheet: the user's file name, rank and the model's answer, its
    runner-up, the uncertainty, the reason."""
    if item.top:
        lines = [f"#{item.rank + 1}  {item.top[0][0]} {item.top[0][1]:.2f}",
                 "  ".join(f"{a} {p:.2f}" for a, p in item.top[1:3])]
    elif item.answer is not None:
        lines = [f"#{item.rank + 1}  “{item.answer}”", "" if item.confidence is None else f"{item.confidence:.2f}"]
    else:
        lines = [f"#{item.rank + 1}", "no model answer yet"]
    lines.append(f"entropy {item.entropy:.2f}" if item.entropy is not None else
                 f"score {item.score:.3f}" if item.score is not None else "")
    return [item.name or item.sample_id, *lines, item.reason.split(";")[0].split(", spread")[0]]


def _clip(draw: Any, text: str, font: Any, width: int) -> str:
    """`text` cut (with an ellipsis) to fit `width` pixels: a long answer must not run into the next cell."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "…", font=font) > width:
        text = text[:-1]
    return text + "…"


def contact_sheet(items: Sequence[BatchItem], images: Mapping[str, bytes], *, limit: int = SHEET_MAX) -> bytes | None:
    """The batch (its first `limit` picks) as one PNG: thumbnails in pick order, each with its caption."""
    shown = [i for i in items if i.sample_id in images][:limit]
    if not shown:
        return None
    cw, ch = SHEET_CELL
    cols = min(SHEET_COLUMNS, len(shown))
    sheet = Image.new("RGB", (cols * cw, -(-len(shown) // cols) * ch), "white")
    draw, font = ImageDraw.Draw(sheet), _font(11)
    for k, item in enumerate(shown):
        x, y = (k % cols) * cw, (k // cols) * ch
        thumb = _fit(_open(images[item.sample_id]), cw - 12)
        sheet.paste(thumb, (x + (cw - thumb.width) // 2, y + 4 + (cw - 12 - thumb.height) // 2))
        for n, line in enumerate(item_lines(item)):
            draw.text((x + 6, y + cw - 4 + 12 * n), _clip(draw, line, font, cw - 10), fill=(20, 20, 20), font=font)
    buf = io.BytesIO()
    sheet.save(buf, format="PNG")
    return buf.getvalue()


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and workers
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None}, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


STYLE = {"other": dict(c="#d9d9d9", s=6, label="rest of the pool"),
         "candidate": dict(c="#8c8c8c", s=8, label="scored candidates"),
         "outlier": dict(c="black", s=30, marker="x", label="outliers"),
         "selected": dict(facecolors="none", edgecolors="#d62728", s=70, linewidths=1.6, label="selected this round")}


def class_colours(n: int) -> list[Any]:
    """Per-class colours without the greys the unlabeled pool is drawn in: tab10 less its grey plus navy up to 10
    classes, tab20's dark then light hues (greys left out) beyond."""
    plt = _plt()
    if n <= 10:
        return [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7] + ["#000075"]
    tab20 = plt.get_cmap("tab20").colors
    return [tab20[i] for i in [*range(0, 20, 2), *range(1, 20, 2)] if i not in (14, 15)]


def pool_map_png(pm: PoolMap) -> bytes:
    """The projected sample: the pool in greys, labeled points in their class's colour, outliers as crosses, the
    batch as red rings on top."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 6), dpi=90)
    kinds = np.array(pm.kind)
    classes = sorted({lab for lab in pm.label if lab is not None})
    colours = class_colours(len(classes))
    for kind in KINDS:
        mask = kinds == kind
        if not mask.any():
            continue
        if kind == "labeled":
            for k, c in enumerate(classes):
                m = mask & np.array([lab == c for lab in pm.label])
                ax.scatter(pm.xy[m, 0], pm.xy[m, 1], s=16, color=colours[k % len(colours)], label=f"labeled: {c}"
                           if len(classes) <= 20 else None)
        else:
            ax.scatter(pm.xy[mask, 0], pm.xy[mask, 1], **STYLE[kind])
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(f"Pool map: {pm.sampled:,} of {pm.total:,} points, 2-D PCA of {pm.space}", fontsize=10)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    return _png(fig)


def confusion_png(pc: Mapping[str, Any], eval_dir: str | Path | None) -> bytes:
    """The evaluation's own confusion.png (pipeline.perclass draws it), or the same drawing of `pc` for an
    evaluation written before it had one."""
    from pipeline.perclass import CONFUSION_FILE, plot_confusion

    if eval_dir and (own := Path(eval_dir) / CONFUSION_FILE).is_file():
        return own.read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        return plot_confusion(pc, Path(tmp) / CONFUSION_FILE).read_bytes()
