"""The same picture under other pixels: a lossy re-encode (PNG → JPEG, a photo tool's resize) keeps what the image
shows, and a label should follow it (pipeline/annotation/carry.py), but never to an image that differs.

Two images are the same picture when all three hold (the thresholds are stated here and in docs/annotation.md):

1. the same shape: width / height within ASPECT_TOLERANCE (2 %) of each other (a crop is another image);
2. their 64-bit DCT perceptual hashes (pHash: greyscale 32×32, 2-D DCT, the 8×8 lowest frequencies against their
   median) differ in at most PHASH_MAX_BITS (10) bits: the cheap filter a pool's hashes are compared with;
3. their 16×16 RGB thumbnails (each cell the mean of its block) differ in no cell and channel by more than
   THUMB_MAX_DIFF (24) of 255 grey levels: a few pixels changed in one place fail this, where a pHash misses them.

A JPEG at quality 70 resized by 0.8 stays within 18 levels and 6 bits on scikit-image's photos (whole or cropped,
tests/test_perceptual.py); two different photos differ by 36 levels or more, the demo's digits by 64 or more, a
digit with two pixels changed by 128, a digit shifted by one pixel by 191. A small, hard-edged image (8×8 digits, pixel art) re-encoded with loss may exceed the
thumbnail limit and stay an orphan: the error this rule makes is a label left for a person, never a wrong label.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

ASPECT_TOLERANCE = 0.02  # |log(aspect_a / aspect_b)| at most this: the same shape
PHASH_MAX_BITS = 10  # of 64: the pHash filter
THUMB_SIZE = 16  # the thumbnail is THUMB_SIZE × THUMB_SIZE RGB
THUMB_MAX_DIFF = 24  # of 255: the largest difference of any thumbnail cell and channel
_HASH_SIDE, _LOW = 32, 8


def _dct_matrix(n: int) -> np.ndarray:
    """The orthonormal DCT-II as a matrix: D @ x is the DCT of x along axis 0 (no scipy needed for 32 points)."""
    k, i = np.arange(n)[:, None], np.arange(n)[None, :]
    m = np.cos(np.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2 / n)
    m[0] /= math.sqrt(2)
    return m


_DCT = _dct_matrix(_HASH_SIDE)


@dataclass(frozen=True)
class Look:
    """What an image shows, small: its pHash, its size and its 16×16 RGB thumbnail (768 bytes)."""

    phash: int
    width: int
    height: int
    thumb: bytes

    def encode(self) -> str:
        return f"{self.phash:016x}:{self.width}x{self.height}:{base64.b64encode(self.thumb).decode('ascii')}"

    @classmethod
    def decode(cls, text: str) -> Look:
        phash, size, thumb = text.split(":")
        w, h = size.split("x")
        return cls(int(phash, 16), int(w), int(h), base64.b64decode(thumb))


def decoded(image: bytes, mode: str) -> Any:
    """Encoded image bytes as a PIL image in `mode`, EXIF-transposed (as shown); None when they do not decode."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(image)) as im:
            return ImageOps.exif_transpose(im).convert(mode)
    except (UnidentifiedImageError, OSError, ValueError):
        return None


def look_of(image: bytes) -> Look | None:
    """The Look of encoded image bytes (EXIF-transposed, as shown); None when they do not decode."""
    from PIL import Image

    rgb = decoded(image, "RGB")
    if rgb is None:
        return None
    grey = np.asarray(rgb.convert("L").resize((_HASH_SIDE, _HASH_SIDE), Image.Resampling.LANCZOS), dtype=np.float64)
    low = (_DCT @ grey @ _DCT.T)[:_LOW, :_LOW].ravel()
    bits = low > np.median(low[1:])  # the DC term (the mean brightness) would skew the median
    phash = int("".join("1" if b else "0" for b in bits), 2)
    thumb = rgb.resize((THUMB_SIZE, THUMB_SIZE), Image.Resampling.BOX).tobytes()
    return Look(phash, rgb.width, rgb.height, thumb)


def same_shape(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return abs(math.log((a[0] / a[1]) / (b[0] / b[1]))) <= ASPECT_TOLERANCE


def hash_bits(a: int, b: int) -> int:
    return (a ^ b).bit_count()


def thumb_diff(a: Look, b: Look) -> int:
    return int(np.abs(np.frombuffer(a.thumb, np.uint8).astype(np.int16) - np.frombuffer(b.thumb, np.uint8)).max())


def same_picture(a: Look, b: Look) -> bool:
    """The three tests of the module docstring."""
    return (same_shape((a.width, a.height), (b.width, b.height)) and hash_bits(a.phash, b.phash) <= PHASH_MAX_BITS
            and thumb_diff(a, b) <= THUMB_MAX_DIFF)


def near(look: Look, pool: Sequence[tuple[int, int, int]], ids: Sequence[str]) -> list[str]:
    """The `ids` whose (pHash, width, height) in `pool` pass tests 1 and 2 against `look`: the few a thumbnail is
    then compared with (a pool's hashes are cheap to keep, its thumbnails are not)."""
    if not pool:
        return []
    arr = np.array(pool, dtype=np.uint64)
    bits = np.bitwise_count(arr[:, 0] ^ np.uint64(look.phash))
    aspect = np.log(arr[:, 1].astype(np.float64) / arr[:, 2].astype(np.float64))
    ok = (bits <= PHASH_MAX_BITS) & (np.abs(aspect - math.log(look.width / look.height)) <= ASPECT_TOLERANCE)
    return [ids[i] for i in np.flatnonzero(ok)]


def mutual_matches(matches: Mapping[str, set[str]], taken: set[str]) -> dict[str, str]:
    """orphan → successor where the match is unique both ways: the orphan looks like exactly one image of the pool
    (labeled ones included), that image is not labeled (`taken`), and no other orphan looks like it. Anything less
    is ambiguous (near-duplicates in the pool, two labels for one picture) and stays an orphan."""
    claimed: dict[str, int] = {}
    for found in matches.values():
        for s in found:
            claimed[s] = claimed.get(s, 0) + 1
    return {o: s for o, found in matches.items() if len(found) == 1
            for s in found if s not in taken and claimed[s] == 1}
