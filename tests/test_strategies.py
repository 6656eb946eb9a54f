"""Uncertainty heuristics: one shared contract every heuristic in HEURISTICS passes, then per-heuristic facts."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from pipeline.config import SelectConfig
from pipeline.errors import SelectionError
from pipeline.strategies import HEURISTICS, get_heuristic, rank

NAN = float("nan")
U3 = [1 / 3, 1 / 3, 1 / 3]
ONE_HOT = [1.0, 0.0, 0.0]

# Per heuristic: rows from most to least informative, one row to repeat for ties, an input that is invalid
# because of NaN, and one with the wrong number of dimensions. Random has no ordering: it ignores the values.
CASES: dict[str, dict[str, object]] = {
    "random": {"ordered": None, "tie": [0.5, 0.5], "nan": None, "bad_ndim": None},
    **{
        name: {
            "ordered": [U3, [0.5, 0.3, 0.2], [0.8, 0.15, 0.05], ONE_HOT],
            "tie": U3,
            "nan": [U3, [NAN, 0.5, 0.5]],
            "bad_ndim": [0.2, 0.8],
        }
        for name in ("least_confidence", "margin", "entropy")
    },
    "bald": {
        # [n, c, k]: one-hot samples that disagree > partly disagree > agree (aleatoric uncertainty is not BALD's).
        "ordered": [
            [[1, 0], [0, 1], [0, 0]],
            [[1, 0.5], [0, 0.5], [0, 0]],
            [[1 / 3, 1 / 3], [1 / 3, 1 / 3], [1 / 3, 1 / 3]],
        ],
        "tie": [[1, 0], [0, 1], [0, 0]],
        "nan": [[[0.5, 0.5], [0.5, 0.5]], [[NAN, 0.5], [0.5, 0.5]]],
        "bad_ndim": [U3],
    },
    "token_entropy": {
        "ordered": [[2.0, 2.0, NAN], [1.0, 0.5, 0.0], [0.1, NAN, NAN], [0.0, 0.0, 0.0]],
        "tie": [1.0, NAN, 1.0],
        "nan": [[1.0, 2.0], [NAN, NAN]],
        "bad_ndim": [[[1.0]]],
    },
    "answer_disagreement": {
        "ordered": [[0, 1, 2, 3], [0, 0, 1, 2], [4, 4, 4, 1], [7, 7, 7, 7]],
        "tie": [3, 3, 1, 2],
        "nan": [[1.0, 2.0], [1.0, NAN]],
        "bad_ndim": [[[1, 2]]],
    },
    "semantic_entropy": {
        # four meanings (ln 4) > 2 + 1 + 1 (1.04) > 2 + 2 (ln 2) > 3 + 1 (0.56) > one meaning (0)
        "ordered": [[0, 1, 2, 3], [0, 0, 1, 2], [5, 5, 6, 6], [4, 4, 4, 1], [7, 7, 7, 7]],
        "tie": [3, 3, 1, 2],
        "nan": [[1.0, 2.0], [1.0, NAN]],
        "bad_ndim": [[[1, 2]]],
    },
}


def test_names_match_config_literal():
    allowed = SelectConfig.model_fields["strategy"].annotation.__args__
    assert set(HEURISTICS) == set(allowed) == set(CASES)


@pytest.mark.parametrize("name", sorted(HEURISTICS))
class TestHeuristicContract:
    def test_shape_and_dtype(self, name):
        rows = CASES[name]["ordered"] or [[0.1, 0.9]] * 4
        s = get_heuristic(name, seed=0).score(np.asarray(rows))
        assert s.shape == (len(rows),)
        assert s.dtype == np.float64
        assert np.isfinite(s).all()

    def test_ordering_on_hand_made_rows(self, name):
        h = get_heuristic(name, seed=3)
        if CASES[name]["ordered"] is None:
            # Random ignores the values: same n and seed, same scores, whatever the input.
            a, b = h.score(np.zeros((5, 2))), h.score(np.ones((5, 7)))
            np.testing.assert_array_equal(a, b)
            assert len(set(a.tolist())) == 5
            return
        s = h.score(np.asarray(CASES[name]["ordered"], dtype=float))
        assert (np.diff(s) <= 0).all(), s
        assert s[0] > s[-1]
        np.testing.assert_array_equal(rank(s, seed=0), np.arange(len(s)))

    def test_ties_broken_by_seeded_rng(self, name):
        rows = np.asarray([CASES[name]["tie"]] * 8)
        s = get_heuristic(name, seed=1).score(rows)
        if name == "random":
            assert len(set(s.tolist())) == 8  # no ties to break; the draw itself is the order
            np.testing.assert_array_equal(s, get_heuristic(name, seed=1).score(rows))
            return
        assert len(set(s.tolist())) == 1
        orders = {tuple(rank(s, seed=seed).tolist()) for seed in range(6)}
        assert all(sorted(o) == list(range(8)) for o in orders)
        assert len(orders) > 1  # the seed decides the order...
        np.testing.assert_array_equal(rank(s, seed=4), rank(s, seed=4))  # ...deterministically

    def test_empty_input_is_an_error(self, name):
        empty = np.zeros((0, 3, 2)) if name == "bald" else np.zeros((0, 3))
        with pytest.raises(SelectionError, match="empty"):
            get_heuristic(name, seed=0).score(empty)

    def test_nan_input_is_an_error(self, name):
        bad = CASES[name]["nan"]
        if bad is None:
            assert get_heuristic(name, seed=0).score(np.full((3, 2), NAN)).shape == (3,)
            return
        with pytest.raises(SelectionError, match=r"row 1\b"):
            get_heuristic(name, seed=0).score(np.asarray(bad))

    def test_wrong_ndim_is_an_error(self, name):
        bad = CASES[name]["bad_ndim"]
        if bad is None:
            assert get_heuristic(name, seed=0).score(np.zeros((2, 2, 2, 2))).shape == (2,)
            return
        arr = np.asarray(bad)
        with pytest.raises(SelectionError, match=re.escape(str(arr.shape))):
            get_heuristic(name, seed=0).score(arr)


def _bald_rows() -> np.ndarray:
    return np.asarray(CASES["bald"]["ordered"], dtype=float)


def test_closed_form_values():
    p = np.array([U3, [0.6, 0.3, 0.1], ONE_HOT])
    np.testing.assert_allclose(get_heuristic("entropy").score(p)[[0, 2]], [math.log(3), 0.0], atol=1e-12)
    np.testing.assert_allclose(get_heuristic("least_confidence").score(p), [2 / 3, 0.4, 0.0])
    np.testing.assert_allclose(get_heuristic("margin").score(p), [1.0, 0.7, 0.0])
    # Two certain but contradicting MC samples: BALD = log 2 (all uncertainty is epistemic).
    np.testing.assert_allclose(get_heuristic("bald").score(_bald_rows()[:1]), [math.log(2)])
    np.testing.assert_allclose(get_heuristic("answer_disagreement").score(np.array([[0, 0, 1, 2]])), [0.5])


def test_mc_samples_are_averaged_for_probability_heuristics():
    rng = np.random.default_rng(0)
    mc = rng.dirichlet(np.ones(4), size=(6, 5)).transpose(0, 2, 1)  # [n, c, k]
    for name in ("least_confidence", "margin", "entropy"):
        h = get_heuristic(name)
        np.testing.assert_allclose(h.score(mc), h.score(mc.mean(axis=2)))


def test_probabilities_must_sum_to_one():
    with pytest.raises(SelectionError, match=r"row 1 sums to 1\.5"):
        get_heuristic("entropy").score(np.array([[0.5, 0.5], [0.9, 0.6]]))
    with pytest.raises(SelectionError, match="logits"):
        get_heuristic("margin").score(np.array([[2.5, -1.5]]))
    # fp16 softmax rounding is tolerated
    assert get_heuristic("entropy").score(np.array([[0.5, 0.5004]])).shape == (1,)


def test_bald_needs_mc_samples():
    with pytest.raises(SelectionError, match="mc_dropout_passes"):
        get_heuristic("bald").score(np.ones((3, 2, 1)) / 2)


def test_token_entropy_logprob_kind():
    from pipeline.strategies.heuristics import TokenEntropy

    lp = np.log(np.array([[0.5, 0.25, NAN], [0.9, 0.9, 0.9]]))
    np.testing.assert_allclose(TokenEntropy("logprob").score(lp), [(math.log(2) + math.log(4)) / 2, -math.log(0.9)])
    with pytest.raises(SelectionError, match="kind='logprob'"):
        TokenEntropy().score(lp)


def test_answer_disagreement_strings_and_fractions():
    h = get_heuristic("answer_disagreement")
    ans = np.array([["a cat", "a cat", "a dog"], ["two", "two", "two"]])
    np.testing.assert_allclose(h.score(ans), [1 / 3, 0.0])
    np.testing.assert_allclose(h.score(np.array([1.0, 0.25])), [0.0, 0.75])
    with pytest.raises(SelectionError, match=r"\[0, 1\]"):
        h.score(np.array([1.5]))


def test_unknown_strategy_lists_choices():
    with pytest.raises(SelectionError, match="unknown strategy 'entropie'.*'entropy'"):
        get_heuristic("entropie")


def test_rank_rejects_nan():
    with pytest.raises(SelectionError, match="1 of 3 scores are NaN"):
        rank(np.array([0.1, NAN, 0.3]), seed=0)


def test_semantic_entropy_values_and_meaning_groups():
    """Entropy in nats over the groups' shares; answers that mean the same (case, articles, number words) group."""
    from pipeline.meaning import meaning_codes, meaning_key

    se = get_heuristic("semantic_entropy")
    got = se.score(np.array([[0, 0, 1, 1], [0, 0, 0, 1], [0, 1, 2, 3]]))
    assert got == pytest.approx([math.log(2), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)), math.log(4)])
    assert meaning_key("The Seven.") == meaning_key("7") == "7"
    assert meaning_key("odd") != meaning_key("even")
    codes = meaning_codes([["Seven.", "7", "the seven", "six"], ["odd", "Odd!", "an odd", "odd"]])
    assert se.score(codes).tolist() == pytest.approx([-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)), 0.0])
    # answer_disagreement on the same codes sees only the modal share: 2 + 2 and 2 + 1 + 1 tie there, not here.
    ad = get_heuristic("answer_disagreement")
    pair, split = np.array([[0, 0, 1, 1]]), np.array([[0, 0, 1, 2]])
    assert ad.score(pair) == ad.score(split)
    assert se.score(split) > se.score(pair)


def test_semantic_entropy_needs_two_samples():
    with pytest.raises(SelectionError, match="mc_dropout_passes >= 2"):
        get_heuristic("semantic_entropy").score(np.array([[1], [2]]))
