"""Aspect-preserving image preparation: decode → RGB → longest side = N (albumentations) → optional square pad.

The prepared image is what every later stage sees (quality, augmentation, training, scoring, export), so the model's
processor gets an image it never has to stretch. Decoding dominates the cost, so large JPEGs are decoded at a reduced
DCT scale (a power of two that still leaves the longest side ≥ N) before the area resize.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np
from PIL import Image, ImageOps

from pipeline.codeversion import stage_version
from pipeline.config import ModelConfig, PreprocessConfig
from pipeline.data.images import ImageRejected, open_image
from pipeline.data.shards import dataset_shards, link_datasets
from pipeline.errors import ArtifactError, ConfigError, DataError
from pipeline.store import (
    Manifest,
    atomic_dir,
    atomic_write_json,
    atomic_write_jsonl,
    find_valid_manifest,
    load_stage_dataset,
    read_jsonl,
    reuse_or_compute,
    save_dataset,
    stage_dataset,
    stage_key,
    stage_ref,
    write_manifest,
)

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

STAGE = "preprocess"
# Bump when prepared pixels change for the same inputs (Prefect cannot see edits in pipeline/).
PREPROCESS_VERSION = stage_version("1", "pipeline.preprocess")

# Longest side per model family when preprocess.size is not set: a multiple of the family's patch grid, so its
# processor neither stretches nor crops. Idefics3/SmolVLM: SigLIP 512-px tiles; Qwen2(.5)-VL: 14-px patches merged
# 2×2 → 28-px units, 448 = 16 × 28.
FAMILY_SIZES: dict[str, int] = {"idefics3": 512, "qwen2_vl": 448, "qwen2_5_vl": 448}

_ALPHA_MODES = {"RGBA", "LA", "PA", "RGBa", "La"}
_JPEG_MAGIC = b"\xff\xd8\xff"


def resolve_size(pre: PreprocessConfig, model: ModelConfig) -> int:
    """preprocess.size if set, else the model family's default (detected from the checkpoint when not configured)."""
    if pre.size is not None:
        return pre.size
    family = model.family
    if family in (None, "auto"):  # auto: a registered family when the checkpoint has one
        from pipeline.model.families import detect_family

        try:
            family = detect_family(model.name_or_path)
        except Exception as exc:  # noqa: BLE001 - any detection failure has the same fix
            raise ConfigError(
                f"preprocess.size is not set and the model family of {model.name_or_path!r} cannot be detected "
                f"({exc}); set preprocess.size (e.g. 448) or model.family ({', '.join(FAMILY_SIZES)})"
            ) from None
    if family not in FAMILY_SIZES:
        from pipeline.model.families import FAMILIES

        if family in FAMILIES:  # families added since: their own default size
            return FAMILIES[family].default_image_size
        raise ConfigError(f"model.family {family!r} has no default preprocess.size; set preprocess.size explicitly")
    return FAMILY_SIZES[family]


# ------------------------------------------------------------------------------------------------ colour
def _high_depth_to_uint8(a: np.ndarray, mode: str) -> np.ndarray:
    """16/32-bit grey → 8 bit.

    I;16*: divide by the format's full range (65535), so brightness means the same in every image of a dataset (a
    dark exposure stays dark instead of being stretched). I (32-bit int) has no declared range: values within
    0..65535 are 16-bit data in a wider container (older Pillow opened 16-bit PNGs as I) and scale the same way;
    anything else is stretched over its actual min..max. F: 0..1 → ×255, else min..max.
    """
    a = np.nan_to_num(a.astype(np.float64))
    lo, hi = float(a.min()), float(a.max())
    if mode.startswith("I;16") or (mode == "I" and lo >= 0 and hi <= 65535):
        a = a / 65535.0 * 255.0
    elif mode == "F" and lo >= 0 and hi <= 1:
        a = a * 255.0
    else:
        a = (a - lo) / (hi - lo) * 255.0 if hi > lo else np.zeros_like(a)
    return np.rint(a).clip(0, 255).astype(np.uint8)


def to_rgb(img: Image.Image, background: tuple[int, int, int] = (255, 255, 255)) -> np.ndarray:
    """Any PIL mode → uint8 H×W×3 RGB: alpha composited on `background`, 16-bit scaled, CMYK/palette/1-bit converted."""
    mode = img.mode
    if mode.startswith("I;16") or mode in ("I", "F"):
        grey = _high_depth_to_uint8(np.asarray(img), mode)
        return np.repeat(grey[..., None], 3, axis=2)
    try:
        if mode in _ALPHA_MODES or "transparency" in img.info:
            rgba = np.asarray(img.convert("RGBA"), dtype=np.float32)
            alpha = rgba[..., 3:] / 255.0
            out = rgba[..., :3] * alpha + np.asarray(background, np.float32) * (1.0 - alpha)
            return np.rint(out).clip(0, 255).astype(np.uint8)
        rgb = img if mode == "RGB" else img.convert("RGB")
    except ValueError as exc:
        raise ImageRejected(f"cannot convert image mode {mode!r} to RGB: {exc}") from None
    return np.asarray(rgb)


# ------------------------------------------------------------------------------------------------ decoding
def decode_image(data: bytes, *, max_pixels: int, longest: int | None = None) -> Image.Image:
    """Decode + EXIF-transpose. With `longest`, a JPEG is decoded at the largest power-of-two reduction (PIL `draft`)
    whose longest side is still ≥ `longest`; the pixel guard and error reasons are those of `open_image`."""
    if longest and data[:3] == _JPEG_MAGIC:
        try:
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if 0 < w * h <= max_pixels:
                k = longest / max(w, h)
                if k < 0.5:
                    # draft keeps both sides ≥ the request, so the longest side stays ≥ `longest`.
                    img.draft(img.mode, (math.ceil(w * k), math.ceil(h * k)))
                img.load()
                return ImageOps.exif_transpose(img)
        except Exception:  # noqa: BLE001 - the full decode below gives the precise rejection reason
            pass
    return open_image(data, max_pixels=max_pixels)


_CV2_REDUCED = {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
                8: cv2.IMREAD_REDUCED_COLOR_8}


def _fast_jpeg_rgb(data: bytes, *, max_pixels: int, longest: int) -> np.ndarray | None:
    """Plain RGB/grey JPEGs through OpenCV's libjpeg-turbo at the largest DCT reduction whose longest side is still
    ≥ `longest` (EXIF orientation applied by OpenCV); None sends the image down the PIL path instead.

    Only complete files (ending in the EOI marker) take this path: OpenCV fills a truncated JPEG with grey instead
    of failing, whereas the PIL path rejects it.
    """
    if data[:3] != _JPEG_MAGIC or data.rstrip(b"\0")[-2:] != b"\xff\xd9":
        return None
    try:
        img = Image.open(io.BytesIO(data))
        w, h = img.size
        if img.mode not in ("RGB", "L") or not 0 < w * h <= max_pixels:
            return None
        r = max(k for k in _CV2_REDUCED if max(w, h) / k >= longest or k == 1)
        bgr = cv2.imdecode(np.frombuffer(data, np.uint8), _CV2_REDUCED[r])
    except Exception:  # noqa: BLE001 - the PIL path gives the precise rejection reason
        return None
    return None if bgr is None else cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def decode_rgb(data: bytes, *, max_pixels: int, longest: int | None = None,
               background: tuple[int, int, int] = (255, 255, 255)) -> np.ndarray:
    """Encoded bytes → uint8 H×W×3 RGB, EXIF-transposed, decoded no larger than needed for a longest side `longest`."""
    fast = _fast_jpeg_rgb(data, max_pixels=max_pixels, longest=longest) if longest else None
    if fast is not None:
        return fast
    return to_rgb(decode_image(data, max_pixels=max_pixels, longest=longest), background)


def encode_png(rgb: np.ndarray) -> bytes:
    ok, buf = cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    if not ok:
        raise DataError(f"PNG encoding failed for an image of shape {rgb.shape}")
    return buf.tobytes()


def decode_prepared(png: bytes) -> np.ndarray:
    """A `prepared` PNG → uint8 H×W×3 RGB."""
    bgr = cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_COLOR)
    if bgr is None:
        raise DataError(f"prepared image is not a decodable PNG ({len(png)} bytes); rebuild the prepare stage")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


# ------------------------------------------------------------------------------------------------ resizing
class ImagePreparer:
    """Encoded bytes → prepared RGB array and the content box (x, y, w, h) inside it (the rest is padding)."""

    def __init__(self, cfg: PreprocessConfig, *, size: int, max_pixels: int):
        # Imported here: albumentations pulls in torch (~10 s on a loaded 2-core machine), which a round whose stages
        # all come from the cache never needs (flows import this module for load_prepared and the stage wrappers).
        import albumentations as A

        self.size, self.max_pixels, self.background = size, max_pixels, tuple(cfg.background)
        # Shrinking ≥ 2×: area averaging (antialiased). Shrinking < 2× (what is left after a reduced JPEG decode):
        # bilinear weights already reach every source pixel, so it matches area within rounding at a quarter of
        # the cost. Enlarging tiny images: cubic keeps them smooth.
        self._area = A.LongestMaxSize(max_size=size, interpolation=cv2.INTER_AREA, p=1.0)
        self._linear = A.LongestMaxSize(max_size=size, interpolation=cv2.INTER_LINEAR, p=1.0)
        self._cubic = A.LongestMaxSize(max_size=size, interpolation=cv2.INTER_CUBIC, p=1.0)
        self._pad = (
            A.PadIfNeeded(min_height=size, min_width=size, position="center", border_mode=cv2.BORDER_CONSTANT,
                          fill=tuple(cfg.pad_color), p=1.0)
            if cfg.pad == "square" else None
        )

    def __call__(self, data: bytes) -> tuple[np.ndarray, tuple[int, int, int, int]]:
        rgb = np.ascontiguousarray(decode_rgb(data, max_pixels=self.max_pixels, longest=self.size,
                                              background=self.background))
        factor = max(rgb.shape[:2]) / self.size
        resize = self._area if factor >= 2 else self._linear if factor > 1 else self._cubic
        rgb = resize(image=rgb)["image"]
        h, w = rgb.shape[:2]
        if self._pad is None:
            return rgb, (0, 0, w, h)
        # PadIfNeeded(center) puts the odd pixel at the bottom/right: the content starts at floor(pad / 2).
        return self._pad(image=rgb)["image"], ((self.size - w) // 2, (self.size - h) // 2, w, h)


def prepare_image(data: bytes, cfg: PreprocessConfig, *, size: int, max_pixels: int) -> np.ndarray:
    """One encoded image → prepared uint8 H×W×3 (longest side `size`, aspect kept, optionally padded square)."""
    return ImagePreparer(cfg, size=size, max_pixels=max_pixels)(data)[0]


# ------------------------------------------------------------------------------------------------ dataset
def prepared_features(base: datasets.Features) -> datasets.Features:
    from datasets import Features, List, Value

    more = more_prepared_features() if "more_images" in base else {}
    return Features({
        **base, "prepared": Value("binary"), "prep_width": Value("int32"), "prep_height": Value("int32"),
        "prep_box": List(Value("int32")), "prep_error": Value("string"), **more,
    })


# A sample's 2nd..Nth pictures (pipeline/schema.py `more_images`, a conversation source's), each prepared as the first.
MORE_PREPARED = ("more_prepared", "more_prep_width", "more_prep_height", "more_prep_box", "more_prep_error")


def more_prepared_features() -> dict[str, Any]:
    from datasets import List, Value

    i = Value("int32")
    return {"more_prepared": List(Value("binary")), "more_prep_width": List(i), "more_prep_height": List(i),
            "more_prep_box": List(List(i)), "more_prep_error": List(Value("string"))}


def prepare_more_batch(batch: dict[str, list[Any]], *, cfg: PreprocessConfig, size: int,
                       max_pixels: int) -> dict[str, list[Any]]:
    """The MORE_PREPARED columns of a batch of ingested rows (each a list, one entry per image of `more_images`):
    longest side `size`, aspect kept, padded as configured, by the same ImagePreparer as the first image; a picture
    that fails keeps its reason in `more_prep_error` (the row is quarantined naming which picture)."""
    prep = ImagePreparer(cfg, size=size, max_pixels=max_pixels)
    out: dict[str, list[Any]] = {k: [] for k in MORE_PREPARED}
    for more in batch["more_images"]:
        row: dict[str, list[Any]] = {k: [] for k in MORE_PREPARED}
        for m in more or []:
            try:
                rgb, box = prep(m["image"])
                png, err = encode_png(rgb), ""
            except (DataError, ValueError, OSError, cv2.error) as exc:
                rgb, box, png = np.zeros((0, 0, 3), np.uint8), (0, 0, 0, 0), None
                err = getattr(exc, "reason", None) or f"{exc.__class__.__name__}: {exc}"
            for k, v in zip(MORE_PREPARED, (png, rgb.shape[1], rgb.shape[0], list(box), err), strict=True):
                row[k].append(v)
        for k in MORE_PREPARED:
            out[k].append(row[k])
    return out


def _row_error(first: str, more: list[str] | None) -> str:
    """The reason a row is quarantined: its first picture's, else the first later picture's that failed (named)."""
    if first or not more:
        return first
    bad = next(((i, e) for i, e in enumerate(more, 2) if e), None)
    return "" if bad is None else f"image {bad[0]} of {len(more) + 1}: {bad[1]}"


def _prepare_batch(batch: dict[str, list[Any]], *, cfg: dict[str, Any], size: int, max_pixels: int) -> dict:
    # Plain dicts in, so `datasets` can fingerprint the call and worker processes rebuild the transforms themselves.
    prep = ImagePreparer(PreprocessConfig(**cfg), size=size, max_pixels=max_pixels)
    out: dict[str, list[Any]] = {k: [] for k in ("prepared", "prep_width", "prep_height", "prep_box", "prep_error")}
    for data in batch["image"]:
        try:
            rgb, box = prep(data)
            png, err = encode_png(rgb), ""
        except (DataError, ValueError, OSError, cv2.error) as exc:
            rgb, box, png = np.zeros((0, 0, 3), np.uint8), (0, 0, 0, 0), None
            err = exc.reason if isinstance(exc, ImageRejected) else f"{exc.__class__.__name__}: {exc}"
        out["prepared"].append(png)
        out["prep_width"].append(rgb.shape[1])
        out["prep_height"].append(rgb.shape[0])
        out["prep_box"].append(list(box))
        out["prep_error"].append(err)
    if "more_images" in batch:
        out.update(prepare_more_batch(batch, cfg=PreprocessConfig(**cfg), size=size, max_pixels=max_pixels))
        out["prep_error"] = [_row_error(e, m) for e, m in zip(out["prep_error"], out["more_prep_error"], strict=True)]
    return out


def preprocess_dataset(
    ds: datasets.Dataset,
    cfg: PreprocessConfig,
    out_dir: str | os.PathLike[str],
    *,
    size: int,
    max_pixels: int,
    inputs: Mapping[str, str] | None = None,
) -> Manifest:
    """Prepare every row's `image` into `out_dir` (dataset/, quarantine.jsonl, manifest.json).

    Adds `prepared` (PNG), `prep_width`, `prep_height`, `prep_box` ([x, y, w, h] of the image inside the padding).
    A row whose image cannot be prepared goes to quarantine.jsonl with its reason, never silently away. A project
    with a conversation source (`more_images`) gets every later picture prepared the same way (MORE_PREPARED).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {**cfg.model_dump(mode="json"), "size": size, "max_pixels": max_pixels}
    if "image" not in ds.column_names:
        raise DataError(f"dataset has no 'image' column (columns: {', '.join(ds.column_names)}); pass an ingested dataset")
    # map's cache files go to a scratch folder of ours, never beside the input dataset (that would change its digest).
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".work-") as work:
        mapped = ds.map(
            _prepare_batch,
            fn_kwargs={"cfg": cfg.model_dump(mode="json"), "size": size, "max_pixels": max_pixels},
            batched=True,
            batch_size=64,
            num_proc=cfg.num_proc if cfg.num_proc > 1 and len(ds) > 1 else None,
            features=prepared_features(ds.features),
            cache_file_name=str(Path(work) / "prepared.arrow"),
            desc="preprocess",
        )
        errors = mapped["prep_error"]
        bad = [i for i, e in enumerate(errors) if e]
        quarantine = []
        if bad:
            cols = [c for c in ("sample_id", "source", "image_path") if c in mapped.column_names]
            rows = mapped.select(bad).select_columns([*cols, "prep_error"])
            quarantine = [{**{c: r[c] for c in cols}, "stage": STAGE, "reason": r["prep_error"]} for r in rows]
            log.warning("preprocess: %d of %d rows quarantined; reasons in %s", len(bad), len(ds),
                        out_dir / "quarantine.jsonl")
        bad_set = set(bad)
        kept = mapped.select([i for i in range(len(mapped)) if i not in bad_set]) if bad else mapped
        with atomic_dir(out_dir / "dataset") as tmp:
            save_dataset(kept.remove_columns([c for c in ("prep_error", "more_prep_error") if c in kept.column_names]),
                         tmp)
        del mapped, kept
    atomic_write_jsonl(out_dir / "quarantine.jsonl", quarantine)
    log.info("preprocess: %d rows prepared at %d px, %d quarantined", len(ds) - len(bad), size, len(bad))
    return write_manifest(
        out_dir, stage=STAGE, stage_version=PREPROCESS_VERSION, inputs=inputs or {}, config=config,
        outputs={"dataset": "dataset", "quarantine": "quarantine.jsonl"},
        info={"rows": len(ds) - len(bad), "quarantined": len(bad), "size": size},
    )


def load_prepared(folder: str | os.PathLike[str]) -> datasets.Dataset:
    """The prepared dataset in a preprocess stage folder, after verifying its manifest's digests."""
    return load_stage_dataset(folder, STAGE)


def _preprocess_key(artifacts: str | os.PathLike[str], dataset_digest: str, preprocess: dict[str, Any], size: int,
                    max_pixels: int) -> tuple[str, Path]:
    key = stage_key(STAGE, PREPROCESS_VERSION, {"dataset": dataset_digest},
                    {**preprocess, "size": size, "max_pixels": max_pixels})
    return key, Path(artifacts) / "prepare" / key[:16]


@dataclass(frozen=True)
class PreprocessParams:
    """The preprocess stage's parameters, built by preprocess_params; its cache key is their `asdict()`."""

    artifacts: str
    dataset: str  # the ingested dataset's folder
    dataset_digest: str
    preprocess: dict[str, Any]  # the preprocess section as JSON data
    size: int  # resolve_size: the model's image size unless the section sets one
    max_pixels: int  # data.max_image_pixels

    def key(self) -> tuple[str, Path]:
        return _preprocess_key(self.artifacts, self.dataset_digest, self.preprocess, self.size, self.max_pixels)


def preprocess_cached(params: PreprocessParams) -> dict[str, Any] | None:
    """The stage's ref when its verified output is on disk, else None."""
    key, out = params.key()
    m = find_valid_manifest(out, key)
    return None if m is None else stage_ref(out, m, "dataset")


def preprocess_stage(params: PreprocessParams) -> dict[str, Any]:
    """The preprocess stage: the ingested dataset prepared into artifacts/prepare/<key>/, or the verified folder
    already there. Returns its ref {"dir", "digest", "info"}."""
    import datasets

    inputs = {"dataset": params.dataset_digest}
    key, out = params.key()
    cfg, size, max_pixels = PreprocessConfig(**params.preprocess), params.size, params.max_pixels
    shards = dataset_shards(params.dataset)
    if shards is None:  # a dataset not made of ingest shards: prepared whole
        m = reuse_or_compute(out, key, lambda: preprocess_dataset(
            datasets.load_from_disk(params.dataset), cfg, out, size=size, max_pixels=max_pixels, inputs=inputs))
    else:
        m = reuse_or_compute(out, key, lambda: _preprocess_shards(
            params.artifacts, params.dataset, shards, cfg, out, size=size, max_pixels=max_pixels, inputs=inputs))
    return stage_ref(out, m, "dataset")


def _preprocess_shards(artifacts: str | os.PathLike[str], dataset: str, shards: list[tuple[str, Path, str]],
                       cfg: PreprocessConfig, out_dir: Path, *, size: int, max_pixels: int,
                       inputs: Mapping[str, str]) -> Manifest:
    """Prepare an ingested dataset shard by shard: each shard's prepared rows are keyed by that shard's content (and
    the settings), so adding images to a pool prepares only the new shards (`shards.json` in the stage folder says
    which were prepared and which re-used). The stage's dataset links the prepared shards in the ingest's order
    (pipeline/data/shards.py), so it holds the rows a whole-dataset run gives, in the same order."""
    import datasets

    config = {**cfg.model_dump(mode="json"), "size": size, "max_pixels": max_pixels}
    parts, quarantine, rows, ran, listing = [], [], 0, [], []
    for _, folder, digest in shards:
        shard_inputs = {"dataset": digest}
        # preprocess_dataset's manifest is keyed as the stage's; the shard differs only in where it lives.
        key = stage_key(STAGE, PREPROCESS_VERSION, shard_inputs, config)
        shard_out = Path(artifacts) / "prepare" / "shards" / key[:16]

        def compute(folder: Path = folder, shard_out: Path = shard_out,
                    shard_inputs: dict[str, str] = shard_inputs) -> Manifest:
            ran.append(shard_out.name)
            return preprocess_dataset(datasets.load_from_disk(str(folder)), cfg, shard_out, size=size,
                                      max_pixels=max_pixels, inputs=shard_inputs)

        sm = reuse_or_compute(shard_out, key, compute)
        rows += sm.info["rows"]
        quarantine += read_jsonl(shard_out / "quarantine.jsonl")
        listing.append({"key": sm.key, "dir": str(shard_out), "rows": sm.info["rows"],
                        "prepared": shard_out.name in ran})
        if sm.info["rows"]:
            parts.append((shard_out.name, shard_out / sm.outputs["dataset"].path))
    log.info("preprocess: %d of %d shards prepared, %d re-used", len(ran), len(shards), len(shards) - len(ran))

    def empty(tmp: Path) -> None:
        feats = prepared_features(datasets.load_from_disk(dataset).features)
        errors = [c for c in ("prep_error", "more_prep_error") if c in feats]
        datasets.Dataset.from_dict({c: [] for c in feats}, features=feats).remove_columns(errors).save_to_disk(
            str(tmp), num_shards=1)

    out_dir.mkdir(parents=True, exist_ok=True)
    link_datasets(parts, out_dir / "dataset", empty)
    atomic_write_jsonl(out_dir / "quarantine.jsonl", quarantine)
    atomic_write_json(out_dir / "shards.json", listing)
    return write_manifest(
        out_dir, stage=STAGE, stage_version=PREPROCESS_VERSION, inputs=inputs, config=config,
        outputs={"dataset": "dataset", "quarantine": "quarantine.jsonl", "shards": "shards.json"},
        info={"rows": rows, "quarantined": len(quarantine), "size": size, "shards": len(shards),
              "shards_prepared": len(ran)},
    )


LATEST = "latest.json"  # artifacts/prepare/latest.json: the refs of the last prepare run


def record_latest(artifacts: str | os.PathLike[str], refs: dict[str, Any]) -> None:
    """Keep the refs of the last prepare run: what `tamis quality report` and later commands read without a flow."""
    atomic_write_json(Path(artifacts) / "prepare" / LATEST, refs)


def latest_refs(artifacts: str | os.PathLike[str]) -> dict[str, Any]:
    """The refs the last `prepare` run of this project wrote; a clear error if there was none."""
    path = Path(artifacts) / "prepare" / LATEST
    if not path.is_file():
        raise ArtifactError(f"{path}: no prepared data yet; run `tamis prepare --config <your config>` first")
    return json.loads(path.read_text(encoding="utf-8"))


def preprocess_params(artifacts: str | os.PathLike[str], ingest_ref: dict[str, Any], preprocess: PreprocessConfig,
                      model: ModelConfig, max_pixels: int) -> PreprocessParams:
    """The preprocess stage's parameters (its cache key) for an ingested dataset's ref."""
    dataset, digest = stage_dataset(ingest_ref)
    return PreprocessParams(artifacts=str(artifacts), dataset=dataset, dataset_digest=digest,
                            preprocess=preprocess.model_dump(mode="json"), size=resolve_size(preprocess, model),
                            max_pixels=max_pixels)
