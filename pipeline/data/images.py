"""Decoding images safely: a full decode (not only `verify()`), a pixel-count guard, EXIF orientation applied."""

from __future__ import annotations

import io
import warnings

from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from pipeline.errors import DataError


class ImageRejected(DataError):
    """An image that cannot be used; `reason` is what a person should know to fix it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def open_image(data: bytes, *, max_pixels: int) -> Image.Image:
    """Decode `data` completely and apply its EXIF orientation; the original mode (CMYK, I;16, P, RGBA…) is kept.

    The pixel count is checked from the header before decoding, so a decompression bomb is rejected cheaply.
    """
    if not data:
        raise ImageRejected("empty file (0 bytes)")
    ImageFile.LOAD_TRUNCATED_IMAGES = False  # a truncated file must fail, not come back half grey
    limit = (f"exceeds data.max_image_pixels = {max_pixels:,} (possible decompression bomb); raise the limit if the "
             "image is genuine")
    previous = Image.MAX_IMAGE_PIXELS
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            # Pillow's own cap (~89 Mpx) would refuse an image the setting allows: the header check below is the
            # guard while opening, and frames decoded later (GIF, ICO) are held to the setting, not Pillow's default.
            Image.MAX_IMAGE_PIXELS = None
            img = Image.open(io.BytesIO(data))
            Image.MAX_IMAGE_PIXELS = max_pixels
            w, h = img.size
            if w * h > max_pixels:
                raise ImageRejected(f"{w}×{h} = {w * h:,} pixels {limit}")
            img.load()
    except ImageRejected:
        raise
    except UnidentifiedImageError:
        raise ImageRejected("not a decodable image (unknown or corrupt format)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageRejected(f"a frame {limit} (Pillow: {exc})") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageRejected(f"corrupt or truncated image: {exc}") from None
    finally:
        Image.MAX_IMAGE_PIXELS = previous
    if w == 0 or h == 0:
        raise ImageRejected(f"image has no pixels ({w}×{h})")
    try:
        img = ImageOps.exif_transpose(img)
    except Exception as exc:  # noqa: BLE001 - malformed EXIF must not take the sample down
        raise ImageRejected(f"unreadable EXIF orientation: {exc}") from None
    return img
