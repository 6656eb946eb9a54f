"""Box labels through a round's prepared rows: what the train and evaluate stages of a box project will call.

A prepared row (pipeline/preprocess.py) knows the original image's `width` × `height`, where it sits in the
prepared canvas (`prep_box`) and the canvas's size (`prep_width` × `prep_height`): the `Geometry` a family's codec
needs. The ledger keeps a box label as canonical JSON in original pixels (pipeline/boxes/answer.py); the model
learns and writes the codec's text in its own frame. So:

- training: the row's `answer` (a box label) becomes the codec's text for those boxes (`training_rows`);
- evaluation: the model's text is read back into original pixels (`predicted_boxes`) and compared with the labels
  by `box_map` (`evaluate_box_rows`: `map50`, `map`, their intervals and per-class AP).

`frame` gives the processor's frame for a canvas (`Family.box_frame` bound to its processor and image size);
None keeps the canvas, which is right for every relative (0-1000) codec. Ground floor: no family is imported here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipeline.boxes.answer import parse_box_label
from pipeline.boxes.box import GEOMETRY_COLUMNS, Box, Geometry
from pipeline.boxes.codecs import BoxCodec
from pipeline.boxes.evaluation import box_map

Frame = Callable[[int, int], tuple[int, int]]  # canvas (w, h) → the processor's frame (w, h)


def row_geometry(row: Mapping[str, Any], frame: Frame | None = None) -> Geometry:
    """The geometry of a prepared row: original size, content box in the canvas, canvas, the processor's frame."""
    canvas = (int(row["prep_width"]), int(row["prep_height"]))
    content = tuple(int(v) for v in row["prep_box"])
    return Geometry(int(row["width"]), int(row["height"]), content, canvas,  # type: ignore[arg-type]
                    frame(*canvas) if frame is not None else None)


def training_rows(rows: Sequence[Mapping[str, Any]], codec: BoxCodec, frame: Frame | None = None
                  ) -> list[dict[str, Any]]:
    """`rows` with each `answer` (a box label) replaced by the codec's answer text for its boxes, the target the
    model learns; the geometry columns (`GEOMETRY_COLUMNS`) it was placed by are left out (training reads none)."""
    out = []
    for row in rows:
        where = f"sample {row.get('sample_id', '?')}: answer"
        text = codec.encode(parse_box_label(row["answer"], where=where), row_geometry(row, frame))
        out.append({**{k: v for k, v in row.items() if k not in GEOMETRY_COLUMNS}, "answer": text})
    return out


def predicted_boxes(texts: Sequence[str], rows: Sequence[Mapping[str, Any]], codec: BoxCodec,
                    frame: Frame | None = None, confidences: Sequence[float | None] | None = None
                    ) -> tuple[dict[str, list[Box]], int]:
    """(sample_id → the boxes each answer text holds, in the row's original pixels; how many pieces of text were
    dropped as unreadable). An answer's confidence (e.g. its tokens' geometric mean probability), when given, is
    each of its boxes' score: box_map ranks detections by it."""
    out: dict[str, list[Box]] = {}
    dropped = 0
    for i, (text, row) in enumerate(zip(texts, rows, strict=True)):
        decoded = codec.read(text, row_geometry(row, frame))
        score = confidences[i] if confidences is not None else None
        out[str(row["sample_id"])] = [Box(b.label, b.x, b.y, b.w, b.h, 1.0 if score is None else score)
                                      for b in decoded.boxes]
        dropped += len(decoded.dropped)
    return out, dropped


def evaluate_box_rows(texts: Sequence[str], rows: Sequence[Mapping[str, Any]], labels: Sequence[str],
                      codec: BoxCodec, frame: Frame | None = None,
                      confidences: Sequence[float | None] | None = None) -> dict[str, Any]:
    """The evaluate stage's result for a box project: {"metrics": {map50, map}, "intervals": {map50, map},
    "n", "per_class", "dropped" (unreadable pieces of the model's text), "predictions": per row}, from the model's
    answer `texts` on labeled test `rows` (their `answer`: box labels) over the class list `labels`."""
    predicted, dropped = predicted_boxes(texts, rows, codec, frame, confidences)
    truth = {str(r["sample_id"]): parse_box_label(r["answer"], where=f"test sample {r['sample_id']}") for r in rows}
    sizes = {str(r["sample_id"]): (int(r["width"]), int(r["height"])) for r in rows}
    result = box_map(truth, predicted, labels, sizes=sizes)
    return {
        "metrics": {"map50": result["map50"], "map": result["map"]},
        "intervals": {"map50": result["map50_ci95"], "map": result["map_ci95"]},
        "n": result["n"], "per_class": result["per_class"], "dropped": dropped,
        "predictions": [{"sample_id": r["sample_id"], "prediction": t, "answer": r["answer"]}
                        for r, t in zip(rows, texts, strict=True)],
    }
