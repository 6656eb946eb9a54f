"""`tamis predict` on a box project (issue 50 item 8): the model's answer read by the family's codec through each
image's preparation geometry into boxes in the image's own pixels, clamped inside it; the CSV has one row per box
and the JSONL one row per image with its boxes list."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from pipeline.boxes.codecs import get_codec
from pipeline.boxes.rows import row_geometry
from pipeline.boxes.scenes import SHAPES, make_scene, write_scenes
from tests.test_box_round import _data, _run

BOX_COLUMNS = ["image", "class", "x", "y", "w", "h", "score"]


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_box_answers_come_back_in_each_images_own_pixels_clamped_inside_it(tmp_path, tiny_models):
    """Scenes from 2:1 wide to 1:2 tall, prepared as predict prepares them (letterboxed square): the codec's text
    for each scene's boxes reads back to those boxes in the scene's pixels, and a box the model writes past the
    image's edge is clamped inside it."""
    from pipeline.config import DataConfig, ModelConfig, PreprocessConfig, SourceConfig
    from pipeline.predict import Prediction, read_boxes, read_new_images, write_predictions

    scenes = [make_scene(f"s{i}.png", 200 + i, canvases=[c]) for i, c in enumerate([(640, 320), (300, 600),
                                                                                     (512, 512)])]
    write_scenes(tmp_path / "new", scenes)
    source = SourceConfig(kind="folder", path=tmp_path / "new")
    data = DataConfig(task="boxes", answers=list(SHAPES), sources=[source], question="Find every shape.")
    model = ModelConfig(name_or_path=str(tiny_models["idefics3"]), family="idefics3")
    images = sorted(read_new_images(tmp_path / "new", data=data, preprocess=PreprocessConfig(pad="square"),
                                    model=model), key=lambda im: im.file)
    codec = get_codec("json_1000")
    truth = {s.name: s for s in scenes}
    preds = []
    for im in images:
        g = row_geometry(im.geometry)
        assert (g.width, g.height) == (truth[im.file].width, truth[im.file].height)
        text = codec.encode(list(truth[im.file].boxes), g)
        beyond = '{"bbox_2d": [0, 0, 1000, 1000], "label": "disc"}'  # the whole canvas: past a letterboxed image
        preds.append(Prediction(im.file, im.question, text.rstrip("]") + ", " + beyond + "]", 0.5, "a"))
    read_boxes(preds, images, codec, None)
    for p in preds:
        s = truth[p.file]
        assert p.size == (s.width, s.height) and len(p.boxes) == len(s.boxes) + 1
        for got, want in zip(p.boxes, s.boxes, strict=False):
            assert got.label == want.label and max(abs(got.x - want.x), abs(got.y - want.y), abs(got.w - want.w),
                                                   abs(got.h - want.h)) <= max(s.width, s.height) / 500
        assert all(0 <= b.x and 0 <= b.y and b.x + b.w <= s.width and b.y + b.h <= s.height for b in p.boxes)
        assert all(b.score == 0.5 for b in p.boxes)
        assert (p.boxes[-1].x, p.boxes[-1].y, p.boxes[-1].w, p.boxes[-1].h) == (0, 0, s.width, s.height)
    files = write_predictions(preds, tmp_path / "p.csv", boxes=True)
    rows = _read_csv(files.csv)
    assert list(rows[0]) == BOX_COLUMNS and len(rows) == sum(len(p.boxes) for p in preds)
    lines = [json.loads(x) for x in files.jsonl.read_text().splitlines()]
    assert [len(x["boxes"]) for x in lines] == [len(p.boxes) for p in preds]
    b = preds[0].boxes[0]
    assert lines[0]["boxes"][0] == {"class": b.label, "score": 0.5, "box": [round(v, 1) for v in (b.x, b.y, b.w, b.h)]}
    assert rows[0] == {"image": preds[0].file, "class": b.label, "x": f"{b.x:.1f}", "y": f"{b.y:.1f}",
                       "w": f"{b.w:.1f}", "h": f"{b.h:.1f}", "score": "0.500000"}


def _random_adapter(model_dir: Path, out: Path) -> Path:
    """A LoRA adapter whose B matrices are random: the tiny model then answers something (a trained round's adapter
    is the slow test's business)."""
    import torch

    from pipeline.config import ModelConfig
    from pipeline.model.loading import load_model

    ld = load_model(ModelConfig(name_or_path=str(model_dir), family="idefics3", mode="lora"), trainable=True)
    torch.manual_seed(0)
    for name, p in ld.model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5)
    ld.model.save_pretrained(str(out))
    return out


def test_cli_predict_on_a_box_project_writes_a_row_per_box_and_a_boxes_list_per_image(tmp_path, tiny_models):
    pool, test = _data(tmp_path / "data")
    project = tmp_path / "project"
    project.mkdir()
    init = _run(project, "init", str(pool), "--test", str(test), "--model", str(tiny_models["idefics3"]))
    assert init.returncode == 0, init.stdout + init.stderr
    adapter = _random_adapter(tiny_models["idefics3"], tmp_path / "adapter")
    new = tmp_path / "new"
    scenes = [make_scene(f"n{i}.png", 500 + i, canvases=[c]) for i, c in enumerate([(480, 240), (200, 400)])]
    write_scenes(new, scenes)
    out = tmp_path / "out" / "boxes.csv"
    res = _run(project, "predict", str(new), "--adapter", str(adapter), "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    sizes = {s.name: (s.width, s.height) for s in scenes}
    with out.open(newline="") as f:
        assert next(csv.reader(f)) == BOX_COLUMNS
    for row in _read_csv(out):
        w, h = sizes[row["image"]]
        x, y, bw, bh = (float(row[k]) for k in "xywh")
        assert 0 <= x and 0 <= y and x + bw <= w + 0.1 and y + bh <= h + 0.1 and row["class"] in SHAPES
    lines = [json.loads(x) for x in out.with_suffix(".jsonl").read_text().splitlines()]
    assert sorted(x["file"] for x in lines) == sorted(sizes)
    for x in lines:
        assert (x["width"], x["height"]) == sizes[x["file"]] and isinstance(x["boxes"], list)
        assert all(0 <= b["box"][0] and b["box"][0] + b["box"][2] <= x["width"] + 0.1 for b in x["boxes"])
    assert sum(len(x["boxes"]) for x in lines) == len(_read_csv(out))
