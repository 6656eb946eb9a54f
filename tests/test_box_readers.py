"""Box readers and writers (issue 50 item 2): real COCO, YOLO and Label Studio files written in tmp_path beside
generated images of mixed sizes, read into boxes in original pixels; bad inputs stop with the file and the fix, bad
entries are quarantined with their reason; what the writers write reads back the same."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.boxes.box import Box
from pipeline.boxes.readers import READERS, BoxSet, image_name, read_coco, read_label_studio, read_yolo
from pipeline.boxes.writers import write_coco, write_label_studio, write_yolo
from pipeline.errors import DataError

SIZES = {"wide.jpg": (640, 480), "tall.png": (300, 900), "odd.png": (333, 127), "sub/square.jpg": (512, 512)}


@pytest.fixture
def images(tmp_path) -> Path:
    """Generated images of mixed sizes and formats under tmp_path/src (one in a sub-folder)."""
    src = tmp_path / "src"
    rng = np.random.default_rng(0)
    for name, (w, h) in SIZES.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(src / name)
    return src


def _boxset(scores: bool = False) -> BoxSet:
    s = (lambda v: v) if scores else (lambda v: None)
    return BoxSet(
        images={"wide.jpg": [Box("cat", 10, 20, 100, 50, s(0.9)), Box("dog", 0, 0, 640, 480, s(0.25))],
                "tall.png": [Box("dog", 299 - 33.5, 800.25, 33.5, 99.75, s(0.5))],
                "odd.png": [],
                "sub/square.jpg": [Box("bird", 1, 2, 3, 4, s(0.75))]},
        sizes=dict(SIZES), labels=("cat", "dog", "bird"))


def _same(a: BoxSet, b: BoxSet, tol: float = 1e-6) -> None:
    assert a.images.keys() == b.images.keys() and a.sizes == b.sizes and a.labels == b.labels
    for name in a.images:
        assert len(a.images[name]) == len(b.images[name]), name
        for x, y in zip(a.images[name], b.images[name], strict=True):
            assert x.label == y.label and x.score == pytest.approx(y.score)
            assert (x.x, x.y, x.w, x.h) == pytest.approx((y.x, y.y, y.w, y.h), abs=tol), (name, x, y)


# ------------------------------------------------------------------------------------------------ COCO
def _coco(tmp_path: Path, **over) -> Path:
    data = {
        "images": [{"id": 1, "file_name": "wide.jpg", "width": 640, "height": 480},
                   {"id": 2, "file_name": "tall.png", "width": 300, "height": 900},
                   {"id": 3, "file_name": "gone.jpg", "width": 10, "height": 10}],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 1, "bbox": [10, 20, 100, 50]},
            {"id": 2, "image_id": 2, "category_id": 2, "bbox": [0, 0, 300.4, 900]},  # overhangs by < 1 px: clamped
            {"id": 3, "image_id": 1, "category_id": 7, "bbox": [1, 1, 5, 5]},
            {"id": 4, "image_id": 1, "category_id": 1, "bbox": [600, 400, 100, 100]},
            {"id": 5, "image_id": 2, "category_id": 1, "bbox": [5, 5, 0, 10]},
            {"id": 6, "image_id": 9, "category_id": 1, "bbox": [5, 5, 1, 1]},
            {"id": 7, "image_id": 3, "category_id": 1, "bbox": [1, 1, 2, 2]},
            {"id": 8, "image_id": 1, "category_id": 1, "bbox": [1, 2, "3", 4]},
        ],
        "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}],
        **over,
    }
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(data))
    return path


def test_coco_boxes_in_pixels_and_each_bad_entry_quarantined(tmp_path, images):
    got = read_coco(_coco(tmp_path), images_dir=images)
    assert got.labels == ("cat", "dog")
    assert got.images == {"wide.jpg": [Box("cat", 10, 20, 100, 50)], "tall.png": [Box("dog", 0, 0, 300, 900)]}
    assert got.sizes == {"wide.jpg": (640, 480), "tall.png": (300, 900)}
    reasons = {q.source.rsplit(": ", 1)[1]: q.reason for q in got.quarantine}
    assert "missing image" in reasons["images[2]"] and "gone.jpg" in reasons["images[2]"]
    assert reasons["annotations[2]"] == "unknown category id 7 (categories: 1 cat, 2 dog)"
    assert "outside its 640×480 image" in reasons["annotations[3]"]
    assert "zero area" in reasons["annotations[4]"]
    assert "image_id 9" in reasons["annotations[5]"] and "image_id 3" in reasons["annotations[6]"]
    assert "bbox must be [x, y, w, h] numbers" in reasons["annotations[7]"]
    assert len(got.quarantine) == 7


@pytest.mark.parametrize(("over", "message"), [
    ({"categories": None}, "no 'categories' list at the top level"),
    ({"categories": [{"id": 1, "name": "cat"}, {"id": 1, "name": "dog"}]}, r"id 1 is used twice .*own id"),
    ({"categories": [{"id": "1", "name": "cat"}]}, r"categories\[0\] needs an integer 'id'"),
])
def test_coco_file_errors_name_the_field_and_the_fix(tmp_path, over, message):
    with pytest.raises(DataError, match=message):
        read_coco(_coco(tmp_path, **over))


def test_coco_unreadable_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"images": [')
    with pytest.raises(DataError, match=r"bad.json: not valid JSON \(line 1"):
        read_coco(bad)
    bad.write_text("[]")
    with pytest.raises(DataError, match="one JSON object with images, annotations and categories"):
        read_coco(bad)
    with pytest.raises(DataError, match="no such file; pass the COCO file"):
        read_coco(tmp_path / "none.json")


# ------------------------------------------------------------------------------------------------ YOLO
def _yolo(tmp_path: Path, images: Path, names: str = "data.yaml") -> Path:
    root = tmp_path / "yolo"
    for name in SIZES:
        (root / "images" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "images" / name).write_bytes((images / name).read_bytes())
    labels = root / "labels"
    (labels / "sub").mkdir(parents=True)
    (labels / "wide.txt").write_text("0 0.5 0.5 0.25 0.5\n1 0.1 0.1 0.2 0.2 0.8\n\n7 0.5 0.5 0.1 0.1\n")
    (labels / "tall.txt").write_text("1 0.5 0.5 1.5 0.2\n0 0.5 0.5 0 0.1\nfoo 0.5 0.5 0.1 0.1\n0 0.5 0.5\n")
    (labels / "sub" / "square.txt").write_text("0 0.5 0.5 1 1\n")
    (labels / "ghost.txt").write_text("0 0.5 0.5 0.1 0.1\n")
    if names == "data.yaml":
        (root / "data.yaml").write_text("path: .\ntrain: images\nnames:\n  0: cat\n  1: dog\n")
    else:
        (root / "classes.txt").write_text("cat\ndog\n")
    return root


@pytest.mark.parametrize("names", ["data.yaml", "classes.txt"])
def test_yolo_boxes_in_pixels_and_each_bad_line_quarantined(tmp_path, images, names):
    got = read_yolo(_yolo(tmp_path, images, names))
    assert got.labels == ("cat", "dog")
    assert got.sizes == SIZES
    assert got.images["wide.jpg"] == [Box("cat", 240, 120, 160, 240), Box("dog", 0, 0, 128, 96, 0.8)]
    assert got.images["sub/square.jpg"] == [Box("cat", 0, 0, 512, 512)]
    assert got.images["tall.png"] == [] and got.images["odd.png"] == []  # odd.png: no label file, a background
    reasons = {Path(q.source).name: q.reason for q in got.quarantine}
    assert reasons["wide.txt:4"] == "unknown class id 7 (2 classes: 0..1); add it to the class names"
    assert "outside its 300×900 image" in reasons["tall.txt:1"]
    assert "zero area" in reasons["tall.txt:2"]
    assert "class must be an integer" in reasons["tall.txt:3"]
    assert "got 3 fields" in reasons["tall.txt:4"]
    assert "missing image: no images/ghost.*" in reasons["ghost.txt"]
    assert len(got.quarantine) == 6


def test_yolo_folder_errors_name_the_fix(tmp_path, images):
    root = _yolo(tmp_path, images)
    (root / "data.yaml").unlink()
    with pytest.raises(DataError, match="no data.yaml or classes.txt; a YOLO folder names its classes"):
        read_yolo(root)
    (root / "data.yaml").write_text("names: 3\n")
    with pytest.raises(DataError, match="'names' must be a list of class names"):
        read_yolo(root)
    with pytest.raises(DataError, match="holds images/ and labels/ side by side"):
        read_yolo(tmp_path / "src")


def test_an_unreadable_image_is_quarantined(tmp_path, images):
    root = _yolo(tmp_path, images)
    (root / "images" / "broken.png").write_bytes(b"not a png")
    got = read_yolo(root)
    assert "broken.png" not in got.images
    assert any(q.image == "broken.png" and "unreadable image" in q.reason for q in got.quarantine)


# ------------------------------------------------------------------------------------------------ Label Studio
def _region(x, y, w, h, label="cat", rotation=0, ow=640, oh=480, **extra):
    return {"type": "rectanglelabels", "from_name": "label", "to_name": "image", "original_width": ow,
            "original_height": oh, "image_rotation": 0, **extra,
            "value": {"x": x, "y": y, "width": w, "height": h, "rotation": rotation, "rectanglelabels": [label]}}


def test_label_studio_rectangles_in_pixels_rotated_refused(tmp_path):
    tasks = [
        {"id": 1, "data": {"image": "/data/upload/3/1a2b3c4d-wide.jpg"}, "annotations": [
            {"was_cancelled": True, "result": [_region(0, 0, 10, 10)]},
            {"result": [_region(10, 20, 50, 25), _region(5, 5, 10, 10, rotation=30),
                        {"type": "choices", "value": {"choices": ["ok"]}},
                        _region(90, 90, 20, 20, label="dog"), {"type": "rectanglelabels", "value": {"x": 1}}]}]},
        {"id": 2, "data": {"image": "/data/local-files/?d=photos%2Ftall.png"},
         "annotations": [{"result": [_region(0, 0, 100, 100, label="dog", ow=300, oh=900)]}]},
        {"id": 3, "data": {"image": "s3://bucket/odd.png"}, "annotations": []},
        {"id": 7, "data": {"image": "sq.png"}, "annotations": [  # the ground truth wins over a later answer
            {"ground_truth": True, "result": [_region(0, 0, 50, 50, ow=10, oh=10)]},
            {"result": [_region(50, 50, 50, 50, ow=10, oh=10)]}]},
        {"id": 4, "data": {"image": "https://host/x/wide.jpg"}, "annotations": [{"result": []}]},
        {"id": 5, "data": {}, "annotations": []},
        {"id": 6, "data": {"image": "a.png"}, "annotations": [{"result": [_region(1, 1, 1, 1, ow=None)]}]},
    ]
    path = tmp_path / "export.json"
    path.write_text(json.dumps(tasks))
    got = read_label_studio(path)
    assert got.images == {"wide.jpg": [Box("cat", 64, 96, 320, 120)], "tall.png": [Box("dog", 0, 0, 300, 900)],
                          "sq.png": [Box("cat", 0, 0, 5, 5)], "a.png": []}
    assert got.sizes == {"wide.jpg": (640, 480), "tall.png": (300, 900), "sq.png": (10, 10)}
    assert got.labels == ("cat", "dog")
    reasons = [q.reason for q in got.quarantine]
    assert "rotated box (rotation 30°): tamis reads axis-aligned boxes only" in reasons[0]
    assert "outside its 640×480 image" in reasons[1]
    assert "value needs numeric x, y, width and height" in reasons[2]
    assert "a second task for image 'wide.jpg'" in reasons[3]
    assert "no image in data" in reasons[4]
    assert "no original_width/original_height" in reasons[5]
    assert len(reasons) == 6


def test_label_studio_file_errors(tmp_path):
    path = tmp_path / "export.json"
    path.write_text('{"data": {}}')
    with pytest.raises(DataError, match="a JSON list of tasks, got a dict; export the project as JSON"):
        read_label_studio(path)
    with pytest.raises(DataError, match="kind 'results'; use annotations or predictions"):
        read_label_studio(path, kind="results")


def test_image_names_from_label_studio_references():
    assert image_name("/data/upload/12/0f1e2d3c-my%20photo.jpg") == "my photo.jpg"
    assert image_name("/data/local-files/?d=data/images/a.png") == "a.png"
    assert image_name("https://example.com/a/b/c.jpeg?sig=1") == "c.jpeg"
    assert image_name("deadbeef-kept.jpg") == "deadbeef-kept.jpg"  # not an upload: the name is the name


# ------------------------------------------------------------------------------------------------ round trips
def test_coco_round_trip(tmp_path, images):
    for scores in (False, True):
        written = _boxset(scores)
        _same(written, read_coco(write_coco(tmp_path / f"coco-{scores}.json", written), images_dir=images))


def test_yolo_round_trip(tmp_path, images):
    for scores in (False, True):
        written = _boxset(scores)
        root = write_yolo(tmp_path / f"yolo-{scores}", written, images)
        back = read_yolo(root)
        assert back.quarantine == []
        _same(written, back, tol=1e-6 * 1000)  # six decimals of a side up to 900 px


def test_label_studio_predictions_round_trip(tmp_path):
    # Label Studio keys an image by its file name (sub-folders are storage detail) and reports a size only with a
    # region, so the set written here has flat names and every image has a box.
    written = _boxset(scores=True)
    written.images = {Path(k).name: v for k, v in written.images.items() if v}
    written.sizes = {Path(k).name: v for k, v in written.sizes.items() if Path(k).name in written.images}
    path = write_label_studio(tmp_path / "tasks.json", written, image_url=lambda n: f"/data/local-files/?d=in/{n}")
    tasks = json.loads(path.read_text())
    assert tasks[0]["data"] == {"image": "/data/local-files/?d=in/wide.jpg"}
    assert tasks[0]["predictions"][0]["score"] == 0.25  # the least sure box: Label Studio sorts by it
    assert tasks[0]["predictions"][0]["result"][0]["value"]["x"] == pytest.approx(10 / 640 * 100)
    back = read_label_studio(path, kind="predictions")
    assert back.quarantine == [] and back.labels == ("cat", "dog", "bird")
    _same(written, back)
    assert read_label_studio(path).images == {}  # no annotations yet: predictions are not answers


def test_writers_refuse_an_image_without_its_size(tmp_path, images):
    boxes = _boxset()
    del boxes.sizes["odd.png"]
    with pytest.raises(DataError, match="image 'odd.png' has no size in the box set"):
        write_coco(tmp_path / "c.json", boxes)
    with pytest.raises(DataError, match="YOLO: image .*missing.png does not exist"):
        write_yolo(tmp_path / "y", BoxSet(images={"missing.png": []}, sizes={"missing.png": (1, 1)}), images)


def test_readers_registry():
    assert READERS == {"coco": read_coco, "yolo": read_yolo, "label_studio": read_label_studio}
