"""Box labels through prepared rows (pipeline/boxes/rows.py): a label's boxes become the family codec's training
text through tamis's real preparation, the model's text comes back in original pixels, and a box project's
evaluation gives map50 / map."""

from __future__ import annotations

import io

import pytest

from pipeline.boxes.answer import box_label, parse_box_label
from pipeline.boxes.codecs import get_codec
from pipeline.boxes.rows import evaluate_box_rows, predicted_boxes, row_geometry, training_rows
from pipeline.boxes.scenes import SHAPES, make_scenes, render
from pipeline.config import PreprocessConfig
from pipeline.errors import DataError
from pipeline.model.families import get_family
from pipeline.model.tiny import BUILDERS, build_tokenizer
from pipeline.preprocess import ImagePreparer

SIZE = 448


def _rows(pad: str, n: int = 6) -> list[dict]:
    """Prepared rows of generated scenes (mixed aspect ratios), each labeled with its scene's boxes."""
    prep = ImagePreparer(PreprocessConfig(pad=pad), size=SIZE, max_pixels=10**8)
    rows = []
    for scene in make_scenes(n, seed=3):
        buf = io.BytesIO()
        render(scene).save(buf, format="PNG")
        rgb, box = prep(buf.getvalue())
        rows.append({"sample_id": scene.name, "width": scene.width, "height": scene.height, "prep_box": list(box),
                     "prep_width": rgb.shape[1], "prep_height": rgb.shape[0], "answer": box_label(scene.boxes)})
    return rows


def _close(a, b, tol: float = 1.0) -> bool:
    return len(a) == len(b) and all(x.label == y.label and max(abs(x.x - y.x), abs(x.y - y.y), abs(x.x2 - y.x2),
                                                                 abs(x.y2 - y.y2)) <= tol for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("family", "pad"), [("smolvlm", "square"), ("qwen2_vl", "none"), ("qwen2_5_vl", "none")])
def test_a_label_becomes_the_familys_text_and_reads_back_within_a_pixel(family, pad):
    fam = get_family(family)
    processor = BUILDERS[family](build_tokenizer(fam), 32)[1]

    def frame(w: int, h: int) -> tuple[int, int]:
        return fam.box_frame(processor, w, h, image_size=SIZE)

    codec = get_codec(fam.box_codec)
    rows = _rows(pad)
    trained = training_rows(rows, codec, frame)
    assert all(t["answer"] != r["answer"] and t["sample_id"] == r["sample_id"] and "prep_box" not in t
               for t, r in zip(trained, rows, strict=True))
    back, dropped = predicted_boxes([t["answer"] for t in trained], rows, codec, frame)
    assert dropped == 0
    for r in rows:
        key = lambda b: (b.y, b.x)  # noqa: E731
        assert _close(sorted(back[r["sample_id"]], key=key), sorted(parse_box_label(r["answer"]), key=key))


def test_padding_is_taken_out_of_the_coordinates():
    (row,) = _rows("square", n=1)
    g = row_geometry(row)
    assert g.canvas == (SIZE, SIZE) and g.content != (0, 0, SIZE, SIZE)  # a non-square scene is padded
    assert (g.width, g.height) == (row["width"], row["height"])


def test_a_box_projects_evaluation_gives_map50_and_map():
    codec = get_codec("json_1000")
    rows = _rows("none")
    perfect = [t["answer"] for t in training_rows(rows, codec)]
    result = evaluate_box_rows(perfect, rows, SHAPES, codec)
    assert set(result["metrics"]) == {"map50", "map"} and result["metrics"]["map50"] == pytest.approx(1.0)
    assert result["n"] == len(rows) and result["dropped"] == 0 and len(result["predictions"]) == len(rows)
    blind = evaluate_box_rows(["no boxes here"] * len(rows), rows, SHAPES, codec)
    assert blind["metrics"]["map50"] == 0.0
    # Half the answers unreadable: lower, and the pieces dropped are counted.
    half = [t if i % 2 else "[{'bbox_2d': oops" for i, t in enumerate(perfect)]
    worse = evaluate_box_rows(half, rows, SHAPES, codec)
    assert 0 < worse["metrics"]["map50"] < 1


def test_the_answers_confidence_ranks_its_boxes():
    codec = get_codec("json_1000")
    rows = _rows("none", n=2)
    texts = [t["answer"] for t in training_rows(rows, codec)]
    boxes, _ = predicted_boxes(texts, rows, codec, confidences=[0.25, None])
    assert {b.score for b in boxes[rows[0]["sample_id"]]} == {0.25}
    assert {b.score for b in boxes[rows[1]["sample_id"]]} == {1.0}


def test_a_row_whose_answer_is_not_a_box_label_is_named():
    (row,) = _rows("none", n=1)
    with pytest.raises(DataError, match=f"sample {row['sample_id']}: answer: not JSON"):
        training_rows([{**row, "answer": "cat"}], get_codec("json_1000"))
