"""benchmarks/box_selection.py: its reference learner reads its own training targets back as the boxes they were
made from (letterbox, grid and offsets on canvases of mixed aspect ratio), and the summary's paired differences and
intervals are what the seeds' curves give."""

from __future__ import annotations

import math

import numpy as np
import torch

from benchmarks._box_learner import _targets, predict, prepare
from benchmarks.box_selection import SCENE_KW, summarise
from pipeline.boxes.scenes import SHAPES, make_scenes, render


class Targets(torch.nn.Module):
    """Answers with the training targets of the images it was built for, as the heads' raw outputs would be: what a
    perfectly trained learner says."""

    def __init__(self, maps):
        super().__init__()
        self.maps = maps
        self.drop = torch.nn.Dropout2d(0.0)

    def forward(self, x):
        heat, size, offset = (torch.from_numpy(np.stack([m[j] for m in self.maps])) for j in range(3))
        logit = lambda p: torch.log(p.clamp(1e-6, 1 - 1e-6) / (1 - p.clamp(1e-6, 1 - 1e-6)))  # noqa: E731
        return logit(heat), size, logit(offset)


def test_the_learner_reads_its_targets_back_as_the_boxes_in_original_pixels():
    scenes = make_scenes(12, seed=4, **SCENE_KW)
    assert len({(s.width > s.height, s.width == s.height) for s in scenes}) == 3  # wide, tall and square canvases
    prepared = [prepare(render(s)) for s in scenes]
    maps = [_targets(s.boxes, p.geometry, SHAPES) for s, p in zip(scenes, prepared, strict=True)]
    got = predict(Targets(maps), prepared, SHAPES, min_score=0.99)
    for s, boxes in zip(scenes, got, strict=True):
        assert len(boxes) == len(s.boxes), s.name
        for want in s.boxes:
            best = min(boxes, key=lambda b: abs(b.x - want.x) + abs(b.y - want.y))
            assert best.label == want.label
            err = max(abs(best.x - want.x), abs(best.y - want.y), abs(best.x2 - want.x2), abs(best.y2 - want.y2))
            assert err < 0.01 * max(s.width, s.height), (s.name, want, best)  # float32 maps of a 16-cell grid


def test_summary_pairs_each_seed_with_its_random_run():
    runs = {0: {"random": [0.1, 0.3, 0.5], "x": [0.1, 0.4, 0.7]},
            1: {"random": [0.2, 0.2, 0.6], "x": [0.2, 0.4, 0.6]}}
    s = summarise(runs, [10, 20, 30])
    row = s["x"]["per_budget"][1]
    assert row["labeled"] == 20 and row["map50"] == 0.4 and row["minus_random"] == 0.15
    half = 12.71 * 0.0707107 / math.sqrt(2)  # differences 0.1 and 0.2: stdev 0.0707, t(1) = 12.71
    assert row["minus_random_ci95"] == [round(0.15 - half, 4), round(0.15 + half, 4)]
    # after the start: seed 0 gains mean(0.1, 0.2) = 0.15, seed 1 mean(0.2, 0.0) = 0.1
    assert s["x"]["mean_minus_random_after_start"] == 0.125
    assert s["random"]["mean_minus_random_after_start"] == 0.0
