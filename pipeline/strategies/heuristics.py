"""Uncertainty heuristics, baal-style: pure functions of one array, higher score = more informative.

Each heuristic documents the one input shape it reads:

==================== ================================================================================
heuristic            input
==================== ================================================================================
random               anything with a first dimension n (values ignored)
least_confidence     [n, c] class probabilities, or [n, c, k] MC-dropout samples (averaged over k)
margin               same as least_confidence
entropy              same as least_confidence
bald                 [n, c, k] MC-dropout samples (k >= 2)
token_entropy        [n, t] per-token entropies (or log-probs, `kind="logprob"`), NaN-padded to t
answer_disagreement  [n, k] answer ids of k sampled generations (ints or normalised strings),
                     or [n] agreement fractions in [0, 1]
semantic_entropy     [n, k] meaning ids of k sampled generations (pipeline.meaning.meaning_codes)
==================== ================================================================================
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np

from pipeline.errors import SelectionError

# Model probabilities come through softmax in fp16/bf16 on GPUs: rows sum to 1 only to about 1e-3.
PROB_TOL = 1e-3


def _array(values: object, name: str, *, ndims: tuple[int, ...], allow_nan: bool = False) -> np.ndarray:
    a = np.asarray(values)
    if a.ndim not in ndims:
        want = " or ".join(f"{d}-D" for d in ndims)
        raise SelectionError(f"{name}: expects a {want} array, got shape {a.shape}")
    if a.shape[0] == 0:
        raise SelectionError(f"{name}: got an empty array (shape {a.shape}); there is nothing to score")
    if a.dtype.kind not in "fiub":
        raise SelectionError(f"{name}: expects numbers, got dtype {a.dtype}")
    a = a.astype(np.float64, copy=False)
    if not allow_nan and np.isnan(a).any():
        rows = np.unique(np.argwhere(np.isnan(a))[:, 0])
        raise SelectionError(
            f"{name}: {len(rows)} of {a.shape[0]} rows contain NaN (first at row {int(rows[0])}); "
            "rescore those samples or quarantine them"
        )
    if np.isinf(a).any():
        row = int(np.argwhere(np.isinf(a))[0, 0])
        raise SelectionError(f"{name}: row {row} contains an infinite value; rescore that sample")
    return a


def _probs(values: object, name: str, *, ndims: tuple[int, ...] = (2, 3)) -> np.ndarray:
    """Validate class probabilities [n, c] or [n, c, k]; return them averaged over MC samples as [n, c]."""
    p = _array(values, name, ndims=ndims)
    if p.shape[1] < 2:
        raise SelectionError(f"{name}: needs at least 2 classes along axis 1, got shape {p.shape}")
    if p.ndim == 3 and p.shape[2] == 0:
        raise SelectionError(f"{name}: got 0 MC-dropout samples along axis 2 (shape {p.shape})")
    lo, hi = float(p.min()), float(p.max())
    if lo < -PROB_TOL or hi > 1 + PROB_TOL:
        raise SelectionError(
            f"{name}: probabilities must lie in [0, 1], got values in [{lo:.4g}, {hi:.4g}]; "
            "pass softmax outputs, not logits"
        )
    sums = p.sum(axis=1)
    bad = np.abs(sums - 1.0) > PROB_TOL
    if bad.any():
        idx = np.argwhere(bad)[0]
        raise SelectionError(
            f"{name}: probabilities must sum to 1 over axis 1 (tolerance {PROB_TOL}); "
            f"row {int(idx[0])} sums to {float(sums[tuple(idx)]):.6g} ({int(bad.sum())} bad rows); "
            "normalise the scores with a softmax over the answer set"
        )
    return np.clip(p, 0.0, 1.0)


def _entropy(p: np.ndarray, axis: int = 1) -> np.ndarray:
    # 0 * log 0 = 0 by convention; where() keeps log(0) from producing -inf * 0 = NaN.
    logp = np.log(np.where(p > 0, p, 1.0))
    return -(p * logp).sum(axis=axis)


class Heuristic:
    """Scores candidates from one array; `score` returns a float64 [n] vector, higher = more informative.

    `input` names the array a round feeds it (pipeline.selection.heuristic_input reads it, so a new heuristic needs
    no caller that knows its name): "probs" candidate probabilities (MC samples averaged when only they exist),
    "mc_probs" MC-dropout samples, "token_entropy" per-token entropies, "agreement" sampled answers, "meanings" sampled answers grouped by meaning,
    "none" nothing.
    `requires` says which setting produces that input, for the error when it is missing.
    """

    name: str = ""
    input: ClassVar[str] = "probs"
    requires: ClassVar[str] = "closed answers (data.answers)"

    @classmethod
    def from_seed(cls, seed: int) -> Heuristic:
        """An instance for a round with this seed; only heuristics that draw random numbers read it."""
        return cls()

    def score(self, probs: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class Random(Heuristic):
    """Uniform random scores from a seeded generator: the passive-learning baseline."""

    name = "random"
    input = "none"
    requires = "nothing"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    @classmethod
    def from_seed(cls, seed: int) -> Heuristic:
        return cls(seed)

    def score(self, probs: np.ndarray) -> np.ndarray:
        n = len(probs)
        if n == 0:
            raise SelectionError("random: got an empty array; there is nothing to score")
        return np.random.default_rng(self.seed).random(n)


class LeastConfidence(Heuristic):
    """1 - max_c p(c)."""

    name = "least_confidence"

    def score(self, probs: np.ndarray) -> np.ndarray:
        p = _probs(probs, self.name)
        p = p.mean(axis=2) if p.ndim == 3 else p
        return 1.0 - p.max(axis=1)


class Margin(Heuristic):
    """1 - (p_top1 - p_top2): a small gap between the two best answers is an uncertain sample."""

    name = "margin"

    def score(self, probs: np.ndarray) -> np.ndarray:
        p = _probs(probs, self.name)
        p = p.mean(axis=2) if p.ndim == 3 else p
        top2 = np.partition(p, -2, axis=1)[:, -2:]
        return 1.0 - (top2[:, 1] - top2[:, 0])


class Entropy(Heuristic):
    """Shannon entropy of the (MC-averaged) predictive distribution, in nats."""

    name = "entropy"

    def score(self, probs: np.ndarray) -> np.ndarray:
        p = _probs(probs, self.name)
        p = p.mean(axis=2) if p.ndim == 3 else p
        return _entropy(p)


class BALD(Heuristic):
    """Mutual information between prediction and weights (Houlsby et al. 2011): H[mean_k p] - mean_k H[p_k]."""

    name = "bald"
    input = "mc_probs"
    requires = "select.mc_dropout_passes >= 2 and closed answers"

    def score(self, probs: np.ndarray) -> np.ndarray:
        p = _probs(probs, self.name, ndims=(3,))
        if p.shape[2] < 2:
            raise SelectionError(
                f"bald: needs >= 2 MC-dropout samples along axis 2, got shape {p.shape}; "
                "set select.mc_dropout_passes >= 2"
            )
        # Rounding can push the difference a hair below zero for identical samples.
        return np.maximum(_entropy(p.mean(axis=2)) - _entropy(p).mean(axis=1), 0.0)


class TokenEntropy(Heuristic):
    """Mean per-token entropy of a generated answer; NaN marks padding after the answer ended.

    `kind="logprob"` reads the log-probabilities of the generated tokens instead and scores their mean negative
    log-likelihood (a one-sample estimate of the same entropy).
    """

    name = "token_entropy"
    input = "token_entropy"
    requires = "open answers (data.answers: null)"

    def __init__(self, kind: Literal["entropy", "logprob"] = "entropy") -> None:
        if kind not in ("entropy", "logprob"):
            raise SelectionError(f"token_entropy: kind must be 'entropy' or 'logprob', got {kind!r}")
        self.kind = kind

    def score(self, probs: np.ndarray) -> np.ndarray:
        v = _array(probs, self.name, ndims=(2,), allow_nan=True)
        empty = np.isnan(v).all(axis=1)
        if empty.any():
            raise SelectionError(
                f"token_entropy: {int(empty.sum())} of {len(v)} rows have no tokens (all NaN; first at row "
                f"{int(np.argmax(empty))}); quarantine samples whose generation came back empty"
            )
        if self.kind == "entropy" and np.nanmin(v) < -1e-6:
            raise SelectionError(
                f"token_entropy: entropies must be >= 0, got minimum {np.nanmin(v):.4g}; "
                "pass kind='logprob' for token log-probabilities"
            )
        if self.kind == "logprob" and np.nanmax(v) > 1e-6:
            raise SelectionError(f"token_entropy: log-probabilities must be <= 0, got maximum {np.nanmax(v):.4g}")
        return np.nanmean(v if self.kind == "entropy" else -v, axis=1)


class AnswerDisagreement(Heuristic):
    """1 - fraction of the k sampled answers that agree with the modal answer (0 = all k agree)."""

    name = "answer_disagreement"
    input = "agreement"
    requires = "select.mc_dropout_passes >= 2"

    def score(self, probs: np.ndarray) -> np.ndarray:
        a = np.asarray(probs)
        if a.ndim == 1 and a.dtype.kind in "fiub":
            agree = _array(a, self.name, ndims=(1,))
            if agree.min() < 0 or agree.max() > 1:
                raise SelectionError(
                    f"answer_disagreement: agreement fractions must lie in [0, 1], "
                    f"got values in [{agree.min():.4g}, {agree.max():.4g}]"
                )
            return 1.0 - agree
        if a.ndim != 2:
            raise SelectionError(
                f"answer_disagreement: expects [n, k] answer ids or [n] agreement fractions, got shape {a.shape}"
            )
        if a.shape[0] == 0:
            raise SelectionError("answer_disagreement: got an empty array; there is nothing to score")
        if a.shape[1] < 2:
            raise SelectionError(
                f"answer_disagreement: needs >= 2 sampled answers per sample, got shape {a.shape}; "
                "set select.mc_dropout_passes >= 2"
            )
        if a.dtype.kind == "f" and np.isnan(a).any():
            row = int(np.argwhere(np.isnan(a))[0, 0])
            raise SelectionError(f"answer_disagreement: row {row} has a NaN answer id; rescore that sample")
        if a.dtype.kind not in "iufUSb":
            raise SelectionError(f"answer_disagreement: answer ids must be numbers or strings, got dtype {a.dtype}")
        # Sorted rows turn "count of the modal answer" into "longest run of equal neighbours".
        run, _ = _runs(a)
        return 1.0 - run.max(axis=1) / a.shape[1]


class SemanticEntropy(Heuristic):
    """Discrete semantic entropy (Kuhn, Gal & Farquhar, ICLR 2023; Farquhar et al., Nature 2024): the k sampled
    answers are grouped by meaning (pipeline.meaning) and the score is the entropy, in nats, of the groups' shares.

    Unlike answer_disagreement (1 - the modal group's share) it sees how the rest split: of 4 samples, 2 + 1 + 1
    (1.04 nats) ranks above 2 + 2 (ln 2 = 0.69), which answer_disagreement ties (0.5 both), and four different
    meanings (ln 4) rank highest.
    """

    name = "semantic_entropy"
    input = "meanings"
    requires = "select.mc_dropout_passes >= 2"

    def score(self, probs: np.ndarray) -> np.ndarray:
        a = _array(probs, self.name, ndims=(2,))
        if a.shape[1] < 2:
            raise SelectionError(
                f"semantic_entropy: needs >= 2 sampled answers per sample, got shape {a.shape}; "
                "set select.mc_dropout_passes >= 2"
            )
        # Group sizes from runs of equal sorted codes: share = run length / k at each run's last position.
        run, last = _runs(a)
        share = np.where(last, run / a.shape[1], 1.0)
        return -(share * np.log(share)).sum(axis=1)


def _runs(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row sorted into runs of equal codes: (the length of the run so far at each position, whether the
    position ends its run); [n, k] both."""
    s = np.sort(codes, axis=1)
    n, k = s.shape
    change = np.ones((n, k), dtype=bool)
    change[:, 1:] = s[:, 1:] != s[:, :-1]
    pos = np.broadcast_to(np.arange(k), (n, k))
    run = pos - np.maximum.accumulate(np.where(change, pos, 0), axis=1) + 1
    last = np.ones((n, k), dtype=bool)
    last[:, :-1] = change[:, 1:]
    return run, last


def rank(scores: np.ndarray, *, seed: int) -> np.ndarray:
    """Indices by score, highest first; equal scores are ordered by a seeded permutation (stable across runs)."""
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1:
        raise SelectionError(f"rank: scores must be 1-D [n], got shape {s.shape}")
    if np.isnan(s).any():
        raise SelectionError(f"rank: {int(np.isnan(s).sum())} of {len(s)} scores are NaN (first at index "
                             f"{int(np.argmax(np.isnan(s)))})")
    tiebreak = np.random.default_rng(seed).permutation(len(s))
    # lexsort sorts by its last key first.
    return np.lexsort((tiebreak, -s))
