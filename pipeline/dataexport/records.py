"""The records an export writes, one per labeled sample, before any trainer's format shapes them.

A sample is images and turns: one image and one (question, answer) turn for a one-image project; the images of a
conversation source's sample (pipeline/schema.py `more_images`) and its context (`context`: earlier user / assistant
turns, a system prompt) are more entries in the same tuples. The first user turn carries one image tag per image, in
order, before its text (as tamis's own prompt puts its image); the last turn's answer is the label.
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
    system: str = ""  # a system prompt the sample came with ("" without)

    @property
    def answer(self) -> str:
        """The label: the last turn's answer (earlier turns are the context it was given)."""
        return self.turns[-1].answer


def conversation(sample: Sample) -> list[tuple[str, str, int]]:
    """(role, text, images before the text) per message: the system prompt if any, then user/assistant alternating,
    every image in the first user message (before its text, where tamis's prompt puts the image)."""
    out: list[tuple[str, str, int]] = [("system", sample.system, 0)] if sample.system else []
    for i, t in enumerate(sample.turns):
        out += [("user", t.question, len(sample.images) if i == 0 else 0), ("assistant", t.answer, 0)]
    return out


def turns_of(context: list[dict[str, str]], question: str, answer: str) -> tuple[str, tuple[Turn, ...]]:
    """(system prompt, turns) of an ingested row's `context` (role/text dicts: an optional system turn, then user and
    assistant alternating, as the readers validated) with its question and label as the last turn."""
    system = context[0]["text"] if context and context[0]["role"] == "system" else ""
    rest = context[1:] if system else context
    pairs = [Turn(rest[i]["text"], rest[i + 1]["text"]) for i in range(0, len(rest) - 1, 2)]
    return system, (*pairs, Turn(question, answer))
