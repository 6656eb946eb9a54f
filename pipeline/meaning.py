"""Which sampled answers mean the same: the grouping semantic entropy counts over (Kuhn, Gal & Farquhar, ICLR 2023).

For short answers, meaning equivalence is normalised-answer equivalence (SQuAD normalisation: case, punctuation,
articles) with number words read as numbers ("Seven." = "7" = "the seven"), as Farquhar et al. (Nature 2024) do
for short answers. Longer answers would need an entailment model; this module says so rather than pretending:
answers of more than `SHORT_WORDS` words group only when they normalise to the same words.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

import numpy as np

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)
SHORT_WORDS = 8  # answers up to here are compared as short answers (every word read, numbers folded)

_NUMBERS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}


def normalize_answer(s: str | None) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces (pipeline.answer_metrics
    compares answers after it too)."""
    s = (s or "").lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def meaning_key(text: str | None) -> str:
    """The key two answers share when they mean the same (see the module docstring)."""
    words = normalize_answer(text).split()
    if len(words) <= SHORT_WORDS:
        words = [_NUMBERS.get(w, w) for w in words]
    return " ".join(words)


def meaning_codes(samples: Sequence[Sequence[str]]) -> np.ndarray:
    """[n, k] integer codes, equal within a row where the sampled answers mean the same."""
    k = len(samples[0]) if samples else 0
    codes = np.zeros((len(samples), k), dtype=np.int64)
    for i, runs in enumerate(samples):
        groups: dict[str, int] = {}
        codes[i] = [groups.setdefault(meaning_key(a), len(groups)) for a in runs]
    return codes
