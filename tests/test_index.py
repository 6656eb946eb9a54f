"""The selection-space neighbour index (pipeline.strategies.index): exact below its stated size, approximate kinds
checked against exact search (a brute-force numpy reference) on a small mixture."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.errors import SelectionError
from pipeline.strategies.index import NeighborIndex, recall_at_k


def mixture(n: int = 3000, d: int = 16, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 4, (30, d))
    return (centres[rng.integers(0, 30, n)] + rng.normal(0, 1, (n, d))).astype(np.float32)


def brute(x: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
    d = ((q[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    return np.argsort(d, axis=1, kind="stable")[:, :k]


def test_auto_is_exact_below_the_stated_size_and_approximate_above():
    x = mixture()
    q = x[:50] + 0.01
    flat = NeighborIndex(x)
    assert flat.kind == "flat"
    d, i = flat.search(q, 5)
    np.testing.assert_array_equal(i, brute(x, q, 5))
    assert (np.diff(d, axis=1) >= 0).all()
    assert NeighborIndex(x, exact_max=1000).kind == "ivf"


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_approximate_kinds_find_most_true_neighbours(kind):
    x = mixture()
    q = x[np.random.default_rng(1).choice(len(x), 100, replace=False)]
    _, found = NeighborIndex(x, kind=kind, nprobe=8).search(q, 10)
    assert recall_at_k(found, brute(x, q, 10)) >= 0.9


def test_fewer_rows_than_k_pad_with_minus_one_and_bad_shapes_are_named():
    x = mixture(4)
    d, i = NeighborIndex(x).search(x[:2], 6)
    assert (i[:, 4:] == -1).all() and np.isinf(d[:, 4:]).all()
    assert recall_at_k(np.array([[0, 1, -1]]), np.array([[1, 0, 2]])) == pytest.approx(2 / 3)
    with pytest.raises(SelectionError, match=r"\[n, d\]"):
        NeighborIndex(np.zeros(5, np.float32))
