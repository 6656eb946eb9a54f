"""Selection over pools too big for a pass per pick: blocked k-center, float16 / memory-mapped embeddings,
MaxHerding on a sample of its pool average."""

from __future__ import annotations

import numpy as np
import pytest

import pipeline.strategies.base as base
import pipeline.strategies.selectors as selectors
from pipeline.errors import SelectionError
from pipeline.strategies.base import check_embeddings
from pipeline.strategies.blocked import BlockedRows
from pipeline.strategies.coverage import MaxHerding
from pipeline.strategies.selectors import KCenter
from tests.test_selectors import naive_k_center


def mixture(n, *, d=16, clusters=30, spread=0.3, seed=0):
    """Gaussian clusters: the structure k-means blocks and triangle bounds can use."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, d))
    return (centres[rng.integers(0, clusters, n)] + spread * rng.standard_normal((n, d))).astype(np.float32)


@pytest.mark.parametrize("case", ["first", "labeled", "weighted"])
def test_blocked_k_center_is_the_exact_greedy(case):
    x = mixture(4000, seed={"first": 0, "labeled": 1, "weighted": 2}[case])
    rng = np.random.default_rng(5)
    kw = {
        "first": {"first": 11},
        "labeled": {"centers": x[rng.choice(len(x), 60, replace=False)] + 0.05},
        "weighted": {"first": 3, "weights": (rng.random(len(x)) + 0.5).astype(np.float32)},
    }[case]
    rows = BlockedRows(x, seed=0, block_rows=100)
    assert rows.n_blocks >= 40
    picks, info = rows.k_center(120, **kw)
    assert picks.tolist() == naive_k_center(x, 120, **kw)
    # The bounds are what makes it scale: far fewer distances than one pass over the pool per pick.
    assert info["distance_share"] < 0.5
    if case != "weighted":
        xs = x.astype(np.float64)
        c = np.concatenate([kw.get("centers", np.empty((0, x.shape[1]))), x[picks]])
        exact = np.sqrt(((xs[:, None, :] - c[None].astype(np.float64)) ** 2).sum(-1).min(1).max())
        assert info["radius"] == pytest.approx(exact, rel=1e-4)


def test_radius_of_a_batch_is_its_covering_radius():
    x = mixture(3000, seed=3)
    c = x[np.random.default_rng(0).choice(len(x), 200, replace=False)]
    exact = np.sqrt(((x[:, None, :] - c[None]) ** 2).sum(-1).min(1).max())
    assert BlockedRows(x, seed=1, block_rows=64).radius_of(c) == pytest.approx(exact, rel=1e-4)


def test_k_center_reads_a_float16_memmap_in_place(tmp_path, monkeypatch):
    x16 = mixture(6000, seed=4).astype(np.float16)
    path = tmp_path / "emb.npy"
    np.save(path, x16)
    mm = np.load(path, mmap_mode="r")
    assert check_embeddings(mm, len(mm), "k_center", keep_float16=True) is mm  # no float32 copy of the pool
    monkeypatch.setattr(selectors, "BLOCKED_MIN", 1000)
    scores = np.random.default_rng(0).random(len(mm))
    sel = KCenter()
    picks = sel.select(80, scores=scores, embeddings=mm, seed=0)
    assert sel.info["blocks"] > 1  # it went through the blocked search
    monkeypatch.setattr(selectors, "BLOCKED_MIN", 10**9)
    dense = KCenter().select(80, scores=scores, embeddings=x16.astype(np.float32), seed=0)
    assert picks.tolist() == dense.tolist()


def test_float16_is_copied_for_selectors_that_compute_densely():
    x16 = mixture(50, seed=0).astype(np.float16)
    e = check_embeddings(x16, 50, "typiclust")
    assert e.dtype == np.float32 and e.flags.c_contiguous


def test_non_finite_rows_are_counted_across_chunks(monkeypatch):
    monkeypatch.setattr(base, "_FINITE_CHUNK", 100)
    x = mixture(1000, seed=0).astype(np.float16)
    x[250, 3] = np.inf
    x[730, 0] = np.nan
    x[731, 1] = np.nan
    with pytest.raises(SelectionError, match=r"3 embedding rows contain NaN/inf \(first at row 250\)"):
        check_embeddings(x, 1000, "k_center", keep_float16=True)


def test_blocked_k_center_refuses_what_it_cannot_do():
    with pytest.raises(SelectionError, match="shape"):
        BlockedRows(np.empty((0, 4), np.float32), seed=0)
    rows = BlockedRows(mixture(50), seed=0, block_rows=10)
    with pytest.raises(SelectionError, match="labeled centres or a first pick"):
        rows.k_center(5)
    with pytest.raises(SelectionError, match="cannot pick 51 of 50"):
        rows.k_center(51, first=0)


def test_maxherding_above_max_points_herds_a_uniform_sample():
    x = mixture(6000, seed=6)
    lab = x[:40] + 0.01
    scores = np.zeros(len(x))
    whole = MaxHerding()
    full = whole.select(60, scores=scores, embeddings=x, seed=0, labeled_embeddings=lab)
    assert "sampled" not in whole.info
    sampled = MaxHerding(max_points=2000)
    picks = sampled.select(60, scores=scores, embeddings=x, seed=0, labeled_embeddings=lab)
    info = sampled.info["sampled"]
    assert info["candidates"] == 6000 and info["kept"] == 2000 - 40  # every labeled point stays
    assert len(set(picks.tolist())) == 60 and picks.max() < len(x)
    # The same seed draws the same sample: the picks are its rows, and a second run repeats them.
    again = MaxHerding(max_points=2000).select(60, scores=scores, embeddings=x, seed=0, labeled_embeddings=lab)
    assert picks.tolist() == again.tolist()
    # A sample of a third of the pool still covers it nearly as well as herding the whole pool.
    sigma = whole.info["bandwidth"]

    def coverage(p):
        d2 = ((x[:, None, :] - np.concatenate([x[p], lab])[None]) ** 2).sum(-1).min(1)
        return np.exp(-d2 / (2 * sigma**2)).mean()

    rand = np.random.default_rng(1).choice(len(x), 60, replace=False)
    assert coverage(picks) > coverage(rand)
    assert coverage(picks) > 0.95 * coverage(full)
    with pytest.raises(SelectionError, match="max_points"):
        MaxHerding(max_points=1)
