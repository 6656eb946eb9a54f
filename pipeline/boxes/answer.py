"""A box label as the ledger keeps it: canonical JSON text in the entry's `label` field.

Why text in the existing field, not a field of its own: every ledger line, vote, correction, carry and cache key of
a one-answer project stays byte-for-byte what it was, and everything that moves labels around (corrections,
labels that follow re-saved images, lineage, the budget) already moves a string. The text is canonical — boxes in
original pixels rounded to 0.1 px, sorted, compact JSON, no scores (a label is not a prediction) — so two
annotators who drew the same boxes write the same text, and a re-import of an unchanged label is no correction.

    [{"box":[12.0,40.0,200.0,150.0],"label":"cat"}]      one cat: [x, y, w, h] in the image's own pixels
    []                                                   an image checked and found empty (a label, not a gap)
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from pipeline.boxes.box import Box
from pipeline.errors import DataError

DECIMALS = 1  # 0.1 px: finer than any annotation tool draws, coarse enough that float noise never changes the text


def box_label(boxes: Sequence[Box]) -> str:
    """The canonical label text of `boxes` (original pixels)."""
    rows = []
    for b in boxes:
        values = [round(v, DECIMALS) + 0.0 for v in (b.x, b.y, b.w, b.h)]  # + 0.0: no "-0.0" in the text
        if not all(math.isfinite(v) for v in values) or values[2] <= 0 or values[3] <= 0:
            raise DataError(f"box label: box {b.label!r} {values} needs finite coordinates and a positive size")
        rows.append({"box": values, "label": b.label})
    rows.sort(key=lambda r: (r["box"][1], r["box"][0], r["box"][2], r["box"][3], r["label"]))
    return json.dumps(rows, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def parse_box_label(text: str, *, where: str = "box label") -> list[Box]:
    """The boxes of a label text written by `box_label` (or by hand in the same shape)."""
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not JSON ({exc.msg} at column {exc.colno}); a box label is a JSON list like "
                        '[{"label": "cat", "box": [x, y, w, h]}]') from None
    if not isinstance(rows, list):
        raise DataError(f"{where}: a box label is a JSON list of boxes, got a {type(rows).__name__}")
    out = []
    for i, r in enumerate(rows):
        box = r.get("box") if isinstance(r, dict) else None
        label = r.get("label") if isinstance(r, dict) else None
        ok = isinstance(box, list) and len(box) == 4 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in box)
        if not ok or not isinstance(label, str) or not label.strip():
            raise DataError(f"{where}: box {i} must be {{\"label\": name, \"box\": [x, y, w, h]}} with numbers, "
                            f"got {r!r}")
        if box[2] <= 0 or box[3] <= 0:
            raise DataError(f"{where}: box {i} ({label!r}) has no area: {box}")
        out.append(Box(label, *map(float, box)))
    return out


def is_box_label(text: str) -> bool:
    """Whether `text` reads as a box label (a one-answer label never starts with '[')."""
    try:
        parse_box_label(text)
    except DataError:
        return False
    return True


def label_problem(text: str, labels: Sequence[str], *, where: str = "box label") -> str | None:
    """Why `text` is not a box label over the class list `labels` (not one, or naming a class outside it); None when
    it is one."""
    try:
        boxes = parse_box_label(text, where=where)
    except DataError as exc:
        return str(exc)
    unknown = sorted({b.label for b in boxes} - set(labels))
    return f"{where}: classes {unknown} are not in the class list {list(labels)}" if unknown else None
