"""The perceptual match labels follow through a lossy re-encode (pipeline/annotation/perceptual.py, issue 46 row 21):
the same photo as a JPEG at quality 70 resized by 0.8 is the same picture; other photos, and digits shifted or with
a few pixels changed, never are."""

import io
import itertools

import numpy as np
import pytest
from PIL import Image

from pipeline.annotation.perceptual import (
    PHASH_MAX_BITS,
    THUMB_MAX_DIFF,
    hash_bits,
    look_of,
    mutual_matches,
    same_picture,
    thumb_diff,
)

# scikit-image's photos that ship with it ("cat" is chelsea again, so it is left out)
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "camera", "coins", "moon", "page", "text", "brick", "grass",
          "gravel", "clock", "hubble_deep_field", "immunohistochemistry", "retina", "logo", "colorwheel", "cell")


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def _jpeg_smaller(img: Image.Image, quality=70, scale=0.8) -> bytes:
    w, h = img.size
    buf = io.BytesIO()
    img.convert("RGB").resize((round(w * scale), round(h * scale)), Image.Resampling.LANCZOS).save(
        buf, "JPEG", quality=quality)
    return buf.getvalue()


def _photo(name, crop):
    import skimage.data

    img = getattr(skimage.data, name)()
    if img.dtype != np.uint8:
        img = (255 * (img - img.min()) / (np.ptp(img) or 1)).astype(np.uint8)
    img = np.stack([img] * 3, -1) if img.ndim == 2 else img[..., :3]
    h, w = img.shape[:2]
    return Image.fromarray(img[h // 4: h // 4 + 96, w // 4: w // 4 + 128] if crop else img)


@pytest.mark.parametrize("crop", [True, False], ids=["crop-128x96", "full"])
def test_a_photo_re_encoded_as_jpeg_70_and_resized_by_0_8_is_the_same_picture_and_no_other_photo_is(crop):
    photos = {n: _photo(n, crop) for n in PHOTOS}
    looks = {n: look_of(_png(im)) for n, im in photos.items()}
    for n, im in photos.items():
        again = look_of(_jpeg_smaller(im))
        assert same_picture(looks[n], again), (n, hash_bits(looks[n].phash, again.phash), thumb_diff(looks[n], again))
    for a, b in itertools.combinations(looks, 2):
        assert not same_picture(looks[a], looks[b]), (a, b)


def _digits(n=120):
    from sklearn.datasets import load_digits

    return np.rint(load_digits().images[:n] * (255 / 16)).clip(0, 255).astype(np.uint8)


@pytest.mark.parametrize("scale", [1, 4], ids=["8px", "32px"])
def test_digits_that_differ_by_a_few_pixels_are_never_the_same_picture(scale):
    """The demo's 8×8 digits (and the same enlarged): a one-pixel shift, two pixels changed, another digit."""
    rng = np.random.default_rng(0)
    size = 8 * scale

    def look(a):
        return look_of(_png(Image.fromarray(a).resize((size, size), Image.Resampling.NEAREST)))

    digits = _digits()
    looks = [look(d) for d in digits]
    for d, lk in zip(digits, looks, strict=True):
        jitter = d.copy()
        at = rng.choice(64, 2, replace=False)
        jitter.flat[at] = (jitter.flat[at].astype(int) + 128) % 256
        for other in (np.roll(d, 1, axis=1), np.roll(d, 1, axis=0), jitter):
            assert not same_picture(lk, look(other))
    pairs = [(i, j) for i, j in itertools.combinations(range(len(digits)), 2) if same_picture(looks[i], looks[j])]
    assert pairs == []


def test_matches_must_be_unique_and_mutual():
    # o1 looks like a only; o2 like b and c (ambiguous); o3 and o4 both like d (ambiguous); o5 like e, labeled
    matches = {"o1": {"a"}, "o2": {"b", "c"}, "o3": {"d"}, "o4": {"d"}, "o5": {"e"}, "o6": set()}
    assert mutual_matches(matches, taken={"e"}) == {"o1": "a"}


def test_the_thresholds_are_the_documented_ones():
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "annotation.md").read_text()
    assert f"{PHASH_MAX_BITS} of 64 bits" in doc and f"{THUMB_MAX_DIFF} of 255" in doc
