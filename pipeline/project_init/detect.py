"""What `tamis init` finds at the path it is given: the kind of source, its columns, its images and answers.

| path | kind | labeled |
|---|---|---|
| a folder of images, flat | `folder` | no: the unlabeled pool |
| a folder with one sub-folder of images per class | `folder` | yes: the sub-folder names are the answers |
| a folder saved with `datasets`' `save_to_disk` | `hf` | where its answer column has values |
| a `.csv` / `.jsonl` manifest | `csv` / `jsonl` | rows with an answer |
| a `.json` Label Studio export (a list of tasks with `data`) | `label_studio` | tasks with an annotation |
| a `.jsonl` / `.json` of conversations, or a folder holding one | `trl` / `sharegpt` / `swift` | rows ending on an assistant turn |
| a COCO `.json` test file (`--test`; `images`, `annotations`, `categories`) | `coco` | every image: a box project |
| a YOLO folder (`images/` + `labels/` + `data.yaml` or `classes.txt`), as the path or `--test` | `yolo` | images with a label file (a test set: every image): a box project |

A conversation file's kind comes from its records (`conversation_kind`): `conversations` is LLaMA-Factory's sharegpt,
`messages` with typed content (`{"type": "image"}` items) is TRL's, `messages` with string content ms-swift's. In a
folder, the conversation file is the only one there, or the one named `train`; a LLaMA-Factory dataset_info.json
beside it is read by the reader (its column names), not taken for a saved HF dataset.

Manifest columns are found by content, not only by name: the image column is the one whose cells name image files
that exist (relative to the manifest's folder, as the readers resolve them), the answer column the one named like an
answer (answer, label, category, class…), or else the only other column. A JSONL row may leave out keys, so the
columns are those of every row, not the first one's: a manifest whose 500 test rows (the only ones with an answer)
come after 100,000 pool rows still has its answer column. Rows whose split cell says `test` are the test split.
Every refusal names the file and the fix.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from pipeline.errors import DataError
from pipeline.project_init.conversations import (
    _conversation_file,
    _conversation_records,
    _conversations,
)
from pipeline.project_init.found import SIZE_SAMPLE, Found, _is_image, image_sizes
from pipeline.project_init.tables import (
    IMAGE_NAMES,
    IMAGE_SUFFIXES,
    _by_name,
    _cell,
    manifest_columns,
    read_table,
)
from pipeline.project_init.yolo import is_yolo, yolo_found
from pipeline.schema import ANSWER_NAMES  # label files read their answers by the same rule


def _folder(path: Path) -> Found:
    if is_yolo(path):
        return yolo_found(path, test=False)
    chats = None if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file() else \
        _conversation_file(path)
    if chats is not None:
        return _conversations(chats, _conversation_records(chats) or [])
    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file() or (
            path / "state.json").is_file():
        return _hf(path)
    top = sorted(e.name for e in os.scandir(path) if e.is_file() and _is_image(e.name))
    classes: dict[str, list[Path]] = {}
    for d in sorted((e for e in os.scandir(path) if e.is_dir() and not e.name.startswith(".")), key=lambda e: e.name):
        files = [Path(r, f) for r, _, fs in os.walk(d.path) for f in sorted(fs) if _is_image(f)]
        if files:
            classes[d.name] = files
    n_labeled = sum(len(v) for v in classes.values())
    if not top and not n_labeled:
        raise DataError(f"{path}: no images found (looked for {', '.join(sorted(IMAGE_SUFFIXES))} files, directly "
                        "or one sub-folder per class); point tamis init at the folder that holds your images, or at a "
                        "CSV / JSONL manifest")
    if len(classes) == 1 and not top:
        raise DataError(f"{path}: one sub-folder ({next(iter(classes))}) and no images beside it: a labeled folder "
                        "needs one sub-folder per class (at least 2); point tamis init at "
                        f"{path / next(iter(classes))} for an unlabeled pool")
    paths = [path / n for n in top] + [p for v in classes.values() for p in v]
    if classes and len(classes) >= 2:
        what = (f"folder of {len(paths):,} images: {n_labeled:,} in {len(classes)} class sub-folders (labeled)"
                + (f", {len(top):,} directly in it (unlabeled pool)" if top else ""))
    else:
        what = f"flat folder of {len(top):,} images (unlabeled pool)"
        classes, n_labeled = {}, 0
    return Found({"kind": "folder", "path": str(path)}, len(paths), n_labeled, sorted(classes),
                 image_sizes(paths), what, counts={c: len(v) for c, v in classes.items()})


def _hf(path: Path) -> Found:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise DataError(f"{path}: looks like a saved HF dataset but does not load ({exc}); save it again with "
                        "`dataset.save_to_disk(...)`") from None
    split = None
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else next(iter(ds))
        ds = ds[split]
    cols = ds.column_names
    image = next((c for c in cols if type(ds.features[c]).__name__ == "Image"), None) or _by_name(cols, IMAGE_NAMES)
    if image is None:
        raise DataError(f"{path}: no image column among {cols}; name it `image` or give it the Image feature")
    answer = _by_name([c for c in cols if c != image], ANSWER_NAMES)
    answers = [] if answer is None else [_cell(v) for v in ds[answer][:]]
    source = {"kind": "hf", "path": str(path), "image_column": image}
    if split is not None:
        source["hf_split"] = split
    if answer is not None:
        source["answer_column"] = answer
    labeled = [a for a in answers if a]
    return Found(source, len(ds), len(labeled), sorted(set(labeled)), [],
                 f"saved HF dataset of {len(ds):,} rows ({len(labeled):,} with an answer in `{answer}`)",
                 counts=dict(Counter(labeled)), free_text=True)


def _manifest(path: Path) -> Found:
    rows = read_table(path)
    image, answer, files = manifest_columns(path, rows)
    answers = [_cell(r.get(answer)) for r in rows] if answer else []
    labeled = [a for a in answers if a]
    # The readers' split column (docs/config.md: a row's `split` cell, else the source's default_split).
    tests = [_cell(r.get(answer)) for r in rows if _cell(r.get("split")).lower() == "test"] if answer else []
    test = sum(1 for r in rows if _cell(r.get("split")).lower() == "test")
    source = {"kind": "jsonl" if path.suffix.lower() == ".jsonl" else "csv", "path": str(path),
              "image_column": image}
    if answer is not None:
        source["answer_column"] = answer
    missing = len(rows) - len(files)
    what = (f"{source['kind'].upper()} manifest of {len(rows):,} rows (images in `{image}`"
            + (f", answers in `{answer}`: {len(labeled):,} labeled" if answer else ", no answer column")
            + (f", {test:,} in the test split" if test else "") + ")"
            + (f"; {missing:,} rows name no image file found (ingest quarantines them with a reason)" if missing
               else ""))
    return Found(source, len(rows), len(labeled), sorted(set(labeled)), image_sizes(files), what,
                 counts=dict(Counter(labeled)), test=test, test_counts=dict(Counter(a for a in tests if a)),
                 free_text=True)


def _label_studio(path: Path) -> Found:
    try:
        tasks = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: not readable JSON ({exc}); export the project from Label Studio as JSON") from None
    if not isinstance(tasks, list) or not tasks or not all(isinstance(t, dict) and "data" in t for t in tasks):
        raise DataError(f"{path}: not a Label Studio export (a JSON list of tasks, each with `data`); export the "
                        "project as JSON, or give a CSV / JSONL manifest")
    keys = Counter(k for t in tasks for k, v in t["data"].items() if isinstance(v, str)
                   and os.path.splitext(v.split("?")[0])[1].lower() in IMAGE_SUFFIXES)
    image = keys.most_common(1)[0][0] if keys else "image"
    labeled = sum(1 for t in tasks if any(not a.get("was_cancelled") and a.get("result")
                                          for a in t.get("annotations") or []))
    return Found({"kind": "label_studio", "path": str(path), "data_image_key": image}, len(tasks), labeled, [], [],
                 f"Label Studio export of {len(tasks):,} tasks ({labeled:,} annotated; images in data.{image})")


def detect_source(path: Path) -> Found:
    """The source at `path` (module docstring's table); DataError naming the file and the fix otherwise."""
    if not path.exists():
        raise DataError(f"{path}: no such file or folder; give tamis init a folder of images, a CSV / JSONL manifest, "
                        "a Label Studio JSON export or a saved HF dataset")
    if path.is_dir():
        return _folder(path)
    suffix = path.suffix.lower()
    recs = _conversation_records(path) if suffix in (".jsonl", ".json") else None
    if recs is not None:
        return _conversations(path, recs)
    if suffix in (".csv", ".jsonl"):
        return _manifest(path)
    if suffix == ".json":
        return _label_studio(path)
    raise DataError(f"{path}: tamis init reads a folder of images, a .csv / .jsonl manifest, a Label Studio .json "
                    f"export or a saved HF dataset folder, not a {suffix or 'suffix-less'} file")


def _coco_test(path: Path) -> Found:
    """A COCO test file (pipeline/boxes/readers.py read_coco): its images are the test split, its categories the
    class list of a box project (data.task: boxes)."""
    from pipeline.boxes.readers import read_coco

    boxes = read_coco(path)
    if not boxes.images:
        raise DataError(f"{path}: a COCO file with no images; a test file needs each test image and its boxes")
    if not boxes.labels:
        raise DataError(f"{path}: a COCO file with no categories; list the classes in its `categories`")
    counts = Counter(b.label for bs in boxes.images.values() for b in bs)
    n, classes = len(boxes.images), list(boxes.labels)
    return Found(source={"kind": "coco", "path": str(path), "default_split": "test"}, images=n, labeled=n,
                 answers=classes, sizes=list(boxes.sizes.values())[:SIZE_SAMPLE],
                 what=f"test set: COCO file of {n:,} images, {sum(counts.values()):,} boxes of {len(classes)} classes",
                 counts=dict(counts), test=n, test_counts=dict(counts), box_classes=classes)


def detect_test(path: Path, pool: Path) -> Found:
    """The labeled test file (CSV / JSONL, e.g. `labels.csv` with `file,category`): its columns, answers and images,
    as a source whose rows all go to the test split. It must hold answers, and must not live inside a pool folder
    (the folder reader would read its images again as samples). A YOLO folder or a COCO file makes a box project."""
    if is_yolo(path):
        if pool.is_dir() and path.resolve().is_relative_to(pool.resolve()):
            raise DataError(f"{path}: the YOLO test folder lies inside the pool folder {pool}; move it out")
        return yolo_found(path, test=True)
    if not path.is_file():
        raise DataError(f"{path}: test file not found; pass --test a CSV or JSONL with one row per test image and its "
                        "answer (e.g. labels.csv with file,category)")
    if path.suffix.lower() not in (".csv", ".jsonl", ".json"):
        raise DataError(f"{path}: a test file is a .csv or .jsonl table (image, answer) or a COCO .json file of "
                        f"boxes, not {path.suffix or 'this'}")
    if pool.is_dir() and path.resolve().is_relative_to(pool.resolve()):
        raise DataError(f"{path}: the test set lies inside the pool folder {pool}, whose images would then be read "
                        "as pool samples too; move the test images and their labels file out of it")
    if path.suffix.lower() == ".json":
        return _coco_test(path)
    found = _manifest(path)
    if "answer_column" not in found.source:
        cols = ", ".join(read_table(path)[0])
        raise DataError(f"{path}: no answer column found among {cols}; name it answer, label or category (or keep "
                        "just two columns: the image and its answer)")
    if found.labeled < 1:
        raise DataError(f"{path}: column {found.source['answer_column']!r} is empty in every row: a test file needs "
                        "each image's answer")
    found.source["default_split"] = "test"
    found.test, found.test_counts = found.labeled, dict(found.counts)
    found.what = "test set: " + found.what
    return found
