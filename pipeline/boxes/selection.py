"""Class-balanced selection over predicted boxes: the most uncertain images first, but each pick goes to the class
that the batch (and what is labeled already) holds fewest boxes of, judged by the model's predicted boxes.

Why: a VLM's uncertainty ranks the classes it is unsure of together, and a round can come back with a batch of one
common class (PCB, Bang et al., CVPR 2024: balancing by the model's pseudo-labels lifts few-shot accuracy of
VLMs). The rule, one pick at a time: the target is the class with the fewest boxes so far (labeled + picked, by
predicted boxes for the picked) among classes that some unpicked image is predicted to hold, ties broken by the
class list's order; the pick is the most uncertain unpicked image predicted to hold it. When no unpicked image has
a predicted box of a known class, picks follow the uncertainty alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pipeline.boxes.box import Box
from pipeline.errors import SelectionError


def class_balanced(scores: Mapping[str, float], predicted: Mapping[str, Sequence[Box]], k: int, *,
                   labels: Sequence[str], labeled_counts: Mapping[str, int] | None = None) -> list[str]:
    """`k` image ids of `scores` (id → uncertainty, higher first), balanced over `labels` by the boxes `predicted`
    (id → boxes) for them; `labeled_counts`: boxes per class already labeled. Returns the ids in pick order."""
    if k > len(scores):
        raise SelectionError(f"class-balanced selection: {k} images requested, {len(scores)} scored; lower "
                             f"select.batch_size to {len(scores)} or add images to the pool")
    order = sorted(scores, key=lambda i: (-scores[i], i))
    counts = {label: (labeled_counts or {}).get(label, 0) for label in labels}
    queues: dict[str, list[str]] = {label: [] for label in labels}
    for image in order:
        for label in dict.fromkeys(b.label for b in predicted.get(image, ())):
            if label in queues:
                queues[label].append(image)
    heads = dict.fromkeys(labels, 0)  # each queue's first unpicked position: every queue is walked once in all
    rest = 0  # the same for the fallback walk down `order`
    taken: set[str] = set()
    picks: list[str] = []
    rank = {label: i for i, label in enumerate(labels)}
    while len(picks) < k:
        for label in labels:
            q = queues[label]
            while heads[label] < len(q) and q[heads[label]] in taken:
                heads[label] += 1
        open_ = [label for label in labels if heads[label] < len(queues[label])]
        if open_:
            target = min(open_, key=lambda label: (counts[label], rank[label]))
            image = queues[target][heads[target]]
        else:
            while order[rest] in taken:
                rest += 1
            image = order[rest]
        picks.append(image)
        taken.add(image)
        for b in predicted.get(image, ()):
            if b.label in counts:
                counts[b.label] += 1
    return picks
