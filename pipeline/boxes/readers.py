"""Box readers: COCO JSON, YOLO folders and Label Studio RectangleLabels exports → boxes in original-image pixels,
keyed by the image's original file name.

A file that is not what its format says stops with a `DataError` naming the file, the field and the fix. A bad
entry inside a good file (an unknown category, a box outside its image or without area, a label file whose image is
missing, a rotated Label Studio box) is set aside in `BoxSet.quarantine` with its reason, and the rest is read.
`READERS` maps a format's name to its reader; pipeline/boxes/writers.py writes the same formats back.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from pipeline.boxes.box import Box
from pipeline.errors import DataError

# A box may overhang its image by this much (pixels) before it counts as outside: exports round coordinates.
EDGE_TOLERANCE_PX = 1.0
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".gif")


@dataclass(frozen=True)
class Quarantined:
    """An entry that was not read: where it is (`source`: file and entry), its image if known, and why."""

    source: str
    image: str
    reason: str


@dataclass
class BoxSet:
    """Boxes per image (original pixels; an image without boxes maps to []), each image's (width, height), the
    class names in the file's order, and the entries set aside."""

    images: dict[str, list[Box]] = field(default_factory=dict)
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)
    labels: tuple[str, ...] = ()
    quarantine: list[Quarantined] = field(default_factory=list)

    def set_aside(self, source: str, image: str, reason: str) -> None:
        self.quarantine.append(Quarantined(source, image, reason))


def place(box: Box, width: int, height: int) -> Box | str:
    """`box` clamped to its image, or the reason it cannot be kept (no area; outside the image by more than
    EDGE_TOLERANCE_PX)."""
    values = (box.x, box.y, box.w, box.h)
    if not all(math.isfinite(v) for v in values):
        return f"box {values} has a coordinate that is not a finite number"
    if box.w <= 0 or box.h <= 0:
        return f"box {box.label!r} at ({box.x:g}, {box.y:g}) has zero area ({box.w:g} × {box.h:g} px)"
    t = EDGE_TOLERANCE_PX
    if box.x < -t or box.y < -t or box.x2 > width + t or box.y2 > height + t:
        return (f"box {box.label!r} ({box.x:g}, {box.y:g}, {box.x2:g}, {box.y2:g}) lies outside its "
                f"{width}×{height} image")
    return box.clamped(width, height)


def _keep(out: BoxSet, got: Box | str, source: str, image: str) -> None:
    """A placed box joins its image; a reason goes to the quarantine."""
    if isinstance(got, Box):
        out.images[image].append(got)
    else:
        out.set_aside(source, image, got)


def _load_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise DataError(f"{path}: no such file; pass the {what} file")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); export the "
                        f"{what} again") from None
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text; is it really a {what} file?") from None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ------------------------------------------------------------------------------------------------ COCO
def _coco_lists(data: Any, path: Path) -> tuple[list, list, list]:
    if not isinstance(data, dict):
        raise DataError(f"{path}: a COCO file is one JSON object with images, annotations and categories; this one "
                        f"is a {type(data).__name__}")
    lists = []
    for key in ("images", "annotations", "categories"):
        value = data.get(key)
        if not isinstance(value, list):
            raise DataError(f"{path}: no {key!r} list at the top level (found {sorted(data)}); a COCO detection "
                            "file has images, annotations and categories")
        lists.append(value)
    return lists[0], lists[1], lists[2]


def _coco_categories(categories: list, path: Path) -> dict[int, str]:
    names: dict[int, str] = {}
    for i, cat in enumerate(categories):
        if not isinstance(cat, dict) or not isinstance(cat.get("id"), int) or not isinstance(cat.get("name"), str):
            raise DataError(f"{path}: categories[{i}] needs an integer 'id' and a string 'name', got {cat!r}")
        if cat["id"] in names:
            raise DataError(f"{path}: categories[{i}]: id {cat['id']} is used twice ({names[cat['id']]!r} and "
                            f"{cat['name']!r}); give each category its own id")
        names[cat["id"]] = cat["name"]
    return names


def _coco_images(images: list, path: Path, images_dir: Path | None, out: BoxSet) -> dict[int, str]:
    by_id: dict[int, str] = {}
    for i, im in enumerate(images):
        where = f"{path}: images[{i}]"
        ok = isinstance(im, dict) and isinstance(im.get("file_name"), str) and isinstance(im.get("id"), int)
        if not ok or not all(isinstance(im.get(k), int) and im[k] > 0 for k in ("width", "height")):
            out.set_aside(where, str(im.get("file_name", "")) if isinstance(im, dict) else "",
                          f"needs an integer id, a file_name and positive integer width and height, got {im!r}")
            continue
        name = im["file_name"]
        if images_dir is not None and not (images_dir / name).is_file():
            out.set_aside(where, name, f"missing image: {images_dir / name} does not exist")
            continue
        by_id[im["id"]] = name
        out.images.setdefault(name, [])
        out.sizes[name] = (im["width"], im["height"])
    return by_id


def read_coco(path: str | Path, images_dir: str | Path | None = None) -> BoxSet:
    """A COCO detection file (`bbox` = [x, y, w, h] in pixels); with `images_dir`, images missing there are set
    aside. A `score` on an annotation (a results file) becomes the box's score."""
    path = Path(path)
    images, annotations, categories = _coco_lists(_load_json(path, "COCO"), path)
    names = _coco_categories(categories, path)
    out = BoxSet(labels=tuple(names.values()))
    by_id = _coco_images(images, path, Path(images_dir) if images_dir is not None else None, out)
    for i, ann in enumerate(annotations):
        where = f"{path}: annotations[{i}]"
        if not isinstance(ann, dict):
            out.set_aside(where, "", f"not an object: {ann!r}")
            continue
        image = by_id.get(ann.get("image_id"))  # type: ignore[arg-type]
        bbox, cat, score = ann.get("bbox"), ann.get("category_id"), ann.get("score")
        if image is None:
            out.set_aside(where, "", f"image_id {ann.get('image_id')!r} names no image read from this file")
        elif cat not in names:
            known = ", ".join(f"{k} {v}" for k, v in names.items())
            out.set_aside(where, image, f"unknown category id {cat!r} (categories: {known})")
        elif not isinstance(bbox, list) or len(bbox) != 4 or not all(_number(v) for v in bbox):
            out.set_aside(where, image, f"bbox must be [x, y, w, h] numbers, got {bbox!r}")
        else:
            box = Box(names[cat], *map(float, bbox), score=float(score) if _number(score) else None)
            _keep(out, place(box, *out.sizes[image]), where, image)
    return out


# ------------------------------------------------------------------------------------------------ YOLO
def _yolo_names(root: Path) -> tuple[str, ...]:
    yaml_path, txt_path = root / "data.yaml", root / "classes.txt"
    if yaml_path.is_file():
        import yaml

        try:
            data = yaml.safe_load(yaml_path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise DataError(f"{yaml_path}: not valid YAML ({exc}); fix it or use classes.txt") from None
        names = data.get("names") if isinstance(data, dict) else None
        if isinstance(names, dict) and sorted(names) == list(range(len(names))):
            return tuple(str(names[i]) for i in range(len(names)))
        if isinstance(names, list) and names:
            return tuple(str(n) for n in names)
        raise DataError(f"{yaml_path}: 'names' must be a list of class names or a mapping 0..n-1 → name, got "
                        f"{names!r}")
    if txt_path.is_file():
        names = [line.strip() for line in txt_path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if names:
            return tuple(names)
        raise DataError(f"{txt_path}: empty; write one class name per line, in class-id order")
    raise DataError(f"{root}: no data.yaml or classes.txt; a YOLO folder names its classes in one of them "
                    "(data.yaml: `names: [cat, dog]`, or classes.txt: one name per line)")


def _image_size(path: Path) -> tuple[int, int] | str:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:  # reads the header only
            return im.size
    except (OSError, UnidentifiedImageError) as exc:
        return f"unreadable image ({exc.__class__.__name__}: {exc})"


def _yolo_line(line: str, names: tuple[str, ...], size: tuple[int, int]) -> Box | str:
    parts = line.split()
    if len(parts) not in (5, 6):
        return f"expected 'class cx cy w h' (and an optional score), got {len(parts)} fields: {line!r}"
    try:
        cls, (cx, cy, w, h, *score) = int(parts[0]), map(float, parts[1:])
    except ValueError:
        return f"class must be an integer and coordinates numbers: {line!r}"
    if not 0 <= cls < len(names):
        return f"unknown class id {cls} ({len(names)} classes: 0..{len(names) - 1}); add it to the class names"
    width, height = size
    return place(Box(names[cls], (cx - w / 2) * width, (cy - h / 2) * height, w * width, h * height,
                     score[0] if score else None), width, height)


def read_yolo(root: str | Path) -> BoxSet:
    """A YOLO folder: images/ (sub-folders allowed), labels/ mirroring it with one .txt per image (`class cx cy w h`,
    normalised to 0..1; a sixth column is a score), class names in data.yaml or classes.txt. Keys are image paths
    relative to images/. An image without a label file has no boxes (YOLO's background image)."""
    root = Path(root)
    if not (root / "images").is_dir() or not (root / "labels").is_dir():
        raise DataError(f"{root}: a YOLO folder holds images/ and labels/ side by side; found "
                        f"{sorted(p.name for p in root.iterdir()) if root.is_dir() else 'no folder'}")
    out = BoxSet(labels=_yolo_names(root))
    stems: dict[str, str] = {}
    for image in sorted(p for p in (root / "images").rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS):
        name = image.relative_to(root / "images").as_posix()
        size = _image_size(image)
        if isinstance(size, str):
            out.set_aside(str(image), name, size)
            continue
        out.images[name], out.sizes[name] = [], size
        stems[str(Path(name).with_suffix(""))] = name
    for label_file in sorted((root / "labels").rglob("*.txt")):
        stem = str(label_file.relative_to(root / "labels").with_suffix(""))
        name = stems.get(stem)
        if name is None:
            out.set_aside(str(label_file), stem, f"missing image: no images/{stem}.* beside this label file")
            continue
        for n, line in enumerate(label_file.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                _keep(out, _yolo_line(line, out.labels, out.sizes[name]), f"{label_file}:{n}", name)
    return out


# ------------------------------------------------------------------------------------------------ Label Studio
_UPLOAD_PREFIX = re.compile(r"^[0-9a-f]{8}-")


def image_name(ref: str) -> str:
    """The original file name of a task's image reference (URL, /data/upload/… path, local-files ?d=…): its last
    path part, with the 8-hex prefix Label Studio puts on uploaded files removed. (Matching it to a pool's sample is
    pipeline/annotation/matching.py's work, a floor up, once rounds take boxes.)"""
    parsed = urlparse(ref)
    path = unquote(parsed.path)
    if "d=" in parsed.query:  # /data/local-files/?d=folder/name.jpg
        path = unquote(parsed.query.split("d=", 1)[1].split("&", 1)[0])
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return _UPLOAD_PREFIX.sub("", name) if "/data/upload/" in path else name


def _ls_region(item: Mapping[str, Any], score: Any) -> list[Box] | str:
    value = item.get("value")
    if not isinstance(value, dict) or not all(_number(value.get(k)) for k in ("x", "y", "width", "height")):
        return f"value needs numeric x, y, width and height (percent), got {value!r}"
    ow, oh = item.get("original_width"), item.get("original_height")
    if not (isinstance(ow, int) and isinstance(oh, int) and ow > 0 and oh > 0):
        return ("no original_width/original_height: Label Studio writes them once the image has loaded in the "
                "editor; open the task and save it again, or export again")
    if value.get("rotation", 0):
        return (f"rotated box (rotation {value['rotation']}°): tamis reads axis-aligned boxes only; redraw it "
                "without rotation in Label Studio")
    labels = value.get("rectanglelabels")
    if not isinstance(labels, list) or not labels or not all(isinstance(v, str) for v in labels):
        return f"rectanglelabels must name at least one label, got {labels!r}"
    s = item.get("score", score)
    x, y, w, h = (value[k] / 100 for k in ("x", "y", "width", "height"))
    boxes = [Box(label, x * ow, y * oh, w * ow, h * oh, float(s) if _number(s) else None) for label in labels]
    placed = [place(b, ow, oh) for b in boxes]
    problems = [p for p in placed if isinstance(p, str)]
    return problems[0] if problems else [p for p in placed if isinstance(p, Box)]


def _ls_result(task: Mapping[str, Any], kind: str) -> tuple[list, Any] | None:
    """The result list of the task's answer of `kind` and its score: not cancelled, the ground truth if one is
    marked, else the latest (the rule pipeline/data/readers.py applies to choices)."""
    answers = [a for a in task.get(kind) or [] if isinstance(a, dict) and not a.get("was_cancelled")]
    answers.sort(key=lambda a: bool(a.get("ground_truth")))  # stable: ground truth last, then list order
    if not answers:
        return None
    result = answers[-1].get("result")
    return (result if isinstance(result, list) else []), answers[-1].get("score")


def read_label_studio(path: str | Path, *, kind: str = "annotations", image_key: str | None = None) -> BoxSet:
    """A Label Studio JSON export (a list of tasks): the RectangleLabels boxes of each task's answer of `kind`
    ("annotations": the ground truth, else the latest not cancelled; or "predictions"), x/y/width/height in percent of original_width ×
    original_height. The image is `data[image_key]` (default: the task's first text field). Tasks without an answer
    of `kind` are left out; a rotated box is set aside with its reason."""
    if kind not in ("annotations", "predictions"):
        raise DataError(f"read_label_studio: kind {kind!r}; use annotations or predictions")
    path = Path(path)
    tasks = _load_json(path, "Label Studio export")
    if not isinstance(tasks, list):
        raise DataError(f"{path}: a Label Studio export is a JSON list of tasks, got a {type(tasks).__name__}; "
                        "export the project as JSON (not JSON-MIN or CSV)")
    out, labels = BoxSet(), dict[str, None]()
    for i, task in enumerate(tasks):
        where = f"{path}: task[{i}]"
        data = task.get("data") if isinstance(task, dict) else None
        refs = [v for k, v in (data or {}).items() if isinstance(v, str) and (image_key is None or k == image_key)]
        if not refs:
            out.set_aside(where, "", f"no image in data (need data[{image_key or '<first text field>'!r}])")
            continue
        name, found = image_name(refs[0]), _ls_result(task, kind)
        if found is None:
            continue
        if name in out.images:
            out.set_aside(where, name, f"a second task for image {name!r}; its first task was kept")
            continue
        out.images[name] = []
        _ls_regions(found, where, name, out, labels)
    out.labels = tuple(labels)
    return out


def rectangle_boxes(result: list[Any], score: Any = None) -> tuple[list[Box], list[str]]:
    """The boxes of one Label Studio result list (its RectangleLabels regions; other tags are skipped) in original
    pixels, and the reason for each region that could not be read (rotated, no original size, outside the image)."""
    boxes: list[Box] = []
    problems: list[str] = []
    for j, item in enumerate(result):
        if not isinstance(item, dict) or str(item.get("type", "")).lower() != "rectanglelabels":
            continue
        got = _ls_region(item, score)
        if isinstance(got, str):
            problems.append(f"result[{j}]: {got}")
        else:
            boxes += got
    return boxes, problems


def _ls_regions(found: tuple[list, Any], where: str, name: str, out: BoxSet, labels: dict[str, None]) -> None:
    result, score = found
    for j, item in enumerate(result):
        if not isinstance(item, dict) or str(item.get("type", "")).lower() != "rectanglelabels":
            continue  # other tags of the labeling config (choices, text) are not boxes
        got = _ls_region(item, score)
        if isinstance(got, str):
            out.set_aside(f"{where}.result[{j}]", name, got)
            continue
        out.images[name] += got
        out.sizes[name] = (item["original_width"], item["original_height"])
        labels.update(dict.fromkeys(b.label for b in got))


READERS: dict[str, Callable[..., BoxSet]] = {"coco": read_coco, "yolo": read_yolo, "label_studio": read_label_studio}
