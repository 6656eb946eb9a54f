"""The reference learner of benchmarks/box_selection.py: a tiny CenterNet-style detector trained from scratch on
the CPU. It is NOT the VLM tamis fine-tunes: it stands in for it so that box selection can be measured in minutes.

What it is (CenterNet, Zhou et al., arXiv 1904.07850, shrunk): each image letterboxed to SIZE × SIZE (aspect kept,
centred, as tamis's `preprocess.pad: square` does; pipeline.boxes.box.Geometry maps boxes between the original
pixels and the canvas), six 3×3 convolutions (stride 4 overall), then per cell of the 16 × 16 grid a heatmap per
class (is an object's centre here?), the box's size and the centre's sub-cell offset. Trained with the focal loss
on Gaussian-splatted centres and L1 on size and offset; a box is a heatmap peak (3 × 3 max-pooling), scored by the
peak. A Dropout2d before the heads gives sampled answers when left on (MC dropout, for `sample_agreement`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from pipeline.boxes.box import Box, Geometry

SIZE, STRIDE = 64, 4
GRID = SIZE // STRIDE


@dataclass(frozen=True)
class Prepared:
    """One image as the learner sees it: the letterboxed pixels (3 × SIZE × SIZE, 0..1) and its geometry."""

    pixels: np.ndarray
    geometry: Geometry


def prepare(image) -> Prepared:  # a PIL image
    from PIL import Image

    w, h = image.size
    scale = SIZE / max(w, h)
    nw, nh = max(1, round(w * scale)), max(1, round(h * scale))
    ox, oy = (SIZE - nw) // 2, (SIZE - nh) // 2
    canvas = Image.new("RGB", (SIZE, SIZE), (0, 0, 0))
    canvas.paste(image.convert("RGB").resize((nw, nh), Image.Resampling.BILINEAR), (ox, oy))
    pixels = np.asarray(canvas, dtype=np.float32).transpose(2, 0, 1) / 255.0
    return Prepared(pixels, Geometry(w, h, content=(ox, oy, nw, nh), canvas=(SIZE, SIZE)))


def _block(cin: int, cout: int, stride: int = 1, dilation: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, padding=dilation, dilation=dilation, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class Net(nn.Module):
    def __init__(self, classes: int, dropout: float = 0.2):
        super().__init__()
        self.body = nn.Sequential(_block(3, 16), _block(16, 32, 2), _block(32, 32), _block(32, 48, 2),
                                  _block(48, 48), _block(48, 48, dilation=2))
        self.drop = nn.Dropout2d(dropout)
        self.heat = nn.Conv2d(48, classes, 1)
        self.size = nn.Conv2d(48, 2, 1)
        self.offset = nn.Conv2d(48, 2, 1)
        nn.init.constant_(self.heat.bias, -2.19)  # CenterNet's prior: sigmoid ≈ 0.1 everywhere at the start

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        f = self.drop(self.body(x))
        return self.heat(f), self.size(f), self.offset(f)


def _targets(boxes: Sequence[Box], g: Geometry, labels: Sequence[str]) -> tuple[np.ndarray, ...]:
    """Heatmap (classes × GRID × GRID), size and offset maps (2 × GRID × GRID, grid units) and their mask."""
    heat = np.zeros((len(labels), GRID, GRID), np.float32)
    size, offset, mask = (np.zeros((2, GRID, GRID), np.float32), np.zeros((2, GRID, GRID), np.float32),
                          np.zeros((GRID, GRID), np.float32))
    ys, xs = np.mgrid[0:GRID, 0:GRID]
    for b in boxes:
        (fx1, fy1), (fx2, fy2) = g.to_frame(b.x, b.y), g.to_frame(b.x2, b.y2)
        cx, cy = (fx1 + fx2) / 2 * GRID, (fy1 + fy2) / 2 * GRID
        bw, bh = (fx2 - fx1) * GRID, (fy2 - fy1) * GRID
        ix, iy = min(int(cx), GRID - 1), min(int(cy), GRID - 1)
        sigma = max(0.5, min(bw, bh) / 6)
        k = labels.index(b.label)
        heat[k] = np.maximum(heat[k], np.exp(-((xs - ix) ** 2 + (ys - iy) ** 2) / (2 * sigma ** 2)))
        size[:, iy, ix], offset[:, iy, ix], mask[iy, ix] = (bw, bh), (cx - ix, cy - iy), 1.0
    return heat, size, offset, mask


def _focal(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    p = torch.sigmoid(logits).clamp(1e-4, 1 - 1e-4)
    pos = target.eq(1).float()
    pos_loss = -torch.log(p) * (1 - p) ** 2 * pos
    neg_loss = -torch.log(1 - p) * p ** 2 * (1 - target) ** 4 * (1 - pos)
    return (pos_loss.sum() + neg_loss.sum()) / pos.sum().clamp(min=1.0)


def _flip(pixels: np.ndarray, boxes: Sequence[Box], g: Geometry) -> tuple[np.ndarray, list[Box], Geometry]:
    """The horizontal mirror of a letterboxed image with its boxes (a training augmentation)."""
    ox, oy, nw, nh = g.content
    mirrored = Geometry(g.width, g.height, content=(SIZE - ox - nw, oy, nw, nh), canvas=g.canvas)
    return pixels[:, :, ::-1].copy(), [Box(b.label, g.width - b.x2, b.y, b.w, b.h) for b in boxes], mirrored


def train(data: Sequence[tuple[Prepared, Sequence[Box]]], labels: Sequence[str], *, steps: int = 300,
          batch: int = 16, seed: int = 0) -> Net:
    """A detector trained from scratch on `data` (prepared image, its labeled boxes in original pixels)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    net = Net(len(labels))
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.15)
    both = [[(p.pixels, _targets(b, p.geometry, labels))] for p, b in data]
    for (p, b), pair in zip(data, both, strict=True):  # each image and its mirror, targets made once
        px, fb, fg = _flip(p.pixels, b, p.geometry)
        pair.append((px, _targets(fb, fg, labels)))
    net.train()
    for _ in range(steps):
        picks = [both[i][rng.integers(2)] for i in rng.integers(0, len(both), size=batch)]
        x = torch.from_numpy(np.stack([p[0] for p in picks]))
        heat, size, offset, mask = (torch.from_numpy(np.stack([p[1][j] for p in picks])) for j in range(4))
        h, s, o = net(x)
        m = mask.unsqueeze(1)
        n = mask.sum().clamp(min=1.0)
        loss = _focal(h, heat) + 0.1 * (F.l1_loss(s * m, size * m, reduction="sum") / n) + \
            F.l1_loss(torch.sigmoid(o) * m, offset * m, reduction="sum") / n
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    net.eval()
    return net


@torch.no_grad()
def predict(net: Net, images: Sequence[Prepared], labels: Sequence[str], *, min_score: float = 0.05,
            top: int = 20, dropout: bool = False) -> list[list[Box]]:
    """Each image's boxes in its original pixels, scored by their heatmap peak, most sure first. `dropout`: leave
    the Dropout2d on (one MC-dropout sample)."""
    net.eval()
    if dropout:
        net.drop.train()
    out: list[list[Box]] = []
    for start in range(0, len(images), 256):
        chunk = images[start:start + 256]
        h, s, o = net(torch.from_numpy(np.stack([p.pixels for p in chunk])))
        heat = torch.sigmoid(h)
        peaks = heat * (F.max_pool2d(heat, 3, 1, 1) == heat)
        scores, idx = peaks.flatten(1).topk(top)
        for i, p in enumerate(chunk):
            boxes = []
            for score, flat in zip(scores[i].tolist(), idx[i].tolist(), strict=True):
                if score < min_score:
                    break
                k, cell = divmod(flat, GRID * GRID)
                iy, ix = divmod(cell, GRID)
                ox, oy = torch.sigmoid(o[i, :, iy, ix]).tolist()
                bw, bh = s[i, :, iy, ix].clamp(min=0.1).tolist()
                cx, cy = (ix + ox) / GRID, (iy + oy) / GRID
                x1, y1 = p.geometry.from_frame(cx - bw / GRID / 2, cy - bh / GRID / 2)
                x2, y2 = p.geometry.from_frame(cx + bw / GRID / 2, cy + bh / GRID / 2)
                box = Box.from_corners(labels[k], x1, y1, x2, y2, round(score, 4))
                boxes.append(box.clamped(p.geometry.width, p.geometry.height))
            out.append([b for b in boxes if b.w > 0 and b.h > 0])
    net.drop.eval()
    return out
