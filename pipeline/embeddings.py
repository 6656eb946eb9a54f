"""Selection embeddings: the space diversity, coverage and outlier selection work in, independent of the adapter.

Every source but `file` is an `Embedder`: fitted on the pool split's images only (never an answer, never a test or
train image), then used to embed every row. `pixels` is downsampled pixels → standardized → whitened PCA; `pool` a
small SimCLR encoder trained on the pool; `vision_tower` the frozen vision encoder of the configured base model (no
fitting). `file` embeddings are read, not fitted. Rows come out float32 [n, d], L2-normalized (file: as given).

`compute_selection_embeddings` is the stage: embeddings.npy + ids.json + manifest, keyed by `embeddings_key`.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from pipeline.codeversion import stage_version
from pipeline.config import EmbeddingsConfig, ModelConfig, PoolEncoderConfig, ProjectConfig, SelectConfig
from pipeline.errors import ArtifactError, ConfigError, DataError
from pipeline.preprocess import decode_prepared
from pipeline.store import (
    Manifest,
    atomic_write_bytes,
    atomic_write_json,
    column,
    digest_file,
    digest_json,
    read_manifest,
    reuse_or_compute,
    stage_key,
    write_manifest,
)

if TYPE_CHECKING:
    import albumentations as A
    import datasets
    import torch

log = logging.getLogger(__name__)

STAGE = "embeddings"
# Bump when the vectors change for the same inputs and config.
EMBEDDINGS_VERSION = stage_version("1", "pipeline.embeddings")
EMBEDDINGS_FILE = "embeddings.npy"
IDS_FILE = "ids.json"
CHUNK = 256  # rows decoded at a time: prepared images can be large, so the pool is never decoded all at once


# ------------------------------------------------------------------------------------------------ helpers
def l2_normalize(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def square_resize(rgb: np.ndarray, side: int) -> np.ndarray:
    """uint8 H×W×3 → side×side×3: longest side scaled to `side` (aspect kept), centred on black padding."""
    import cv2

    h, w = rgb.shape[:2]
    if h < 1 or w < 1:
        raise DataError(f"cannot embed an empty image of shape {rgb.shape}")
    k = side / max(h, w)
    nh, nw = max(1, round(h * k)), max(1, round(w * k))
    if (nh, nw) != (h, w):
        rgb = cv2.resize(rgb, (nw, nh), interpolation=cv2.INTER_AREA if k < 1 else cv2.INTER_LINEAR)
    out = np.zeros((side, side, 3), np.uint8)
    y, x = (side - nh) // 2, (side - nw) // 2
    out[y:y + nh, x:x + nw] = rgb
    return out


class Embedder:
    """Fit on pool images (uint8 RGB H×W×3), then `embed` any images → float32 [n, d], L2-normalized rows."""

    # Whether `fit` learns anything (the stage decodes the pool for it only then), and at most how many pool images
    # it reads (the stage draws a seeded sample; None reads them all).
    needs_fit: ClassVar[bool] = True
    max_fit_images: int | None = None

    @classmethod
    def from_config(cls, cfg: ProjectConfig) -> Embedder:
        raise NotImplementedError

    def fit(self, images: Iterable[np.ndarray]) -> Embedder:
        """Learn from the pool's images (read once, in order). Embedders with nothing to learn keep this no-op."""
        return self

    def embed(self, images: Sequence[np.ndarray]) -> np.ndarray:
        raise NotImplementedError


# ------------------------------------------------------------------------------------------------ pixels
class PixelsEmbedder(Embedder):
    """Pixels at `side`² (grey + RGB, in [0, 1]) → standardized → PCA with whitening to `dim` (numpy SVD)."""

    # The PCA is fitted on a seeded sample of this many pool images: 32 components of 1,024 pixel features are
    # estimated as well from 20k rows as from all, and fitting on a 100k pool held 100k x 1,024 float64 three times
    # over (features, centred copy, SVD factor): ~2.5 GB, 25 GB at 10^6.
    max_fit_images: int | None = 20_000

    def __init__(self, side: int = 16, dim: int = 32):
        self.side, self.dim = side, dim
        self.mean: np.ndarray | None = None
        self.std: np.ndarray | None = None
        self.components: np.ndarray | None = None  # [k, p]
        self.scale: np.ndarray | None = None  # [k] standard deviation along each component

    @classmethod
    def from_config(cls, cfg: ProjectConfig) -> PixelsEmbedder:
        e = cfg.select.embeddings
        return cls(side=e.pixels_side, dim=e.pca_dim)

    def features(self, images: Iterable[np.ndarray]) -> np.ndarray:
        rows = []
        for rgb in images:
            sq = square_resize(rgb, self.side).astype(np.float32) / 255.0
            grey = sq @ np.array([0.299, 0.587, 0.114], np.float32)
            rows.append(np.concatenate([grey.ravel(), sq.ravel()]))
        return np.stack(rows) if rows else np.zeros((0, 4 * self.side**2), np.float32)

    def fit(self, images: Iterable[np.ndarray]) -> PixelsEmbedder:
        x = self.features(images).astype(np.float64)
        if len(x) < 2:
            raise DataError(f"pixels embeddings need at least 2 pool images to fit a PCA; got {len(x)}")
        self.mean = x.mean(0)
        std = x.std(0)
        self.std = np.where(std > 1e-6, std, 1.0)  # constant pixels (padding) stay 0 instead of blowing up
        _, s, vt = np.linalg.svd((x - self.mean) / self.std, full_matrices=False)
        # Whitening divides by each component's spread: components with (numerically) none would be pure noise.
        k = min(self.dim, int((s > s[0] * 1e-6).sum()) if s[0] > 0 else 1)
        if k < self.dim:
            log.info("embeddings: pixels PCA keeps %d of %d components (rank of %d fit images)", k, self.dim, len(x))
        self.components = vt[:k]
        self.scale = np.maximum(s[:k] / math.sqrt(len(x) - 1), 1e-12)
        return self

    def embed(self, images: Sequence[np.ndarray]) -> np.ndarray:
        if self.components is None:
            raise RuntimeError("PixelsEmbedder.embed before fit")
        z = ((self.features(images) - self.mean) / self.std) @ self.components.T / self.scale
        return l2_normalize(z)


# ------------------------------------------------------------------------------------------------ pool (SimCLR)
def build_view_pipeline(side: int, seed: int) -> A.Compose:
    """Strong augmentations for contrastive views (no flips: a mirrored digit or letter means something else).

    Random resized crop (scale + translation), small rotation, brightness/contrast, greyscale, blur and noise. The
    cheap transforms carry most of the variety: albumentations' warps cost ~75 µs per call even at 32 px.
    """
    import albumentations as A
    import cv2

    return A.Compose(
        [
            A.RandomResizedCrop(size=(side, side), scale=(0.5, 1.0), ratio=(0.75, 1.33), p=1.0),
            A.Rotate(limit=15, border_mode=cv2.BORDER_CONSTANT, fill=0, p=0.3),
            A.RandomBrightnessContrast(brightness_limit=0.4, contrast_limit=0.4, p=0.8),
            A.ToGray(p=0.2),
            A.GaussianBlur(blur_limit=(3, 3), sigma_limit=(0.1, 1.5), p=0.2),
            A.GaussNoise(std_range=(0.02, 0.1), p=0.2),
        ],
        seed=seed,
    )


def make_views(views: A.Compose, batch: np.ndarray) -> np.ndarray:
    """One augmented view of every image of a uint8 [n, H, W, 3] batch, each with its own random parameters."""
    return np.stack([views(image=im)["image"] for im in batch])


# Conv widths before the last block (which outputs `dim`), each block halving the resolution. Measured on the 1,346
# pool digits of the demo at 32 px, default config, 1 torch thread on a shared 2-core CPU, augmenting in the same
# thread: 16-32-64 fits in ~20 s, 24-48-96 in ~30 s (~24 s with augmentation in its own thread, as below), 32-64-128
# in ~36 s; logistic regression on 100 labelled pool digits → 93.7 / 94.7 / 94.9 % on the 451 test digits (whitened
# pixel PCA: 83.5 %).
ENCODER_WIDTHS = (24, 48, 96)


def build_encoder(dim: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(encoder, projection head): 4 conv-BN-ReLU blocks, each of stride 2, → global average pool → `dim` features.

    The first block already halves the resolution: at 32 px a full-resolution block costs several times the rest of
    a training step on a CPU, and upscaled small images (the 8-px digits) hold nothing a stride-1 stem would see.
    """
    from torch import nn

    layers: list[nn.Module] = []
    c_in = 3
    for c_out in (*ENCODER_WIDTHS, dim):
        layers += [nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c_out),
                   nn.ReLU(inplace=True)]
        c_in = c_out
    encoder = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
    head = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(inplace=True), nn.Linear(dim, max(2, dim // 2)))
    return encoder, head


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's normalized-temperature cross entropy: each view's positive is the other view of its image."""
    import torch
    import torch.nn.functional as F

    n = z1.shape[0]
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    sim = z @ z.T / temperature
    sim.fill_diagonal_(float("-inf"))
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(n)]).to(z.device)
    return F.cross_entropy(sim, target)


class PoolEncoderEmbedder(Embedder):
    """A small SimCLR encoder trained on the fit images only (CPU, fp32); embeddings are its pooled features.

    Deterministic for a seed in one process with the same thread count: weights, view augmentations and batch order
    are all drawn from `seed` (the global torch RNG is restored afterwards).
    """

    def __init__(self, cfg: PoolEncoderConfig | None = None, *, seed: int = 0):
        self.cfg, self.seed = cfg or PoolEncoderConfig(), seed
        self.max_fit_images = self.cfg.max_fit_images
        self.encoder: torch.nn.Module | None = None
        self.mean: np.ndarray | None = None
        self.std: np.ndarray | None = None
        self.losses: list[float] = []

    @classmethod
    def from_config(cls, cfg: ProjectConfig) -> PoolEncoderEmbedder:
        return cls(cfg.select.embeddings.encoder, seed=cfg.seed)

    def _tensor(self, batch: np.ndarray) -> torch.Tensor:
        import torch

        # NHWC memory viewed as NCHW: torch's channels_last layout, which its CPU convolutions run fastest in.
        x = (batch.astype(np.float32) / 255.0 - self.mean) / self.std
        return torch.from_numpy(np.ascontiguousarray(x)).permute(0, 3, 1, 2)

    def fit(self, images: Iterable[np.ndarray]) -> PoolEncoderEmbedder:
        import torch

        c, side = self.cfg, self.cfg.image_size
        resized = [square_resize(im, side) for im in images]
        n = len(resized)
        if n < 2:
            raise DataError(f"the pool encoder needs at least 2 pool images to contrast; got {n}")
        data = np.stack(resized)
        del resized
        t0 = time.perf_counter()
        pixels = data.reshape(-1, 3).astype(np.float32) / 255.0
        self.mean, self.std = pixels.mean(0), np.maximum(pixels.std(0), 1e-3)
        views = build_view_pipeline(side, self.seed)
        order = np.random.default_rng(self.seed)
        # Equal-sized batches (≤ batch_size): no 1-image remainder batch for BatchNorm and the loss.
        n_batches = math.ceil(n / min(c.batch_size, n))
        batches = [idx for _ in range(c.epochs) for idx in np.array_split(order.permutation(n), n_batches)]

        def two_views(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return make_views(views, data[idx]), make_views(views, data[idx])

        losses = []
        # One worker thread augments the next batch while torch trains on this one (it releases the GIL); a single
        # worker draws from the seeded pipeline in batch order, so the views stay the same run to run.
        with torch.random.fork_rng(devices=[]), ThreadPoolExecutor(max_workers=1) as worker:
            torch.manual_seed(self.seed)
            encoder, head = build_encoder(c.dim)
            encoder = encoder.to(memory_format=torch.channels_last)
            opt = torch.optim.Adam([*encoder.parameters(), *head.parameters()], lr=c.learning_rate)
            encoder.train()
            head.train()
            pending = worker.submit(two_views, batches[0])
            for k, idx in enumerate(batches):
                v1, v2 = pending.result()
                if k + 1 < len(batches):
                    pending = worker.submit(two_views, batches[k + 1])
                z = head(encoder(torch.cat([self._tensor(v1), self._tensor(v2)])))
                loss = nt_xent(z[: len(idx)], z[len(idx):], c.temperature)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
        # Mean loss per epoch.
        self.losses = [float(np.mean(losses[e:e + n_batches])) for e in range(0, len(losses), n_batches)]
        self.encoder = encoder.eval()
        log.info("embeddings: pool encoder fitted on %d images, %d epochs in %.1f s (NT-Xent %.3f → %.3f)", n,
                 c.epochs, time.perf_counter() - t0, self.losses[0], self.losses[-1])
        return self

    def embed(self, images: Sequence[np.ndarray]) -> np.ndarray:
        import torch

        if self.encoder is None:
            raise RuntimeError("PoolEncoderEmbedder.embed before fit")
        side = self.cfg.image_size
        out = []
        with torch.inference_mode():
            for i in range(0, len(images), CHUNK):
                batch = np.stack([square_resize(im, side) for im in images[i:i + CHUNK]])
                out.append(self.encoder(self._tensor(batch)).numpy())
        return l2_normalize(np.concatenate(out) if out else np.zeros((0, self.cfg.dim), np.float32))


# ------------------------------------------------------------------------------------------------ vision tower
class VisionTowerEmbedder(Embedder):
    """The frozen vision encoder of `model`: last hidden state mean-pooled over patches (and tiles). Nothing to fit;
    the model is loaded on first use."""

    needs_fit = False

    def __init__(self, model: ModelConfig, *, batch_size: int = 16):
        self.model_cfg, self.batch_size = model, batch_size
        self._loaded: Any = None

    @classmethod
    def from_config(cls, cfg: ProjectConfig) -> VisionTowerEmbedder:
        try:
            batch_size = cfg.select.score_batch_size
        except ConfigError:
            # The round's embeddings stage is keyed on select.embeddings only, so it is not given the batch size:
            # it runs the tower at the default one, as it always has (the embeddings do not depend on it).
            batch_size = SelectConfig.model_fields["score_batch_size"].default
        return cls(cfg.model, batch_size=batch_size)

    @property
    def loaded(self) -> Any:
        if self._loaded is None:
            from pipeline.model.loading import load_model

            self._loaded = load_model(self.model_cfg)
        return self._loaded

    def embed(self, images: Sequence[np.ndarray]) -> np.ndarray:
        import torch
        from PIL import Image

        ld = self.loaded
        out = []
        with torch.inference_mode():
            for i in range(0, len(images), self.batch_size):
                batch = [Image.fromarray(im) for im in images[i:i + self.batch_size]]
                out.append(ld.family.image_features(ld.model, ld.processor, batch).float().cpu().numpy())
        if not out:
            return np.zeros((0, 0), np.float32)
        return l2_normalize(np.concatenate(out))


EMBEDDERS: dict[str, type[Embedder]] = {
    "pixels": PixelsEmbedder,
    "pool": PoolEncoderEmbedder,
    "vision_tower": VisionTowerEmbedder,
}


def make_embedder(cfg: ProjectConfig) -> Embedder:
    source = cfg.select.embeddings.source
    if source not in EMBEDDERS:
        raise ConfigError(f"select.embeddings.source {source!r} has no embedder here: 'model' embeddings come from "
                          f"the scoring pass and 'file' ones are read; fitted sources: {', '.join(EMBEDDERS)}")
    return EMBEDDERS[source].from_config(cfg)


# ------------------------------------------------------------------------------------------------ file
def _read_npy(path: Path) -> tuple[list[Any], np.ndarray]:
    sidecar = path.with_name(f"{path.stem}.ids.json")
    if not sidecar.is_file():
        raise DataError(f"{path}: a .npy of embeddings needs its keys beside it in {sidecar.name} (a JSON list, one "
                        "key per row); it is missing")
    try:
        matrix = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise DataError(f"{path}: not a readable .npy array of numbers ({exc})") from None
    try:
        keys = json.loads(sidecar.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{sidecar}: not valid JSON ({exc})") from None
    if not isinstance(keys, list):
        raise DataError(f"{sidecar}: must be a JSON list of keys in row order, not {type(keys).__name__}")
    if matrix.ndim != 2 or not np.issubdtype(matrix.dtype, np.number):
        raise DataError(f"{path}: expected a 2-D numeric array [rows, dim]; got shape {matrix.shape}, dtype "
                        f"{matrix.dtype}")
    if len(keys) != len(matrix):
        raise DataError(f"{path}: {len(matrix)} rows but {sidecar.name} lists {len(keys)} keys; one key per row")
    return keys, matrix


def _read_parquet(path: Path, cfg: EmbeddingsConfig) -> tuple[list[Any], np.ndarray]:
    import pyarrow.parquet as pq

    key_col, emb_col = cfg.parquet_key_column, cfg.parquet_embedding_column
    try:
        names = pq.read_schema(path).names
        missing = [c for c in (key_col, emb_col) if c not in names]
        if missing:
            raise DataError(f"{path}: column(s) {missing} not found (columns: {names}); set "
                            "select.embeddings.parquet_key_column / parquet_embedding_column")
        table = pq.read_table(path, columns=[key_col, emb_col])
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - any pyarrow failure is the same user-facing fault
        raise DataError(f"{path}: not a readable Parquet file ({exc.__class__.__name__}: {exc})") from None
    keys = table.column(key_col).to_pylist()
    vectors = table.column(emb_col).to_pylist()
    widths = {len(v) for v in vectors if v is not None}
    width = max(widths, key=lambda w: sum(len(v) == w for v in vectors if v is not None)) if widths else 0
    for i, v in enumerate(vectors):
        if v is None or len(v) != width:
            got = "no embedding" if v is None else f"{len(v)} values"
            raise DataError(f"{path}: row {i} (key {keys[i]!r}) has {got}; most rows have {width}")
    try:
        matrix = np.asarray(vectors, dtype=np.float64).reshape(len(vectors), width)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{path}: column {emb_col!r} must hold lists of numbers ({exc})") from None
    return keys, matrix


def _path_key(key: str) -> str:
    """An image path normalized for comparison: forward slashes, no '.' parts, no leading './'."""
    return PurePosixPath(os.path.normpath(str(key).replace("\\", "/"))).as_posix()


def _match_images(keys: list[str], images: list[str], path: Path) -> tuple[list[int | None], str | None]:
    """File row per sample for image-path keys: exact, then normalized, then the longest trailing-path match
    (a manifest-relative "images/3.png" matches the ingested absolute ".../digits/images/3.png")."""
    by_norm: dict[str, int] = {}
    for r, k in enumerate(keys):
        by_norm.setdefault(_path_key(k), r)
    exact = {k: r for r, k in enumerate(keys)}
    rows: list[int | None] = []
    suffix_users: dict[int, int] = {}
    for i, image in enumerate(images):
        if image in exact:
            rows.append(exact[image])
            continue
        parts = PurePosixPath(_path_key(image)).parts if image else ()
        found, trailing = None, False
        for j in range(len(parts)):
            cand = PurePosixPath(*parts[j:]).as_posix()
            if cand in by_norm:
                found, trailing = by_norm[cand], j > 0
                break
        if found is not None and trailing:
            if found in suffix_users and images[suffix_users[found]] != image:
                other = images[suffix_users[found]]
                return rows, (f"{path}: key {keys[found]!r} (row {found}) matches two images, {other!r} and "
                              f"{image!r}; give full image paths as keys")
            suffix_users[found] = i
        rows.append(found)
    return rows, None


def load_file_embeddings(cfg: EmbeddingsConfig, ids: list[str], images: list[str] | None) -> np.ndarray:
    """Embeddings brought in a file, one row per `ids` entry (float32, as given: not normalized).

    `cfg.key` says what the file's keys are: sample IDs, or image paths (matched against `images`, the samples'
    image paths, as given and by normalized trailing path).
    """
    if cfg.path is None:
        raise ConfigError("select.embeddings.path: is required with source 'file'")
    path = Path(cfg.path)
    if not path.is_file():
        raise DataError(f"{path}: embeddings file not found; fix select.embeddings.path")
    suffix = path.suffix.lower()
    if suffix == ".npy":
        keys, matrix = _read_npy(path)
    elif suffix in (".parquet", ".pq"):
        keys, matrix = _read_parquet(path, cfg)
    else:
        raise DataError(f"{path}: embeddings must be a .npy (with a {path.stem}.ids.json sidecar) or a .parquet file")
    if len(matrix) == 0 or matrix.shape[1] == 0:
        raise DataError(f"{path}: holds no embeddings (shape {matrix.shape})")
    keys = [str(k) for k in keys]
    seen: dict[str, int] = {}
    for r, k in enumerate(keys):
        if k in seen:
            raise DataError(f"{path}: key {k!r} appears twice, in rows {seen[k]} and {r}; keep one row per key")
        seen[k] = r
    bad = ~np.isfinite(matrix).all(axis=1)
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        raise DataError(f"{path}: row {r} (key {keys[r]!r}) holds NaN or infinite values ({int(bad.sum())} such "
                        "rows); fix or drop them")
    if cfg.key == "sample_id":
        rows: list[int | None] = [seen.get(s) for s in ids]
    else:
        if images is None or len(images) != len(ids):
            raise DataError(f"{path}: select.embeddings.key is 'image' but the samples' image paths are not known; "
                            "use sample_id keys")
        rows, ambiguous = _match_images(keys, images, path)
        if ambiguous:
            raise DataError(ambiguous)
    missing = [i for i, r in enumerate(rows) if r is None]
    if missing:
        i = missing[0]
        what = f"sample {ids[i]!r}" + (f" (image {images[i]!r})" if cfg.key == "image" and images else "")
        raise DataError(f"{path}: no embedding for {what}; {len(missing)} of {len(ids)} samples are missing (keys "
                        f"are {cfg.key}s); add rows for them")
    return matrix[np.asarray(rows, dtype=np.int64)].astype(np.float32)


# ------------------------------------------------------------------------------------------------ stage
def file_inputs(cfg: ProjectConfig) -> dict[str, str]:
    """Digests of a file source's embeddings (and ids sidecar): part of every cache key that depends on them."""
    e = cfg.select.embeddings
    if e.source != "file" or e.path is None:
        return {}
    path = Path(e.path)
    found = {"embeddings_file": digest_file(path)} if path.is_file() else {}
    sidecar = path.with_name(f"{path.stem}.ids.json")
    if path.suffix.lower() == ".npy" and sidecar.is_file():
        found["embeddings_ids"] = digest_file(sidecar)
    return found


def _stage_config(cfg: ProjectConfig) -> dict[str, Any]:
    config: dict[str, Any] = {"embeddings": cfg.select.embeddings.model_dump(mode="json"), "seed": cfg.seed}
    if cfg.select.embeddings.source == "vision_tower":
        config["model"] = cfg.section("model")
    return config


def embeddings_key(cfg: ProjectConfig, inputs: dict[str, str]) -> str:
    """Cache key of `compute_selection_embeddings` for these inputs (a file source's contents included)."""
    return stage_key(STAGE, EMBEDDINGS_VERSION, {**inputs, **file_inputs(cfg)}, _stage_config(cfg))


def _images(table: datasets.Dataset, rows: Sequence[int] | None = None) -> Iterator[np.ndarray]:
    """Decoded prepared images of `rows` (all rows when None), CHUNK rows read at a time."""
    n = len(table) if rows is None else len(rows)
    for start in range(0, n, CHUNK):
        if rows is None:
            batch = table[start:start + CHUNK]["prepared"]
        else:
            batch = table.select(rows[start:start + CHUNK])["prepared"]
        yield from (decode_prepared(png) for png in batch)


def compute_selection_embeddings(
    cfg: ProjectConfig, prepared: datasets.Dataset, out_dir: str | os.PathLike[str], *, inputs: dict[str, str],
) -> Manifest:
    """Fit the configured embedder on the pool split's images, embed every row; write embeddings.npy (float32
    [rows, d], dataset order), ids.json (sample IDs) and the manifest into `out_dir`.

    Reads only sample_id, split and prepared (image_path for file embeddings keyed by image): never an answer.
    """
    e = cfg.select.embeddings
    if e.source == "model":
        raise ConfigError("select.embeddings.source is 'model': those embeddings come from the scoring pass of the "
                          "current model; compute_selection_embeddings handles pool, pixels, vision_tower and file")
    need = {"sample_id", "split", "image_path" if e.source == "file" else "prepared"}
    if e.source == "file" and e.key == "sample_id":
        need.discard("image_path")
    missing = need - set(prepared.column_names)
    if missing:
        raise DataError(f"the prepared dataset lacks column(s) {sorted(missing)}; pass the prepare stage's dataset")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = prepared.select_columns(sorted(need))
    ids = [str(s) for s in column(table, "sample_id")]
    if len(set(ids)) != len(ids):
        raise DataError("the prepared dataset repeats a sample_id; rebuild it with ingest (which de-duplicates)")
    t0 = time.perf_counter()
    fit_rows: list[int] = []
    if e.source == "file":
        images = [str(x) for x in column(table, "image_path")] if "image_path" in need else None
        vectors = load_file_embeddings(e, ids, images)
    else:
        pool = [i for i, s in enumerate(column(table, "split")) if s == "pool"]
        embedder = make_embedder(cfg)
        cap = embedder.max_fit_images
        fit_rows = pool
        if cap is not None and len(pool) > cap:
            pick = np.random.default_rng(cfg.seed).choice(len(pool), cap, replace=False)
            fit_rows = [pool[i] for i in np.sort(pick)]
            log.info("embeddings: fitting on a seeded sample of %d of %d pool images", cap, len(pool))
        if not embedder.needs_fit:
            fit_rows = []
        elif not fit_rows:
            raise DataError(f"no rows with split 'pool' to fit the {e.source} embeddings on; the pool is empty")
        else:
            embedder.fit(_images(table, fit_rows))
        chunks, batch = [], []
        for img in _images(table):
            batch.append(img)
            if len(batch) == CHUNK:
                chunks.append(embedder.embed(batch))
                batch = []
        if batch:
            chunks.append(embedder.embed(batch))
        vectors = np.concatenate(chunks) if chunks else np.zeros((0, 0), np.float32)
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    seconds = round(time.perf_counter() - t0, 3)
    buf = io.BytesIO()
    np.save(buf, vectors, allow_pickle=False)
    atomic_write_bytes(out_dir / EMBEDDINGS_FILE, buf.getvalue())
    atomic_write_json(out_dir / IDS_FILE, ids)
    dim = int(vectors.shape[1]) if vectors.ndim == 2 else 0
    log.info("embeddings: %s, %d rows × %d dims (fitted on %d pool images) in %.1f s", e.source, len(ids), dim,
             len(fit_rows), seconds)
    return write_manifest(
        out_dir, stage=STAGE, stage_version=EMBEDDINGS_VERSION, inputs={**inputs, **file_inputs(cfg)},
        config=_stage_config(cfg), outputs={"embeddings": EMBEDDINGS_FILE, "ids": IDS_FILE},
        info={"source": e.source, "dim": dim, "rows": len(ids), "fit_images": len(fit_rows), "seconds": seconds},
    )


def load_selection_embeddings(folder: str | os.PathLike[str]) -> tuple[list[str], np.ndarray]:
    """(sample IDs, float32 [n, d]) from an embeddings stage folder, after verifying its manifest's digests.

    The matrix is memory-mapped read-only: a round reads the rows of its candidates, and the selectors that take a
    whole pool (KCenter, MaxHerding from 10⁶ rows) read it in blocks, so 10⁷ × 128 is not one 5 GB load per stage."""
    folder = Path(folder)
    m = read_manifest(folder)
    if m.stage != STAGE:
        raise ArtifactError(f"{folder}: holds the output of stage {m.stage!r}, not {STAGE!r}; pass an embeddings "
                            "folder")
    ids = json.loads(m.path_of("ids", folder).read_text(encoding="utf-8"))
    vectors = np.load(m.path_of("embeddings", folder), mmap_mode="r", allow_pickle=False)
    return ids, vectors


def lookup(ids_all: Sequence[str], emb_all: np.ndarray, wanted_ids: Sequence[str]) -> np.ndarray:
    """Rows of `emb_all` for `wanted_ids`, in that order; a sample without an embedding is a DataError."""
    index = {s: i for i, s in enumerate(ids_all)}
    rows = [index.get(s) for s in wanted_ids]
    missing = [s for s, r in zip(wanted_ids, rows, strict=True) if r is None]
    if missing:
        raise DataError(f"sample {missing[0]!r} has no selection embedding ({len(missing)} of {len(wanted_ids)} "
                        "missing); recompute the selection embeddings for the current dataset")
    return emb_all[np.asarray(rows, dtype=np.int64)] if rows else emb_all[:0]


def embeddings_params(cfg: Any, prepared: dict[str, Any]) -> dict[str, Any] | None:
    """The selection-embeddings stage's parameters (its cache key), or None when selection uses the model's own
    embeddings. Keyed by the prepared data's content, the embeddings config, the seed, the base model
    (vision_tower) and the user's file (file), never by the adapter."""
    emb = cfg.select.embeddings
    if emb.source == "model":
        return None
    # Prefect's cache sees only parameters: a changed embeddings file must change them.
    file_digest = digest_json(file_inputs(cfg)) if emb.source == "file" else None
    params = {"prepared": prepared, "select": {"embeddings": cfg.section("select")["embeddings"]},
              "model": cfg.section("model") if emb.source == "vision_tower" else None,
              "file_digest": file_digest, "seed": cfg.seed}
    out = Path(cfg.artifacts) / "embeddings" / digest_json(params)[:16]
    return {"artifacts": str(cfg.artifacts), "out_dir": str(out), **params}


def embeddings_stage(artifacts: str, prepared: dict[str, Any], select: dict[str, Any], model: dict[str, Any] | None,
                     file_digest: str | None, seed: int, out_dir: str) -> dict[str, Any]:
    """The selection-embeddings stage: fitted on the pool's images only, written to `out_dir` (or reused there)."""
    from pipeline.config import StageConfig
    from pipeline.preprocess import load_prepared

    cfg = StageConfig({"select": select, "seed": seed, **({"model": model} if model else {})}, artifacts=artifacts)
    inputs = {"prepared": prepared["digest"]}
    m = reuse_or_compute(out_dir, embeddings_key(cfg, inputs),
                         lambda: compute_selection_embeddings(cfg, load_prepared(prepared["dir"]), out_dir, inputs=inputs))
    return {"dir": out_dir, "digest": m.key}
