"""Box codecs (issue 50 item 3): original pixels → a family's answer text → original pixels, through tamis's real
preparation (pipeline/preprocess.py's ImagePreparer) and each family's real processor configuration (the tiny
offline builders of pipeline/model/tiny.py)."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
from PIL import Image

from pipeline.boxes.box import Box, Geometry, smart_resize
from pipeline.boxes.codecs import CODECS, BoxCodec, get_codec
from pipeline.config import PreprocessConfig
from pipeline.errors import DataError
from pipeline.model.families import FAMILIES, get_family
from pipeline.model.tiny import BUILDERS, build_tokenizer

PREP_SIZE = 448
# Wide, tall, square, odd, tiny (enlarged by preparation), and one far larger than the canvas.
SIZES = [(640, 480), (300, 900), (512, 512), (333, 127), (17, 23), (449, 448), (1999, 301)]


@pytest.fixture(scope="module")
def processors() -> dict:
    """Each family's processor as its tiny checkpoint saves it (the builders alone: no weights needed here)."""
    out = {}
    for name in FAMILIES:
        fam = get_family(name)
        out[name] = BUILDERS[name](build_tokenizer(fam), 32)[1]
    return out


def _png(width: int, height: int, seed: int = 0) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def _geometry(family: str, processor, width: int, height: int) -> Geometry:
    """The geometry a row of `family` gets: the image prepared as tamis prepares it (padded square for families whose
    processor squares tiles), then the processor's frame of that canvas."""
    from pipeline.preprocess import ImagePreparer

    fam = get_family(family)
    cfg = PreprocessConfig(pad="square" if fam.square_tiles else "none")
    rgb, box = ImagePreparer(cfg, size=PREP_SIZE, max_pixels=10**8)(_png(width, height))
    canvas = (rgb.shape[1], rgb.shape[0])
    return Geometry(width, height, box, canvas, fam.box_frame(processor, *canvas, image_size=PREP_SIZE))


def _boxes(width: int, height: int, seed: int) -> list[Box]:
    """Random boxes plus the ones that touch the image's edges and corners."""
    rnd = random.Random(seed)
    boxes = [Box("whole", 0, 0, width, height), Box("left edge", 0, height / 4, width / 3, height / 2),
             Box("bottom right", width * 0.6, height * 0.7, width * 0.4, height * 0.3)]
    for i in range(8):
        x1, x2 = sorted(rnd.uniform(0, width) for _ in range(2))
        y1, y2 = sorted(rnd.uniform(0, height) for _ in range(2))
        if x2 - x1 > 2 and y2 - y1 > 2:
            boxes.append(Box(f"obj {i}", round(x1), round(y1), round(x2 - x1), round(y2 - y1)))
    return boxes


def _tolerance(codec: BoxCodec, g: Geometry) -> tuple[float, float]:
    """1 px, or half a text unit in original pixels where one unit spans more (a 1999-px image written in 0-1000 or
    in a 448-px frame cannot come back closer than the text's own resolution)."""
    ux, uy = codec.units(g)
    per_x = g.canvas[0] / ux * g.width / g.content[2]
    per_y = g.canvas[1] / uy * g.height / g.content[3]
    return max(1.0, per_x / 2 + 1e-6), max(1.0, per_y / 2 + 1e-6)


def test_every_family_names_a_registered_codec():
    assert {f: get_family(f).box_codec for f in FAMILIES} == {
        "idefics3": "json_1000", "smolvlm": "json_1000", "qwen2_vl": "qwen2_vl_tokens",
        "qwen2_5_vl": "qwen2_5_vl_json", "qwen3_vl": "json_1000", "gemma3": "json_1000",
        "llava_onevision": "json_1000", "internvl": "internvl_ref"}
    assert all(get_family(f).box_codec in CODECS for f in FAMILIES)
    with pytest.raises(DataError, match="unknown box codec 'yolo'; known: json_1000"):
        get_codec("yolo")


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_box_frame_is_the_image_the_processor_feeds_the_model(family, processors):
    """Qwen2.5-VL's absolute coordinates count the processor's resized pixels: box_frame must be that size exactly,
    read here from the real processor's patch grid."""
    fam, proc = get_family(family), processors[family]
    patch = proc.image_processor.patch_size
    for w, h in [(448, 448), (448, 213), (131, 448), (37, 51), (448, 17)]:
        thw = fam.image_inputs(proc, [Image.new("RGB", (w, h))])["image_grid_thw"][0].tolist()
        assert fam.box_frame(proc, w, h, image_size=max(w, h)) == (thw[2] * patch, thw[1] * patch), (w, h)


def test_box_frame_at_the_released_checkpoints_geometry():
    """The released Qwen2-VL/2.5-VL image processors' defaults (14-px patches merged 2×2: 28-px units, min 56² and
    max 28²·1280 pixels), not the tiny model's 16-px units: box_frame still matches the patch grid they produce,
    and smart_resize matches transformers' own on many shapes."""
    from types import SimpleNamespace

    from transformers import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as reference

    ip = Qwen2VLImageProcessor()
    assert (ip.patch_size, ip.merge_size) == (14, 2)
    processor = SimpleNamespace(image_processor=ip)  # box_frame and image_inputs read only the image processor
    fam = get_family("qwen2_5_vl")
    for w, h in [(448, 448), (448, 213), (131, 448), (37, 51), (1000, 1000)]:
        thw = fam.image_inputs(processor, [Image.new("RGB", (w, h))])["image_grid_thw"][0].tolist()
        assert fam.box_frame(processor, w, h) == (thw[2] * 14, thw[1] * 14), (w, h)
    rnd = random.Random(0)
    for _ in range(500):
        h, w = rnd.randint(1, 4000), rnd.randint(1, 4000)
        if max(h, w) / min(h, w) < 200:
            args = {"factor": 28, "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280}
            assert smart_resize(h, w, **args) == reference(h, w, **args), (h, w)


def test_smart_resize_keeps_its_bounds():
    assert smart_resize(448, 213, factor=28, min_pixels=56 * 56, max_pixels=448 * 448) == (448, 224)
    assert smart_resize(10, 10, factor=28, min_pixels=56 * 56, max_pixels=448 * 448) == (56, 56)
    h, w = smart_resize(2000, 3000, factor=28, min_pixels=56 * 56, max_pixels=448 * 448)
    assert h * w <= 448 * 448 and h % 28 == 0 and w % 28 == 0
    with pytest.raises(DataError, match="empty side"):
        smart_resize(0, 5, factor=28, min_pixels=1, max_pixels=10)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_through_each_familys_text(family, processors):
    codec = get_codec(get_family(family).box_codec)
    for k, (w, h) in enumerate(SIZES):
        g = _geometry(family, processors[family], w, h)
        boxes = _boxes(w, h, seed=k)
        text = codec.encode(boxes, g)
        back = codec.read(text, g)
        assert back.dropped == () and [b.label for b in back.boxes] == [b.label for b in boxes], text
        tx, ty = _tolerance(codec, g)
        for a, b in zip(boxes, back.boxes, strict=True):
            assert abs(a.x - b.x) <= tx and abs(a.x2 - b.x2) <= tx, (family, (w, h), a, b, text)
            assert abs(a.y - b.y) <= ty and abs(a.y2 - b.y2) <= ty, (family, (w, h), a, b, text)
            assert 0 <= b.x and b.x2 <= w and 0 <= b.y and b.y2 <= h
        if max(w, h) <= PREP_SIZE:  # the text's unit is at most a pixel here: exact within 1 px
            assert (tx, ty) == (1.0, 1.0)
        # The text is a fixed point: what it decodes to encodes to the same text.
        assert codec.encode(back.boxes, g) == text


def test_edge_boxes_land_on_the_edges_of_the_original():
    """A box over the whole image sits on the padding's border in the canvas: it must come back as the whole image,
    not shifted into the padding or cut by a pixel."""
    g = Geometry(640, 480, (0, 56, 448, 336), (448, 448))
    for name in CODECS:
        codec = get_codec(name)
        (whole,) = codec.decode(codec.encode([Box("all", 0, 0, 640, 480)], g), g)
        assert (whole.x, whole.y) == (0, 0) and whole.x2 == pytest.approx(640, abs=1) and whole.y2 == pytest.approx(
            480, abs=1), name


G = Geometry(800, 400, (0, 112, 448, 224), (448, 448))
MALFORMED = {
    # (text, boxes kept, pieces dropped)
    "json_1000": [
        ('```json\n[{"bbox_2d": [100, 300, 500, 700], "label": "cat"}]\n```', 1, 0),
        ('[{"bbox_2d": [100, 300, 500, 700], "label": "cat"}, {"bbox_2d": [10, 20, 30', 1, 1),  # cut off
        ('[{"bbox_2d": [1, 2, 3], "label": "a"}, {"bbox_2d": ["x", 2, 3, 4]}, {"bbox_2d": [1, 300, 9, 400]}]', 1, 2),
        ("[{'bbox_2d': [1, 2, 3, 4]}]", 0, 1),  # not JSON
        ('{"bbox_2d": [true, 300, 500, 700]}', 0, 1),
        ("I cannot see any cat here.", 0, 0),
        ('[{"bbox_2d": [100, 10, 500, 100], "label": "in the padding"}]', 0, 1),  # above the image: no area
    ],
    "qwen2_5_vl_json": [
        ('[{"bbox_2d": [10, 120, 200, 300], "label": "cat"}, {"bbox_2d": [5, 5]}]', 1, 1),
    ],
    "qwen2_vl_tokens": [
        ("<|object_ref_start|>cat<|object_ref_end|><|box_start|>(100,300),(500,700)<|box_end|>"
         "<|box_start|>(1,300),(9,400)<|box_end|>", 2, 0),  # the second box keeps the label before it
        ("<|object_ref_start|>cat<|object_ref_end|><|box_start|>(100,300),(500<|box_end|>", 0, 1),
        ("<|box_start|>(100,300),(500,700)<|box_end|><|box_start|>(100,300),(5", 1, 1),  # cut off
        ("<|box_start|>(100,300<|box_start|>(100,300),(500,700)<|box_end|>", 1, 1),  # one left open mid-way
    ],
    "internvl_ref": [
        ("<ref>cat</ref><box>[[100, 300, 500, 700], [600, 300, 900, 700]]</box>", 2, 0),
        ("<ref>cat</ref><box>[[100, 300, 500]]</box><ref>dog</ref><box>[[1, 300, 9, 400]]</box>", 1, 1),
        ("<ref>cat</ref><box>nothing</box>", 0, 1),
        ("<ref>cat</ref><box>[[100, 300, 500, 700]]</box><ref>dog</ref><box>[[1, 2", 1, 1),
        ("<ref>cat</ref><box>[[100, 300<ref>dog</ref><box>[[100, 300, 500, 700]]</box>", 1, 1),
    ],
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_pieces_are_dropped_and_counted(name):
    codec = get_codec(name)
    for text, kept, dropped in MALFORMED[name]:
        got = codec.read(text, G)
        assert (len(got.boxes), len(got.dropped)) == (kept, dropped), (text, got)
        assert all(isinstance(r, str) and r for r in got.dropped)


def test_labels_follow_their_boxes():
    got = get_codec("qwen2_vl_tokens").decode(MALFORMED["qwen2_vl_tokens"][0][0], G)
    assert [b.label for b in got] == ["cat", "cat"]
    got = get_codec("internvl_ref").decode(MALFORMED["internvl_ref"][0][0], G)
    assert [b.label for b in got] == ["cat", "cat"] and got[0].x2 < got[1].x
    # A box left open does not lend its label (or swallow) the next one.
    got = get_codec("internvl_ref").decode(MALFORMED["internvl_ref"][-1][0], G)
    assert [b.label for b in got] == ["dog"]


def test_coordinates_are_clamped_to_the_image():
    """Past the frame, into the padding, or swapped corners: the box comes back inside the original image."""
    codec = get_codec("json_1000")
    (b,) = codec.decode('[{"bbox_2d": [-50, 0, 1200, 1000], "label": "all"}]', G)
    assert (b.x, b.y, b.w, b.h) == (0, 0, 800, 400)
    (b,) = codec.decode('[{"bbox_2d": [500, 700, 250, 300], "label": "swapped"}]', G)
    assert b.x == pytest.approx(200) and b.x2 == pytest.approx(400) and 0 < b.y < b.y2 < 400
    enc = codec.encode([Box("outside", -100, -100, 2000, 2000)], G)
    assert enc == '[{"bbox_2d": [0, 250, 1000, 750], "label": "outside"}]'
    absolute = get_codec("qwen2_5_vl_json")
    (b,) = absolute.decode('[{"bbox_2d": [0, 0, 9999, 9999], "label": "x"}]', G)
    assert (b.x, b.y, b.x2, b.y2) == (0, 0, 800, 400)


def test_geometry_refuses_what_cannot_be_a_prepared_image():
    with pytest.raises(DataError, match="does not fit the canvas"):
        Geometry(100, 100, (10, 0, 448, 448), (448, 448))
    with pytest.raises(DataError, match="empty image"):
        Geometry(0, 100, (0, 0, 448, 448), (448, 448))
