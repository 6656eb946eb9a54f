"""Answer metrics: accuracy (closed answer sets), SQuAD-style exact match, token F1 and normalized edit similarity
(open answers), each as per-row scores and their mean.

Below every stage that compares answers: the evaluate stage reports them, the label check's open-answer path reads
token F1; both import them from here, so an edit to one stage never re-runs the other."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pipeline.errors import DataError
from pipeline.meaning import normalize_answer


def _pairs(preds: Sequence[str | None], refs: Sequence[str]) -> None:
    if len(preds) != len(refs):
        raise DataError(f"{len(preds)} predictions for {len(refs)} references; score the whole test split")
    if not refs:
        raise DataError("no references to score against: the test split is empty")


def accuracy(preds: Sequence[str | None], refs: Sequence[str]) -> float:
    """Fraction of predictions equal to the reference after stripping whitespace (closed answer sets)."""
    _pairs(preds, refs)
    return sum((p or "").strip() == r.strip() for p, r in zip(preds, refs, strict=True)) / len(refs)


def exact_match(preds: Sequence[str | None], refs: Sequence[str]) -> float:
    _pairs(preds, refs)
    return sum(normalize_answer(p) == normalize_answer(r) for p, r in zip(preds, refs, strict=True)) / len(refs)


def _f1(pred: str | None, ref: str) -> float:
    p, r = normalize_answer(pred).split(), normalize_answer(ref).split()
    if not p or not r:
        return float(p == r)
    common = sum((Counter(p) & Counter(r)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(r)
    return 2 * precision * recall / (precision + recall)


def token_f1(preds: Sequence[str | None], refs: Sequence[str]) -> float:
    _pairs(preds, refs)
    return sum(_f1(p, r) for p, r in zip(preds, refs, strict=True)) / len(refs)


def _edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insert / delete / substitute, each 1); two rows of the table at a time."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def edit_similarity(preds: Sequence[str | None], refs: Sequence[str]) -> float:
    """Mean 1 − Levenshtein(pred, ref) / max(len) over characters of the normalised strings (ANLS without its
    threshold): partial credit for a near-miss spelling ("sevn" for "seven") that token F1 scores 0."""
    _pairs(preds, refs)
    total = 0.0
    for p, r in zip(preds, refs, strict=True):
        a, b = normalize_answer(p), normalize_answer(r)
        total += 1.0 if a == b else 1.0 - _edit_distance(a, b) / max(len(a), len(b))
    return total / len(refs)


def row_scores(preds: Sequence[str | None], refs: Sequence[str], *, closed: bool) -> dict[str, list[float]]:
    """Each metric's score per row (every metric here is the mean of these): accuracy + exact match for closed
    sets; exact match, token F1 and edit similarity for open ones (exact match first: it is the learning curve's
    default metric)."""
    _pairs(preds, refs)
    pairs = list(zip(preds, refs, strict=True))
    em = [float(normalize_answer(p) == normalize_answer(r)) for p, r in pairs]
    if closed:
        return {"accuracy": [float((p or "").strip() == r.strip()) for p, r in pairs], "exact_match": em}
    return {"exact_match": em, "token_f1": [_f1(p, r) for p, r in pairs],
            "edit_similarity": [edit_similarity([p], [r]) for p, r in pairs]}


def score_answers(preds: Sequence[str | None], refs: Sequence[str], *, closed: bool) -> dict[str, float]:
    """The metrics a round reports (row_scores' means)."""
    return {name: sum(v) / len(v) for name, v in row_scores(preds, refs, closed=closed).items()}
