"""How an annotator's answer names one of the declared closed answers (data.answers, data.answer_aliases).

Annotators type `h` for `H`, `Hot  dog` for `hot dog`, a full-width `Ａ` for `A`: a label matches an answer when both
read the same after NFKC (width and compatibility forms), case folding and collapsing whitespace (`closed_key`), or
through a declared alias. Only that: punctuation and articles still count (`pipeline.meaning.normalize_answer`, the
SQuAD normalisation open answers are scored with, is a different, looser key). Answers are stored as declared.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def closed_key(text: str) -> str:
    """The key two spellings of one closed answer share: NFKC, case folded, single spaces, trimmed."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


@dataclass(frozen=True)
class ClosedAnswers:
    """The declared answers by key (closed_key of each answer and of each alias) → the answer as declared."""

    answers: tuple[str, ...]
    by_key: Mapping[str, str]

    @classmethod
    def of(cls, answers: Sequence[str], aliases: Mapping[str, str] | None = None) -> ClosedAnswers:
        """ValueError naming both spellings when two answers, or an alias and an answer, read the same but mean
        different answers, or when an alias names no answer."""
        by_key: dict[str, str] = {}
        for a in answers:
            if (other := by_key.setdefault(closed_key(a), a)) != a:
                raise ValueError(f"data.answers {other!r} and {a!r} are one answer once case, width and spaces are "
                                 f"ignored (both read {closed_key(a)!r}), so a label could not tell them apart; "
                                 "keep one of them")
        declared = dict(by_key)
        for alias, target in (aliases or {}).items():
            answer = declared.get(closed_key(target))
            if answer is None:
                raise ValueError(f"data.answer_aliases: {alias!r} → {target!r} names no answer of data.answers "
                                 f"[{', '.join(answers)}]; map it to one of them")
            if (other := by_key.setdefault(closed_key(alias), answer)) != answer:
                raise ValueError(f"data.answer_aliases: {alias!r} → {answer!r} collides with {other!r} (both read "
                                 f"{closed_key(alias)!r}); remove the alias or rename the answer")
        return cls(tuple(answers), by_key)

    def match(self, label: str) -> str | None:
        """The declared answer `label` names, or None."""
        return self.by_key.get(closed_key(label))
