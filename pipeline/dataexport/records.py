"""The records an export writes, one per labeled sample, before any trainer's format shapes them.

A sample is images and turns: today one image and one (question, answer) turn; several images or a conversation are
more entries in the same tuples, and every writer already loops over both (the first user turn carries one image
tag per image, as LLaMA-Factory, ms-swift and TRL all expect).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Turn:
    question: str
    answer: str


@dataclass(frozen=True)
class Sample:
    id: str  # tamis's sample ID: lineage.json's `labels` say where its label came from
    images: tuple[str, ...]  # paths relative to the export folder, in the order the image tags use them
    turns: tuple[Turn, ...]
    split: str  # "train", or "test" with --include-test


def conversation(sample: Sample) -> list[tuple[str, str, int]]:
    """(role, text, images before the text) per message: user/assistant alternating, every image in the first user
    message (before its text, where tamis's prompt puts the image)."""
    out: list[tuple[str, str, int]] = []
    for i, t in enumerate(sample.turns):
        out += [("user", t.question, len(sample.images) if i == 0 else 0), ("assistant", t.answer, 0)]
    return out
