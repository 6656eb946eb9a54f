"""Box writers: a `BoxSet` (boxes in original pixels per image) → COCO JSON, a YOLO folder, or Label Studio tasks
with RectangleLabels predictions (percent coordinates with the original size, a score per box), each written
atomically and read back unchanged by pipeline/boxes/readers.py."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.boxes.box import Box
from pipeline.boxes.readers import BoxSet
from pipeline.errors import DataError
from pipeline.store import atomic_write_json, atomic_write_text


def _labels(boxes: BoxSet) -> list[str]:
    """The set's class names, then any label its boxes use that they do not list, in first-seen order."""
    names = dict.fromkeys(boxes.labels)
    names.update(dict.fromkeys(b.label for image in boxes.images.values() for b in image))
    return list(names)


def _size(boxes: BoxSet, name: str, fmt: str) -> tuple[int, int]:
    if name not in boxes.sizes:
        raise DataError(f"{fmt}: image {name!r} has no size in the box set; {fmt} needs every image's width and "
                        "height (read them from the image, or leave the image out)")
    return boxes.sizes[name]


def write_coco(path: str | Path, boxes: BoxSet) -> Path:
    """A COCO detection file: images (ids from 1, in the set's order), categories (ids from 1), one annotation per
    box with `bbox` [x, y, w, h] pixels, `area`, and `score` when the box has one."""
    ids = {label: i for i, label in enumerate(_labels(boxes), 1)}
    images, annotations = [], []
    for image_id, (name, image_boxes) in enumerate(boxes.images.items(), 1):
        width, height = _size(boxes, name, "COCO")
        images.append({"id": image_id, "file_name": name, "width": width, "height": height})
        for b in image_boxes:
            ann: dict[str, Any] = {"id": len(annotations) + 1, "image_id": image_id, "category_id": ids[b.label],
                                   "bbox": [b.x, b.y, b.w, b.h], "area": b.w * b.h, "iscrowd": 0}
            if b.score is not None:
                ann["score"] = b.score
            annotations.append(ann)
    categories = [{"id": i, "name": label} for label, i in ids.items()]
    return atomic_write_json(path, {"images": images, "annotations": annotations, "categories": categories})


def _yolo_line(b: Box, cls: int, width: int, height: int) -> str:
    values = [(b.x + b.w / 2) / width, (b.y + b.h / 2) / height, b.w / width, b.h / height]
    text = f"{cls} " + " ".join(f"{v:.6f}" for v in values)
    return text + (f" {b.score:.6f}" if b.score is not None else "")


def write_yolo(root: str | Path, boxes: BoxSet, images_dir: str | Path) -> Path:
    """A YOLO folder at `root`: images/ (copied from `images_dir`, where each image sits under its name),
    labels/<name>.txt (`class cx cy w h` normalised, six decimals, a score column where boxes have one), and
    data.yaml naming the classes."""
    import yaml

    root, images_dir = Path(root), Path(images_dir)
    names = _labels(boxes)
    ids = {label: i for i, label in enumerate(names)}
    for name, image_boxes in boxes.images.items():
        width, height = _size(boxes, name, "YOLO")
        source = images_dir / name
        if not source.is_file():
            raise DataError(f"YOLO: image {source} does not exist; pass the folder that holds the images by name")
        target = root / "images" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        lines = [_yolo_line(b, ids[b.label], width, height) for b in image_boxes]
        atomic_write_text(root / "labels" / Path(name).with_suffix(".txt"), "".join(f"{line}\n" for line in lines))
    atomic_write_text(root / "data.yaml", yaml.safe_dump({"nc": len(names), "names": names}, allow_unicode=True))
    return root


def label_studio_prediction(boxes: list[Box], width: int, height: int, *, from_name: str = "label",
                            to_name: str = "image", model_version: str = "tamis", score: float | None = None,
                            region_prefix: str = "r") -> dict[str, Any]:
    """One Label Studio prediction: a RectangleLabels result per box in percent of original_width ×
    original_height (top-left, no rotation), a score per box where it has one, and the prediction's `score`
    (given, else the lowest box score: Label Studio sorts tasks by it, the least sure first)."""
    result = []
    for k, b in enumerate(boxes):
        region: dict[str, Any] = {
            "id": f"{region_prefix}-{k}", "type": "rectanglelabels", "from_name": from_name, "to_name": to_name,
            "original_width": width, "original_height": height, "image_rotation": 0,
            "value": {"x": b.x / width * 100, "y": b.y / height * 100, "width": b.w / width * 100,
                      "height": b.h / height * 100, "rotation": 0, "rectanglelabels": [b.label]},
        }
        if b.score is not None:
            region["score"] = b.score
        result.append(region)
    prediction: dict[str, Any] = {"model_version": model_version, "result": result}
    scores = [b.score for b in boxes if b.score is not None]
    if score is not None:
        prediction["score"] = float(score)
    elif scores:
        prediction["score"] = min(scores)
    return prediction


def write_label_studio(path: str | Path, boxes: BoxSet, *, image_url: Callable[[str], str] = lambda name: name,
                       data_key: str = "image", from_name: str = "label", to_name: str = "image",
                       model_version: str = "tamis") -> Path:
    """Label Studio tasks, one per image (`data[data_key]` = image_url(name); from_name/to_name: the RectangleLabels
    and Image tags' names in the project's labeling config), each with one prediction (`label_studio_prediction`)."""
    tasks = []
    for name, image_boxes in boxes.images.items():
        width, height = _size(boxes, name, "Label Studio")
        prediction = label_studio_prediction(image_boxes, width, height, from_name=from_name, to_name=to_name,
                                             model_version=model_version, region_prefix=f"r{len(tasks)}")
        tasks.append({"data": {data_key: image_url(name)}, "predictions": [prediction]})
    return atomic_write_json(path, tasks)
