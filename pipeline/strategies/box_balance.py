"""The class_balanced selector (select.diversity: class_balanced, box projects): pipeline.boxes.selection's
class_balanced rule on the candidates' scores, each pick going to the class with the fewest predicted boxes in the
batch so far (PCB, CVPR 2024; docs/boxes.md says why it is a box project's default).

It reads `predicted` as a [n, classes] matrix: how many boxes of each class (data.answers' order) the model's answer
for each candidate holds (pipeline.selection builds it from the answers' text, pipeline.boxes.codecs
answer_classes). Only the classes matter here, not where the boxes lie."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from pipeline.boxes.box import Box
from pipeline.boxes.selection import class_balanced
from pipeline.errors import SelectionError
from pipeline.strategies.base import Selector


class ClassBalanced(Selector):
    """The most uncertain candidates, each pick going to the class the batch holds fewest predicted boxes of."""

    name = "class_balanced"
    wants: ClassVar[tuple[str, ...]] = ("box_labels",)
    cost_use: ClassVar[str] = "scores"
    reads_predicted: ClassVar[str] = "box_counts"

    def __init__(self, box_labels: list[str] | None = None) -> None:
        super().__init__()
        if not box_labels:
            raise SelectionError("class_balanced: balances a batch over box classes and needs the class list; it "
                                 "runs in box projects (data.task: boxes, data.answers: the classes)")
        self.labels = list(box_labels)

    def select(self, k, *, scores, embeddings=None, predicted=None, seed, labeled_embeddings=None):
        s = self._scores(k, scores)
        p = None if predicted is None else np.asarray(predicted)
        if p is None or p.shape != (len(s), len(self.labels)):
            raise SelectionError(f"class_balanced: predicted must hold each candidate's predicted boxes per class, "
                                 f"shape {(len(s), len(self.labels))}, got {None if p is None else p.shape}")
        # class_balanced reads each box's class only: a count of n boxes of a class is n boxes of it, anywhere.
        boxes = {str(i): [Box(label, 0, 0, 1, 1) for c, label in enumerate(self.labels) for _ in range(int(p[i, c]))]
                 for i in range(len(s))}
        # Ties in uncertainty broken by a seeded order, as the other selectors do.
        jitter = np.random.default_rng(seed).random(len(s)) * 1e-12
        picks = class_balanced({str(i): float(s[i] + jitter[i]) for i in range(len(s))}, boxes, k, labels=self.labels)
        counts = p[[int(i) for i in picks]].sum(0)
        self.info = {"predicted_boxes": {label: int(n) for label, n in zip(self.labels, counts, strict=True)}}
        return np.asarray([int(i) for i in picks], dtype=np.int64)
