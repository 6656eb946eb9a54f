"""data.max_image_pixels governs decoding, above Pillow's own ~89 Mpx decompression-bomb cap too."""

import io

import pytest
from PIL import Image

from pipeline.data.images import ImageRejected, open_image

BIG = (9500, 9500)  # 90.25 Mpx: above Pillow's default MAX_IMAGE_PIXELS (89,478,485), below 2× of it


@pytest.fixture(scope="module")
def big_png() -> bytes:
    buf = io.BytesIO()
    Image.new("1", BIG, 1).save(buf, format="PNG")  # 1 bit per pixel: ~11 MB decoded
    return buf.getvalue()


def test_a_limit_above_pillows_cap_lets_the_image_through(big_png):
    before = Image.MAX_IMAGE_PIXELS
    img = open_image(big_png, max_pixels=100_000_000)
    assert img.size == BIG
    assert Image.MAX_IMAGE_PIXELS == before  # the process-wide setting is left as it was


def test_the_rejection_names_the_setting(big_png):
    with pytest.raises(ImageRejected, match=r"9500×9500 = 90,250,000 pixels exceeds data.max_image_pixels = "
                                            r"64,000,000"):
        open_image(big_png, max_pixels=64_000_000)
