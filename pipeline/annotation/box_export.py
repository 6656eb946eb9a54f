"""A box project's export (data.task: boxes): the round's selection as export_box_batch's folder.

The folder (pipeline/boxes/batch.py) holds the original images under their original file names, Label Studio
tasks whose predictions are the model's boxes (RectangleLabels in percent of the original size, each box and the
task scored with the answer's confidence), the same boxes as COCO and YOLO, and names.json, by which a COCO or
Label Studio file that names the original files finds its samples again. The model's boxes are its generated
answer text (the selection's `prediction`) read back by the family's codec through each row's geometry.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.boxes.batch import IMAGES_DIR, BatchImage, export_box_batch
from pipeline.boxes.box import GEOMETRY_COLUMNS
from pipeline.boxes.codecs import BoxCodec
from pipeline.boxes.rows import Frame, predicted_boxes
from pipeline.config import AnnotateConfig
from pipeline.idindex import IdIndex
from pipeline.store import Manifest, digest_json, write_manifest


def batch_images(rows: Sequence[Mapping[str, Any]], dataset: Any, codec: BoxCodec | None,
                 frame: Frame | None = None) -> list[BatchImage]:
    """The selection `rows` (rank order) as BatchImages: the original image bytes and file name from `dataset`,
    the boxes of each row's `prediction` in the image's pixels (none without a model: the cold start), scored
    with its `confidence`."""
    rows = sorted(rows, key=lambda r: (r.get("rank", 0), str(r.get("sample_id"))))
    ids = [str(r["sample_id"]) for r in rows]  # checked by the caller (export.check_sample_id)
    cols = ["sample_id", "question", "image", "image_path", *GEOMETRY_COLUMNS]
    sub = dataset.select_columns(cols).select(IdIndex.of_dataset(dataset).rows(ids).tolist())
    out = []
    for r, d in zip(rows, sub, strict=True):
        text, conf = r.get("prediction"), r.get("confidence")
        boxes: tuple = ()
        if codec is not None and text:
            found, _ = predicted_boxes([text], [d], codec, frame, [conf])
            boxes = tuple(found[d["sample_id"]])
        name = os.path.basename(d.get("image_path") or "") or f"{d['sample_id']}.png"
        out.append(BatchImage(sample_id=d["sample_id"], name=name, path=Path(d.get("image_path") or name),
                              width=int(d["width"]), height=int(d["height"]), predicted=boxes,
                              confidence=None if conf is None else float(conf), question=d["question"] or "",
                              data=d["image"]))
    return out


def export_box_selection(rows: Sequence[Mapping[str, Any]], dataset: Any, annotate: AnnotateConfig,
                         labels: Sequence[str], out_dir: str | os.PathLike[str], *, round_index: int,
                         codec: BoxCodec | None, frame: Frame | None = None, relpath: str,
                         stage_version: str) -> Manifest:
    """Write a box round's batch into `out_dir` (export_box_batch), then the manifest (last: it marks completion).
    `relpath`: the folder's path under Label Studio's document root. annotate.formats does not apply: the batch is
    always Label Studio + COCO + YOLO + images."""
    out = Path(out_dir)
    images = batch_images(rows, dataset, codec, frame)
    url = f"{annotate.image_url_prefix}{relpath}/{IMAGES_DIR}/"
    adapters = {r.get("adapter_digest") for r in rows} - {None}
    version = f"adapter-{sorted(adapters)[0][:12]}" if len(adapters) == 1 else "tamis"
    out.mkdir(parents=True, exist_ok=True)
    written = export_box_batch(out, images, labels, image_url=lambda name: url + name, model_version=version,
                               round_index=round_index)
    strategies = sorted({str(r.get("strategy")) for r in rows if r.get("strategy")})
    return write_manifest(out, stage="export", stage_version=stage_version,
                          inputs={"selection": digest_json([dict(r) for r in rows])},
                          config={"annotate": annotate.model_dump(mode="json"), "box_labels": list(labels)},
                          outputs={p: p for p in written},
                          info={"round": round_index, "count": len(images), "strategies": strategies,
                                "predicted": sum(bool(im.predicted) for im in images)})
