"""Open or closed answers: what `tamis init` decides from the answers it found, and why.

`--open` / `--closed` decide outright. Otherwise: class sub-folders are classes; answers typed per row (a manifest's
or a test file's answer cells) are a closed set unless they look like free text (`free_form`):

- sentences: the median labeled answer has 4 words or more (captions, descriptions), or
- few repeats: 20 distinct answers or more, and more distinct answers than half the labeled rows (most answers are
  seen once; a closed set repeats its classes: 10 classes over 500 test rows are seen 50 times each).

Fewer than 2 distinct answers is open answers (a closed set needs 2). Every choice carries the sentence init prints.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Literal

from pipeline.errors import ConfigError
from pipeline.project_init.found import Found

AnswerMode = Literal["auto", "open", "closed"]
SENTENCE_WORDS = 4  # a median answer this long or longer is a sentence, not a class name
MANY_DISTINCT = 20  # with fewer distinct answers, a small test file that sees each once is still a closed set


@dataclass
class AnswerChoice:
    answers: list[str] | None  # the closed set, or None: open answers
    why: str
    max_words: int = 0  # the longest answer seen, in words (the open-answer generation budget reads it)


def free_form(counts: Counter[str]) -> str | None:
    """Why these typed answers (answer → labeled rows) look like free text (module docstring), or None."""
    rows, distinct = sum(counts.values()), len(counts)
    if not rows:
        return None
    words = statistics.median_low(n for a, c in counts.items() for n in [len(a.split())] * c)
    if words >= SENTENCE_WORDS:
        return f"the median answer has {words} words: sentences, not class names"
    if distinct >= MANY_DISTINCT and distinct > rows / 2:
        return (f"{distinct} distinct answers in {rows} labeled rows: most are seen once, as free text is "
                "(a closed set repeats its classes)")
    return None


def choose_answers(found: list[Found], mode: AnswerMode = "auto") -> AnswerChoice:
    """The answer set init writes (None: open answers) and the reason it prints (module docstring)."""
    counts: Counter[str] = Counter()
    typed: Counter[str] = Counter()
    for f in found:
        counts.update(f.counts or dict.fromkeys(f.answers, 1))
        if f.free_text:
            typed.update(f.counts)
    seen = sorted(counts)
    longest = max((len(a.split()) for a in seen), default=0)
    if mode == "open":
        return AnswerChoice(None, "open answers (--open): the model writes its answer, annotators type theirs",
                            longest)
    if mode == "closed":
        if len(seen) < 2:
            raise ConfigError(f"--closed: a closed answer set needs at least 2 answers, and {len(seen)} "
                              f"({', '.join(seen) or 'none'}) were found; give a labeled --test file or one sub-folder "
                              "per class, list data.answers in the config, or drop --closed for open answers")
        return AnswerChoice(seen, "a closed set (--closed): classification over them")
    if len(seen) < 2:
        return AnswerChoice(None, f"open answers: {'one answer' if seen else 'no answers'} found (a closed set needs "
                            "2); pass a labeled --test file for a closed set", longest)
    folders = any(f.answers and not f.free_text for f in found)  # class sub-folders name classes
    reason = None if folders else free_form(typed)
    if reason:
        return AnswerChoice(None, f"open answers: {reason}; pass --closed to classify over the {len(seen)} answers "
                            "instead", longest)
    return AnswerChoice(seen, "a closed set (classification); pass --open if they are free text", longest)


def generation_budget(max_words: int) -> int:
    """model.max_new_tokens for open answers: about 2 tokens a word plus the end of turn, 8 to spare; at least 8."""
    return max(8, min(128, math.ceil(2 * max_words) + 8))


def small_classes(found: list[Found], answers: list[str] | None) -> list[str]:
    """One warning per class of a closed set with fewer than 2 labeled images: what it means for the test set and
    for a stratified split."""
    if answers is None:
        return []
    counts: Counter[str] = Counter()
    tests: Counter[str] = Counter()
    for f in found:
        counts.update(f.counts)
        tests.update(f.test_counts)
    out = []
    for name in answers:
        n = counts[name]
        if n >= 2:
            continue
        where = "in the test set" if tests[name] else "as a training label"
        out.append(f"class {name!r} has {n} labeled image ({where}): its test accuracy rests on "
                   f"{'that one image (0 or 100 %)' if tests[name] else 'no test image at all'}, the model sees "
                   f"{'no' if tests[name] else 'one'} example of it to learn from, and a stratified split (the label "
                   "check's folds) cannot put it on both sides; label at least one more image of it, or drop it "
                   "from data.answers")
    return out
