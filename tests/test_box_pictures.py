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


def test_box_mistakes_by_hand():
    from pipeline.boxes.mistakes import box_mistakes

    labeled = [Box("disc", 0, 0, 100, 100), Box("square", 200, 0, 100, 100), Box("triangle", 0, 200, 100, 100),
               Box("disc", 400, 400, 50, 50)]
    predicted = [Box("disc", 5, 5, 100, 100),          # IoU 0.82, same class: a hit
                 Box("disc", 200, 0, 100, 90),         # IoU 0.9 on the square: wrong class
                 Box("triangle", 60, 200, 100, 100),   # IoU 40/160 = 0.25: misplaced
                 Box("square", 600, 600, 20, 20)]      # over nothing labeled: extra (the disc at 400 is missed)
    m = box_mistakes(labeled, predicted)
    assert m.hits == 1 and m.counts() == {"missed": 1, "wrong_class": 1, "misplaced": 1, "extra": 1}
    assert m.sentence() == ("1 missed (disc) · 1 wrong class (square → disc) · 1 misplaced (triangle, IoU 0.25) · "
                            "1 extra (square)")
    assert box_mistakes(labeled, labeled).count == 0 and box_mistakes([], []).sentence() == "no box error"


def test_the_error_gallery_ranks_test_images_by_box_errors_not_text():
    """A box answer never equals its label as text: the gallery picks images by what the boxes got wrong."""
    from pipeline.roundreport.box_pictures import box_errors

    codec = get_codec("json_1000")
    rows, geos = [], {}
    for i, canvas in enumerate([(640, 320), (300, 600), (512, 512)]):
        scene = make_scene(f"t{i}.png", 70 + i, canvases=[canvas], objects=(2, 2))
        _, geo = _prepared(scene)
        g = row_geometry(geo)
        a, b = scene.boxes
        # 0: both boxes found (within a pixel or two of rounding); 1: one missed; 2: one missed, one wrong class
        answer = [[a, b], [a], [Box("disc" if a.label != "disc" else "square", a.x, a.y, a.w, a.h)]][i]
        rows.append({"sample_id": f"s{i}", "answer": box_label(scene.boxes), "prediction": codec.encode(answer, g),
                     "confidence": 0.5 + i / 10})
        geos[f"s{i}"] = geo
    assert all(r["prediction"] != r["answer"] for r in rows)  # as text every answer is "wrong"
    got = box_errors(rows, geos, "json_1000", top=12)
    assert [r["sample_id"] for r in got] == ["s2", "s1"]
    assert got[0]["error_counts"] == {"missed": 1, "wrong_class": 1, "misplaced": 0, "extra": 0}
    assert got[1]["errors"].startswith("1 missed (")
    # A codec that counts the processor's pixels cannot be read without the processor: the caller falls back.
    assert box_errors(rows, geos, "qwen2_5_vl_json", top=12) is None
