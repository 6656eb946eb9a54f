"""Samples of several images, the library parts of issue 51 item 2 done so far: every image of a sample prepared as
the first is (aspect kept), a sample's embedding from its images' as stated, and a Label Studio task and config with
one Image per picture (and the earlier turns shown)."""

import io
import xml.etree.ElementTree as ET

import numpy as np
from PIL import Image

from pipeline.config import PreprocessConfig
from pipeline.fields.labelstudio import labeling_config, sample_task
from pipeline.preprocess import decode_prepared, prepare_image
from pipeline.several_images import MORE_PREPARED, prepare_more_batch, sample_embedding


def png(size, colour=(200, 80, 20)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def test_every_later_image_is_prepared_as_the_first_is_with_its_aspect_kept_and_a_bad_one_keeps_its_reason():
    wide, tall = png((120, 40)), png((30, 90), (10, 10, 200))
    batch = {"more_images": [[{"image": wide}, {"image": tall}], [], [{"image": b"not an image"}]]}
    out = prepare_more_batch(batch, cfg=PreprocessConfig(), size=48, max_pixels=10**7)
    assert set(out) == set(MORE_PREPARED) and [len(v) for v in out["more_prepared"]] == [2, 0, 1]
    assert (out["more_prep_width"][0], out["more_prep_height"][0]) == ([48, 16], [16, 48])
    first = decode_prepared(out["more_prepared"][0][0])
    assert np.array_equal(first, prepare_image(wide, PreprocessConfig(), size=48, max_pixels=10**7))
    assert out["more_prepared"][2] == [None] and "not a decodable image" in out["more_prep_error"][2][0]
    padded = prepare_more_batch({"more_images": [[{"image": wide}]]}, cfg=PreprocessConfig(pad="square"), size=48,
                                max_pixels=10**7)
    assert padded["more_prep_box"][0] == [[0, 16, 48, 16]] and padded["more_prep_height"][0] == [48]


def test_a_samples_embedding_is_the_normalised_mean_of_its_images_and_a_single_image_keeps_its_own():
    a, b = np.array([3.0, 4.0]), np.array([0.0, 2.0])
    assert np.allclose(sample_embedding([a]), a / 5)
    both = sample_embedding([a, b])
    assert np.allclose(both, sample_embedding([b, a])) and np.isclose(np.linalg.norm(both), 1)
    assert np.allclose(both, (a / 5 + b / 2) / np.linalg.norm(a / 5 + b / 2))


def test_a_label_studio_task_shows_every_picture_and_the_earlier_turns():
    task = sample_task("s1", ["/data/local-files/?d=a.png", "/data/local-files/?d=b.png"], "Which is warmer?",
                       [("user", "Describe both."), ("assistant", "a red bar, a blue bar")])
    assert task["data"] == {"image": "/data/local-files/?d=a.png", "image_2": "/data/local-files/?d=b.png",
                            "text": "Which is warmer?", "sample_id": "s1",
                            "context": "user: Describe both.\nassistant: a red bar, a blue bar"}
    view = ET.fromstring(labeling_config(2, answers=["left", "right"], context=True))
    keys = [e.get("value")[1:] for e in view.iter("Image")] + [e.get("value")[1:] for e in view.iter("Text")]
    assert set(keys) == set(task["data"]) - {"sample_id"}
    assert [c.get("value") for c in view.find("Choices[@name='answer']")] == ["left", "right"]
    assert ET.fromstring(labeling_config(1)).find("TextArea[@name='answer']") is not None
