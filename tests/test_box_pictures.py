"""The round report's pictures of a box project (issue 50 item 8): the labeled boxes and the model's boxes drawn on
the prepared picture, through its geometry, on images of mixed aspect ratio."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from pipeline.boxes.answer import box_label
from pipeline.boxes.box import Box
from pipeline.boxes.codecs import get_codec
from pipeline.boxes.rows import row_geometry
from pipeline.boxes.scenes import make_scene, render
from pipeline.config import PreprocessConfig
from pipeline.preprocess import ImagePreparer, encode_png
from pipeline.roundreport.box_pictures import LABELED, PREDICTED, overlay


def _prepared(scene, size: int = 256) -> tuple[bytes, dict]:
    buf = io.BytesIO()
    render(scene).save(buf, format="PNG")
    canvas, content = ImagePreparer(PreprocessConfig(pad="square"), size=size, max_pixels=10**8)(buf.getvalue())
    return encode_png(canvas), {"width": scene.width, "height": scene.height, "prep_box": list(content),
                                "prep_width": canvas.shape[1], "prep_height": canvas.shape[0]}


def _colour_at(png: bytes, x: float, y: float) -> tuple[int, ...]:
    return tuple(np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))[int(y), int(x)])


def test_labeled_and_predicted_boxes_are_drawn_where_they_lie_on_the_prepared_picture():
    codec = get_codec("json_1000")
    for i, canvas in enumerate([(640, 320), (300, 600)]):  # letterboxed: the content sits off the canvas's origin
        scene = make_scene(f"s{i}.png", 40 + i, canvases=[canvas], objects=(1, 1))
        png, geo = _prepared(scene)
        g = row_geometry(geo)
        (truth,) = scene.boxes
        moved = Box(truth.label, truth.x + truth.w / 2, truth.y + truth.h / 2, truth.w / 3, truth.h / 3)
        drawn = overlay({"a": png}, {"a": geo}, {"a": box_label([truth])}, {"a": codec.encode([moved], g)},
                        codec.name)["a"]
        for box, colour in ((truth, LABELED), (moved, PREDICTED)):
            (fx1, fy1), (_, fy2) = g.to_frame(box.x, box.y), g.to_frame(box.x + box.w, box.y + box.h)
            left_edge = (fx1 * geo["prep_width"] + 0.5, (fy1 + fy2) / 2 * geo["prep_height"])
            assert _colour_at(drawn, *left_edge) == colour, (canvas, box)
        assert _colour_at(png, *left_edge) != PREDICTED
    # No geometry (an older prepared dataset) or nothing to draw: the picture is left as it is.
    assert overlay({"a": png}, {}, {"a": box_label([truth])}, {}, codec.name)["a"] == png
    assert overlay({"a": png}, {"a": geo}, {"a": None}, {"a": "not boxes"}, codec.name)["a"] == png
