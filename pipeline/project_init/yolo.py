"""A YOLO folder at `tamis init`'s path or `--test` (images/ + labels/ + data.yaml or classes.txt): a box project's
source (`kind: yolo`, pipeline/data/readers.py YoloReader), its class names the project's class list."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from pipeline.errors import DataError
from pipeline.project_init.found import SIZE_SAMPLE, Found


def is_yolo(path: Path) -> bool:
    """images/ and labels/ side by side with the class names beside them: what read_yolo reads."""
    return (path.is_dir() and (path / "images").is_dir() and (path / "labels").is_dir()
            and ((path / "data.yaml").is_file() or (path / "classes.txt").is_file()))


def yolo_found(path: Path, *, test: bool) -> Found:
    """The YOLO folder as a source: every image of a test set (a missing label file is a background image), else
    the images with a label file labeled and the rest the pool (as YoloReader reads them)."""
    from pipeline.boxes.readers import read_yolo

    boxes = read_yolo(path)
    if not boxes.images:
        raise DataError(f"{path}: a YOLO folder with no readable image under images/; put the images there")
    labels = path / "labels"
    with_file = {p.relative_to(labels).with_suffix("").as_posix() for p in labels.rglob("*.txt")}
    labeled = [n for n in boxes.images if test or Path(n).with_suffix("").as_posix() in with_file]
    counts = Counter(b.label for n in labeled for b in boxes.images[n])
    classes = list(boxes.labels)
    n, k = len(boxes.images), len(labeled)
    source = {"kind": "yolo", "path": str(path), **({"default_split": "test"} if test else {})}
    what = (f"{'test set: ' if test else ''}YOLO folder of {n:,} images, {k:,} labeled with {sum(counts.values()):,} "
            f"boxes of {len(classes)} classes" + ("" if test or k == n else f", {n - k:,} without a label file "
                                                  "(unlabeled pool)"))
    return Found(source=source, images=n, labeled=k, answers=classes, sizes=list(boxes.sizes.values())[:SIZE_SAMPLE],
                 what=what, counts=dict(counts), test=n if test else 0, test_counts=dict(counts) if test else {},
                 box_classes=classes)
