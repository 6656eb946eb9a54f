import io
import json

import cv2
import datasets
import numpy as np
import pytest
from PIL import Image

from pipeline.config import ModelConfig, PreprocessConfig
from pipeline.data.images import ImageRejected, open_image
from pipeline.errors import ConfigError
from pipeline.preprocess import (
    FAMILY_SIZES,
    ImagePreparer,
    _fast_jpeg_rgb,
    decode_image,
    decode_prepared,
    decode_rgb,
    load_prepared,
    prepare_image,
    preprocess_dataset,
    resolve_size,
    to_rgb,
)
from pipeline.store import digest_dir, read_manifest

MAXPIX = 64_000_000


def encode(im: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def photo(w: int, h: int, seed: int = 0) -> Image.Image:
    """A smooth, photo-like RGB image (gradients + a few shapes) that JPEG compresses realistically."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    a = np.stack([xx / max(w, 1) * 255, yy / max(h, 1) * 255, (xx + yy) / max(w + h, 1) * 255], -1)
    for _ in range(4):
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(0.05, 0.3) * max(w, h)
        a[(xx - cx) ** 2 + (yy - cy) ** 2 < r * r] = rng.uniform(0, 255, 3)
    return Image.fromarray(a.clip(0, 255).astype(np.uint8))


@pytest.mark.parametrize("size", [32, 448])
@pytest.mark.parametrize("w,h", [(37, 400), (1000, 20), (640, 480), (1, 1), (8, 8)])
def test_longest_side_and_aspect_within_one_pixel(w, h, size):
    data = encode(photo(w, h))
    out = prepare_image(data, PreprocessConfig(pad="none"), size=size, max_pixels=MAXPIX)
    oh, ow = out.shape[:2]
    assert out.dtype == np.uint8 and out.shape[2] == 3
    assert max(ow, oh) == size
    scale = size / max(w, h)
    assert abs(ow - w * scale) <= 1 and abs(oh - h * scale) <= 1

    padded, (x, y, bw, bh) = ImagePreparer(
        PreprocessConfig(pad="square", pad_color=(255, 0, 255)), size=size, max_pixels=MAXPIX
    )(data)
    assert padded.shape == (size, size, 3)
    assert (bw, bh) == (ow, oh)
    np.testing.assert_array_equal(padded[y:y + bh, x:x + bw], out)
    mask = np.ones((size, size), bool)
    mask[y:y + bh, x:x + bw] = False
    assert (padded[mask] == (255, 0, 255)).all()


def test_downscale_is_antialiased_and_upscale_smooth():
    # One-pixel stripes shrunk 4×: area averaging gives flat grey; a point sampler would alias into stripes.
    stripes = np.zeros((64, 64, 3), np.uint8)
    stripes[:, ::2] = 255
    out = prepare_image(encode(Image.fromarray(stripes)), PreprocessConfig(), size=16, max_pixels=MAXPIX)
    assert out.std() < 2 and abs(out.mean() - 127.5) < 2
    # A 2×2 checker upscaled: cubic produces intermediate values (nearest would keep only 0 and 255).
    tiny = np.array([[[0] * 3, [255] * 3], [[255] * 3, [0] * 3]], np.uint8)
    up = prepare_image(encode(Image.fromarray(tiny)), PreprocessConfig(), size=32, max_pixels=MAXPIX)
    assert up.shape == (32, 32, 3) and len(np.unique(up)) > 10


def _mode_zoo() -> dict[str, tuple[bytes, tuple[int, int, int]]]:
    """Encoded images in awkward modes, each with the RGB its centre pixel must come out as (white background)."""
    zoo = {}
    rgba = Image.new("RGBA", (20, 10), (255, 0, 0, 128))
    zoo["RGBA"] = (encode(rgba), (255, 127, 127))
    zoo["LA"] = (encode(Image.new("LA", (20, 10), (0, 0))), (255, 255, 255))
    p = Image.new("P", (20, 10), 1)
    p.putpalette([0, 0, 0, 0, 255, 0] + [0] * 762)
    zoo["P"] = (encode(p), (0, 255, 0))
    pt = p.copy()
    pt.info["transparency"] = 1
    zoo["P+transparency"] = (encode(pt, transparency=1), (255, 255, 255))
    zoo["1"] = (encode(Image.new("1", (20, 10), 1)), (255, 255, 255))
    zoo["CMYK"] = (encode(Image.new("CMYK", (20, 10), (0, 255, 255, 0)), "JPEG", quality=100), (255, 0, 0))
    zoo["I;16"] = (encode(Image.fromarray(np.full((10, 20), 32768, np.uint16))), (128, 128, 128))
    i32 = Image.fromarray(np.tile(np.array([[-1000, 3000]], np.int32), (10, 10)), mode="I")
    zoo["I(wide range)"] = (encode(i32, "TIFF"), (255, 255, 255))
    f = Image.fromarray(np.full((10, 20), 0.25, np.float32), mode="F")
    zoo["F"] = (encode(f, "TIFF"), (64, 64, 64))
    zoo["L"] = (encode(Image.new("L", (20, 10), 200), "JPEG", quality=100), (200, 200, 200))
    return zoo


@pytest.mark.parametrize("name", list(_mode_zoo()))
def test_every_mode_becomes_correct_rgb(name):
    data, expected = _mode_zoo()[name]
    img = open_image(data, max_pixels=MAXPIX)
    rgb = to_rgb(img, (255, 255, 255))
    assert rgb.dtype == np.uint8 and rgb.shape == (img.height, img.width, 3)
    np.testing.assert_allclose(rgb[5, 11 if name.startswith("I(") else 10], expected, atol=3)
    out = prepare_image(data, PreprocessConfig(pad="square"), size=24, max_pixels=MAXPIX)
    assert out.shape == (24, 24, 3)


def test_alpha_uses_configured_background():
    data = encode(Image.new("RGBA", (4, 4), (0, 0, 0, 0)))
    out = prepare_image(data, PreprocessConfig(background=(10, 20, 30)), size=4, max_pixels=MAXPIX)
    assert (out == (10, 20, 30)).all()


def test_sixteen_bit_scaled_by_full_range():
    a = np.array([[0, 257, 65535, 32896]], np.uint16)
    rgb = to_rgb(Image.fromarray(a))
    assert rgb[0, :, 0].tolist() == [0, 1, 255, 128]


def test_exif_rotation_applied_before_resize():
    im = photo(40, 20)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise on display
    out = prepare_image(encode(im, "JPEG", exif=exif), PreprocessConfig(), size=20, max_pixels=MAXPIX)
    assert out.shape == (20, 10, 3)


def test_reduced_jpeg_decode_keeps_size_and_matches_full_decode():
    data = encode(photo(1024, 768, seed=3), "JPEG", quality=90)
    fast = decode_image(data, max_pixels=MAXPIX, longest=448)
    assert fast.size == (512, 384)  # ½ scale: the largest power of two still ≥ 448
    assert decode_image(data, max_pixels=MAXPIX, longest=600).size == (1024, 768)  # ½ would be < 600
    full = cv2.resize(to_rgb(open_image(data, max_pixels=MAXPIX)), (448, 336), interpolation=cv2.INTER_AREA)
    out = prepare_image(data, PreprocessConfig(), size=448, max_pixels=MAXPIX)
    assert out.shape == full.shape
    assert np.abs(out.astype(int) - full.astype(int)).mean() < 2.0


@pytest.mark.parametrize("orientation", range(1, 9))
def test_opencv_jpeg_path_matches_pil_for_every_exif_orientation(orientation):
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(photo(96, 40, seed=orientation), "JPEG", quality=95, exif=exif)
    reference = to_rgb(open_image(data, max_pixels=MAXPIX))  # PIL: full decode + exif_transpose
    fast = _fast_jpeg_rgb(data, max_pixels=MAXPIX, longest=96)
    assert fast is not None and fast.shape == reference.shape
    assert np.abs(fast.astype(int) - reference.astype(int)).max() <= 1
    reduced = decode_rgb(data, max_pixels=MAXPIX, longest=24)  # ¼-scale decode, still ≥ 24
    drafted = to_rgb(decode_image(data, max_pixels=MAXPIX, longest=24))
    assert reduced.shape == drafted.shape and max(reduced.shape[:2]) == 24
    assert np.abs(reduced.astype(int) - drafted.astype(int)).mean() < 1


def test_truncated_or_huge_jpeg_never_takes_the_opencv_path():
    data = encode(photo(64, 48), "JPEG")
    assert _fast_jpeg_rgb(data[:-100], max_pixels=MAXPIX, longest=32) is None
    assert _fast_jpeg_rgb(data, max_pixels=100, longest=32) is None
    with pytest.raises(ImageRejected, match="truncated"):
        decode_rgb(data[:-100], max_pixels=MAXPIX, longest=32)


def test_resolve_size():
    assert resolve_size(PreprocessConfig(size=96), ModelConfig(family="qwen2_vl")) == 96
    for fam, size in FAMILY_SIZES.items():
        assert resolve_size(PreprocessConfig(), ModelConfig(family=fam)) == size
    assert FAMILY_SIZES["qwen2_vl"] % 28 == 0 and FAMILY_SIZES["idefics3"] % 16 == 0
    with pytest.raises(ConfigError, match="preprocess.size"):
        resolve_size(PreprocessConfig(), ModelConfig(name_or_path="/nonexistent/model"))


def test_preprocess_dataset_quarantines_bad_rows_and_leaves_input_untouched(tmp_path, image_dataset):
    good = [photo(30 + 7 * i, 20 + 5 * i, seed=i) for i in range(5)]
    truncated = encode(photo(50, 40), "JPEG")[:200]
    zoo = [data for data, _ in _mode_zoo().values()]
    ds = image_dataset([*good, b"not an image", truncated, *zoo])
    src = tmp_path / "ingested"
    ds.save_to_disk(str(src))
    before = digest_dir(src)

    m = preprocess_dataset(datasets.load_from_disk(str(src)), PreprocessConfig(size=16, pad="square"),
                           tmp_path / "prep", size=16, max_pixels=MAXPIX, inputs={"dataset": before})
    assert digest_dir(src) == before  # no map cache files written beside the input
    assert m.info == {"rows": len(good) + len(zoo), "quarantined": 2, "size": 16}
    quarantine = [json.loads(line) for line in (tmp_path / "prep" / "quarantine.jsonl").read_text().splitlines()]
    assert {q["sample_id"] for q in quarantine} == {ds[5]["sample_id"], ds[6]["sample_id"]}
    assert all(q["reason"] and q["source"].startswith("test:") for q in quarantine)
    assert "not a decodable image" in quarantine[0]["reason"]

    out = load_prepared(tmp_path / "prep")
    assert "prep_error" not in out.column_names
    assert len(out) == len(good) + len(zoo)
    for row in out:
        img = decode_prepared(row["prepared"])
        assert img.shape == (16, 16, 3) == (row["prep_height"], row["prep_width"], 3)
    assert read_manifest(tmp_path / "prep").inputs == {"dataset": before}
    assert not list((tmp_path / "prep").glob(".work-*"))


def test_preprocess_same_bytes_with_two_processes(tmp_path, image_dataset):
    ds = image_dataset([photo(60, 40, seed=i) for i in range(6)])
    cfg1, cfg2 = PreprocessConfig(size=24), PreprocessConfig(size=24, num_proc=2)
    preprocess_dataset(ds, cfg1, tmp_path / "a", size=24, max_pixels=MAXPIX)
    preprocess_dataset(ds, cfg2, tmp_path / "b", size=24, max_pixels=MAXPIX)
    a, b = load_prepared(tmp_path / "a"), load_prepared(tmp_path / "b")
    assert a["sample_id"][:] == b["sample_id"][:]
    assert a["prepared"][:] == b["prepared"][:]


def test_ingested_bad_mode_images_go_through_preprocessing(tmp_path):
    from pipeline.config import parse_config
    from pipeline.data.ingest import ingest, load_ingested

    root = tmp_path / "src"
    root.mkdir()
    exif = Image.Exif()
    exif[0x0112] = 6
    palette = Image.new("P", (7, 7), 3)
    palette.putpalette([i % 256 for i in range(768)])
    files = {  # the modes of the ingestion tests' bad-image zoo that ingestion accepts
        "wrong_ext.jpg": encode(Image.new("L", (5, 5), 77)),
        "cmyk.jpg": encode(Image.new("CMYK", (6, 6), (10, 20, 30, 40)), "JPEG"),
        "16bit.png": encode(Image.new("I;16", (5, 4), 40000)),
        "palette.png": encode(palette),
        "rgba.png": encode(Image.new("RGBA", (3, 3), (1, 2, 3, 128))),
        "rotated.jpg": encode(Image.new("RGB", (40, 20), (200, 10, 10)), "JPEG", exif=exif.tobytes()),
    }
    for name, data in files.items():
        (root / name).write_bytes(data)
    (root / "m.jsonl").write_text("".join(json.dumps({"image": n, "answer": n}) + "\n" for n in files))
    cfg = parse_config({"data": {"sources": [{"kind": "jsonl", "path": str(root / "m.jsonl")}]},
                        "paths": {"artifacts": str(tmp_path / "art")}})
    ingest(cfg.data, cfg.artifacts, tmp_path / "ingest")
    ds = load_ingested(tmp_path / "ingest")
    assert set(ds["mode"][:]) == {"L", "CMYK", "I;16", "P", "RGBA", "RGB"}

    m = preprocess_dataset(ds, PreprocessConfig(), tmp_path / "prep", size=20, max_pixels=MAXPIX)
    assert m.info["quarantined"] == 0
    rows = {r["answer"]: r for r in load_prepared(tmp_path / "prep")}
    assert set(rows) == set(files)
    assert (rows["rotated.jpg"]["prep_width"], rows["rotated.jpg"]["prep_height"]) == (10, 20)
    np.testing.assert_allclose(decode_prepared(rows["16bit.png"]["prepared"])[0, 0], [156] * 3, atol=1)
    np.testing.assert_allclose(decode_prepared(rows["rgba.png"]["prepared"])[0, 0], [128, 128, 129], atol=2)
