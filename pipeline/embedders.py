"""Embedders: the pluggable parts that turn prepared images into selection embeddings (`select.embeddings.source`).

One small base class (`Embedder`: fit on pool images, embed any, save and load what it learned) and a name → class
dict (`EMBEDDERS`). `pixels` is downsampled pixels → standardized → whitened PCA; `pool` a small SimCLR encoder
trained on the pool; `vision_tower` the frozen vision encoder of the configured base model (nothing to fit). The
stage that runs them over a dataset is pipeline.embeddings.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from pipeline.config import EmbeddingsConfig, ModelConfig, PoolEncoderConfig, SelectConfig
from pipeline.errors import ConfigError, DataError

if TYPE_CHECKING:
    import albumentations as A
    import torch

log = logging.getLogger(__name__)

CHUNK = 256  # images embedded at a time


@dataclass(frozen=True)
class EmbeddingsSpec:
    """What the selection-embeddings code reads of a project: select.embeddings, the seed, the base model (the
    vision tower's), the batch the tower runs at, and the artifacts folder (where a sharded pool keeps its fits).
    The round's stage is keyed on select.embeddings, the seed and the model (vision_tower) only: it runs the tower
    at the default batch size, as it always has (the embeddings do not depend on it)."""

    embeddings: EmbeddingsConfig
    seed: int
    model: ModelConfig | None = None
    batch_size: int = SelectConfig.model_fields["score_batch_size"].default
    artifacts: Path | None = None

    @classmethod
    def of(cls, select: SelectConfig, *, seed: int, model: ModelConfig | None = None,
           artifacts: str | Path | None = None) -> EmbeddingsSpec:
        return cls(select.embeddings, seed, model, select.score_batch_size,
                   None if artifacts is None else Path(artifacts))


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
    def from_config(cls, spec: EmbeddingsSpec) -> Embedder:
        raise NotImplementedError

    def fit(self, images: Iterable[np.ndarray]) -> Embedder:
        """Learn from the pool's images (read once, in order). Embedders with nothing to learn keep this no-op."""
        return self

    def embed(self, images: Sequence[np.ndarray]) -> np.ndarray:
        raise NotImplementedError

    def state(self) -> dict[str, np.ndarray]:
        """What `fit` learned, as plain arrays: saved without pickle, so a later round embeds new images in the same
        space without fitting again (`load_state` restores it)."""
        return {}

    def load_state(self, state: Mapping[str, np.ndarray]) -> Embedder:
        return self


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
    def from_config(cls, spec: EmbeddingsSpec) -> PixelsEmbedder:
        e = spec.embeddings
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

    def state(self) -> dict[str, np.ndarray]:
        if self.components is None:
            raise RuntimeError("PixelsEmbedder.state before fit")
        return {"mean": self.mean, "std": self.std, "components": self.components, "scale": self.scale}

    def load_state(self, state: Mapping[str, np.ndarray]) -> PixelsEmbedder:
        self.mean, self.std = np.asarray(state["mean"]), np.asarray(state["std"])
        self.components, self.scale = np.asarray(state["components"]), np.asarray(state["scale"])
        return self


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
    def from_config(cls, spec: EmbeddingsSpec) -> PoolEncoderEmbedder:
        return cls(spec.embeddings.encoder, seed=spec.seed)

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

    def state(self) -> dict[str, np.ndarray]:
        if self.encoder is None:
            raise RuntimeError("PoolEncoderEmbedder.state before fit")
        weights = {f"encoder.{k}": v.detach().cpu().numpy() for k, v in self.encoder.state_dict().items()}
        return {"mean": self.mean, "std": self.std, **weights}

    def load_state(self, state: Mapping[str, np.ndarray]) -> PoolEncoderEmbedder:
        import torch

        self.mean, self.std = np.asarray(state["mean"]), np.asarray(state["std"])
        with torch.random.fork_rng(devices=[]):  # build_encoder's initial weights draw from the global RNG
            encoder, _ = build_encoder(self.cfg.dim)
        encoder = encoder.to(memory_format=torch.channels_last)
        encoder.load_state_dict({k.removeprefix("encoder."): torch.from_numpy(np.array(v))
                                 for k, v in state.items() if k.startswith("encoder.")})
        self.encoder = encoder.eval()
        return self


# ------------------------------------------------------------------------------------------------ vision tower
class VisionTowerEmbedder(Embedder):
    """The frozen vision encoder of `model`: last hidden state mean-pooled over patches (and tiles). Nothing to fit;
    the model is loaded on first use."""

    needs_fit = False

    def __init__(self, model: ModelConfig, *, batch_size: int = 16):
        self.model_cfg, self.batch_size = model, batch_size
        self._loaded: Any = None

    @classmethod
    def from_config(cls, spec: EmbeddingsSpec) -> VisionTowerEmbedder:
        if spec.model is None:
            raise ConfigError("select.embeddings.source 'vision_tower' needs the model section; build the "
                              "EmbeddingsSpec with model=")
        return cls(spec.model, batch_size=spec.batch_size)

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


def make_embedder(spec: EmbeddingsSpec) -> Embedder:
    source = spec.embeddings.source
    if source not in EMBEDDERS:
        raise ConfigError(f"select.embeddings.source {source!r} has no embedder here: 'model' embeddings come from "
                          f"the scoring pass and 'file' ones are read; fitted sources: {', '.join(EMBEDDERS)}")
    return EMBEDDERS[source].from_config(spec)


