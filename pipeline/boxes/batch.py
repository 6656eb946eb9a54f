"""A batch of images out to annotators with the model's boxes, and box labels back by the images' original names.

`export_box_batch` writes, in one folder:

    images/<original name>        the batch's images under the names the annotators know them by
    label_config.xml              Label Studio's interface: RectangleLabels over the class list
    label_studio_tasks.json       one task per image; its prediction = the model's boxes (percent of
                                  original_width × original_height, a score per box, the task's score, model_version)
    predictions_coco.json         the same boxes as COCO ([x, y, w, h] pixels, a score each), for CVAT, FiftyOne…
    yolo/                         the same as a YOLO folder (images/, labels/, data.yaml), scores left out: YOLO
                                  label files that tools import have five columns
    names.json                    original name → sample_id: how labels that come back by file name find their sample

Two samples whose original names collide (the same file name in two folders) get `<stem>__<sample_id><ext>`.
`labels_by_sample` turns boxes read back (COCO, YOLO or Label Studio, pipeline/boxes/readers.py) into the ledger's
box label per sample.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

from pipeline.boxes.answer import box_label
from pipeline.boxes.box import Box
from pipeline.boxes.labelstudio import FROM_NAME, TO_NAME, box_label_config
from pipeline.boxes.readers import BoxSet
from pipeline.boxes.writers import label_studio_prediction, write_coco, write_yolo
from pipeline.errors import DataError
from pipeline.store import atomic_write_bytes, atomic_write_json, atomic_write_text

TASKS_FILE = "label_studio_tasks.json"
LABEL_CONFIG_FILE = "label_config.xml"
COCO_FILE = "predictions_coco.json"
YOLO_DIR = "yolo"
IMAGES_DIR = "images"
NAMES_FILE = "names.json"


@dataclass(frozen=True)
class BatchImage:
    """One image of the batch: its sample, its original file name (a relative path is kept), the file to copy,
    its size, the model's boxes for it (original pixels, scored where the model gave scores), the score of that
    prediction for Label Studio (e.g. 1 − the image's box uncertainty; default: its least sure box's), and the
    question the task shows."""

    sample_id: str
    name: str
    path: Path
    width: int
    height: int
    predicted: tuple[Box, ...] = ()
    confidence: float | None = None
    question: str = ""
    data: bytes | None = None  # the image's bytes, written instead of copying `path` (a dataset's own copy)


def unique_names(images: Sequence[BatchImage]) -> list[BatchImage]:
    """`images` with colliding original names made unique (`<stem>__<sample_id><ext>`), the rest unchanged."""
    seen: dict[str, int] = {}
    for im in images:
        seen[im.name] = seen.get(im.name, 0) + 1
    out = []
    for im in images:
        p = PurePosixPath(im.name)
        if not im.name or p.is_absolute() or ".." in p.parts:
            raise DataError(f"box batch: sample {im.sample_id}: original name {im.name!r} must be a relative path "
                            "inside the batch folder")
        out.append(replace(im, name=str(p.with_name(f"{p.stem}__{im.sample_id}{p.suffix}")))
                   if seen[im.name] > 1 else im)
    return out


def _task(im: BatchImage, url: str, model_version: str, round_index: int) -> dict[str, Any]:
    task: dict[str, Any] = {
        "data": {"image": url, "text": im.question, "sample_id": im.sample_id, "original_image": im.name},
        "meta": {"sample_id": im.sample_id, "round": round_index},
        "predictions": [],
    }
    if im.predicted:
        task["predictions"].append(label_studio_prediction(
            list(im.predicted), im.width, im.height, from_name=FROM_NAME, to_name=TO_NAME,
            model_version=model_version, score=im.confidence, region_prefix=im.sample_id))
    return task


def export_box_batch(out_dir: str | Path, images: Sequence[BatchImage], labels: Sequence[str], *,
                     image_url: Callable[[str], str] = lambda name: f"{IMAGES_DIR}/{name}",
                     model_version: str = "tamis", round_index: int = 0) -> list[str]:
    """Write the batch folder (see the module docstring); returns the paths written, relative to `out_dir`.
    `image_url(name)`: how Label Studio reaches an image (a URL under its document root or storage)."""
    out = Path(out_dir)
    batch = unique_names(images)
    for im in batch:
        if im.data is None and not Path(im.path).is_file():
            raise DataError(f"box batch: sample {im.sample_id}: image {im.path} does not exist; prepare the pool again")
        target = out / IMAGES_DIR / im.name
        target.parent.mkdir(parents=True, exist_ok=True)
        if im.data is not None:
            atomic_write_bytes(target, im.data)
        else:
            shutil.copyfile(im.path, target)
    atomic_write_text(out / LABEL_CONFIG_FILE, box_label_config(labels, question=any(im.question for im in batch)))
    atomic_write_json(out / TASKS_FILE, [_task(im, image_url(im.name), model_version, round_index) for im in batch])
    predicted = BoxSet(images={im.name: list(im.predicted) for im in batch},
                       sizes={im.name: (im.width, im.height) for im in batch}, labels=tuple(labels))
    write_coco(out / COCO_FILE, predicted)
    unscored = BoxSet(images={n: [replace(b, score=None) for b in bs] for n, bs in predicted.images.items()},
                      sizes=predicted.sizes, labels=predicted.labels)
    write_yolo(out / YOLO_DIR, unscored, out / IMAGES_DIR)
    atomic_write_json(out / NAMES_FILE, {im.name: im.sample_id for im in batch})
    return [IMAGES_DIR, LABEL_CONFIG_FILE, TASKS_FILE, COCO_FILE, YOLO_DIR, NAMES_FILE]


def read_names(out_dir: str | Path) -> dict[str, str]:
    path = Path(out_dir) / NAMES_FILE
    if not path.is_file():
        raise DataError(f"{path}: no such file; it is written with the batch (export_box_batch)")
    return json.loads(path.read_text(encoding="utf-8"))


def labels_by_sample(boxes: BoxSet, names: Mapping[str, str], labels: Sequence[str]) -> tuple[dict[str, str],
                                                                                             list[str]]:
    """(sample_id → box label text, the problems): boxes read back from a COCO, YOLO or Label Studio file, keyed by
    the images' original names, matched to their samples through `names` (the batch's names.json). An image the
    batch did not send, a class outside `labels`, and each entry the reader set aside are problems, named; an image
    with an entry set aside gets no label."""
    out: dict[str, str] = {}
    problems = [f"{q.source}: {q.reason}" for q in boxes.quarantine]
    incomplete = {q.image for q in boxes.quarantine if q.image}  # a label missing a box it had would be wrong
    for name, image_boxes in boxes.images.items():
        sid = names.get(name) or names.get(PurePosixPath(name).name)
        unknown = sorted({b.label for b in image_boxes} - set(labels))
        if name in incomplete:
            problems.append(f"{name}: left out: one of its boxes was set aside (above); fix it and import again")
        elif sid is None:
            problems.append(f"{name}: not an image of this batch (names.json has {len(names)} names)")
        elif unknown:
            problems.append(f"{name}: classes {unknown} are not in the class list {list(labels)}")
        else:
            out[sid] = box_label(image_boxes)
    return out, problems
