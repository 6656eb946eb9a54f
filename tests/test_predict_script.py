"""The export's standalone predict.py (pipeline/serving/predict_script.py) against tamis's own scorers on the tiny
model: the same prompt, the same answer tokens, the same closed-set probabilities (every token of every answer) and
the same greedy answers. Fast: no project, no rounds; the slow end-to-end check without tamis importable is in
tests/test_serve_export.py."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from pipeline.config import DataConfig, ModelConfig, PreprocessConfig, SelectConfig
from pipeline.serving import predict_script as script
from pipeline.serving.predict_config import predict_config

LETTERS = ["A", "B", "C", "D", "E", "F"]


@pytest.fixture(scope="module")
def loaded(tiny_models):
    from pipeline.model.loading import load_model

    return load_model(ModelConfig(name_or_path=str(tiny_models["idefics3"]), family="idefics3", mode="lora"))


def images() -> list[Image.Image]:
    from skimage import data

    out = []
    for name in ("astronaut", "coffee", "camera"):
        arr = getattr(data, name)()
        out.append(Image.fromarray(arr[:200, :200]).convert("RGB").resize((32, 32), Image.BILINEAR))
    return out


def config(loaded, answers):
    return predict_config(loaded=loaded, processor=loaded.processor, data=DataConfig(
        answers=answers, question="Which letter is shown in the image?"), preprocess=PreprocessConfig(
        size=32, pad="square"), model=ModelConfig(name_or_path="m", family="idefics3", mode="lora"),
        select=SelectConfig(), size=32)


def rows(ims):
    out = []
    for i, im in enumerate(ims):
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        out.append({"sample_id": str(i), "prepared": buf.getvalue(), "question": "Which letter is shown in the image?"})
    return out


def test_closed_answers_score_every_token_as_tamis_does(loaded, monkeypatch):
    from pipeline.scoring import ClosedSetScorer

    monkeypatch.setattr(script, "ANSWER_ROWS", 4)  # six answers: two forwards, the second of two rows

    cfg = config(loaded, LETTERS)
    cand = script.answer_tokens(loaded.processor, cfg)
    assert cand == [loaded.family.answer_token_ids(loaded.processor, cfg["question"], a) for a in LETTERS]
    assert len({c[0] for c in cand}) == 1  # the shared leading space: the first token alone tells nothing
    ims = images()
    want = ClosedSetScorer(loaded, LETTERS).score(rows(ims), batch_size=2).probs
    got = np.array([script.softmax(script.score_answers(loaded.model, loaded.processor, cfg, im, cand)) for im in ims])
    np.testing.assert_allclose(got, want, atol=1e-4)
    # Scoring the shared first token alone gives every letter 1/6; all tokens tell them apart.
    assert np.abs(want - 1 / len(LETTERS)).max() > 1e-3


def test_open_answers_generate_as_tamis_does(loaded):
    from pipeline.scoring import OpenAnswerScorer

    cfg = config(loaded, None)
    ims = images()
    res = OpenAnswerScorer(loaded, max_new_tokens=cfg["max_new_tokens"], min_new_tokens=1).score(rows(ims),
                                                                                                 batch_size=1)
    for i, im in enumerate(ims):
        text, mean = script.generate_answer(loaded.model, loaded.processor, cfg, im)
        assert text == res.answers[i]
        assert mean == pytest.approx(float(np.nanmean(res.token_logprobs[i])), abs=1e-4)


@pytest.mark.parametrize("crop,fmt", [((slice(100, 160), slice(50, 250)), "PNG"),  # wide, shrunk 6x: area
                                      ((slice(0, 90), slice(0, 70)), "JPEG"),  # tall grey JPEG: reduced decode
                                      ((slice(0, 20), slice(0, 25)), "PNG")])  # small: enlarged, bicubic
def test_images_are_prepared_as_the_preprocess_stage_prepares_them(tmp_path, crop, fmt):
    from skimage import data

    from pipeline.preprocess import prepare_image

    arr = (data.camera() if fmt == "JPEG" else data.astronaut())[crop]
    f = tmp_path / f"image.{fmt.lower()}"
    Image.fromarray(arr).save(f, format=fmt)
    want = prepare_image(f.read_bytes(), PreprocessConfig(size=32, pad="square", pad_color=(10, 20, 30)), size=32,
                         max_pixels=10**8)
    got = np.asarray(script.prepare_image(f, {"size": 32, "pad": "square", "pad_color": [10, 20, 30],
                                              "background": [255, 255, 255]}))
    assert got.shape == want.shape == (32, 32, 3)
    assert ((got == [10, 20, 30]).all(-1) == (want == [10, 20, 30]).all(-1)).mean() > 0.99  # the same content box
    # Pillow's resampling, not OpenCV's (their bicubic kernels differ: a = -0.5 and -0.75): within one grey level on
    # average (measured: 0.20 shrunk, 0.02 JPEG, 0.48 enlarged)
    assert np.abs(got.astype(int) - want.astype(int)).mean() < 1
