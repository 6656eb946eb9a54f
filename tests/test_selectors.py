"""Batch selectors and select_batch: coverage, round-robin, balance, typicality, exclusions, determinism."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from pipeline.config import SelectConfig
from pipeline.errors import SelectionError
from pipeline.strategies import SELECTORS, k_center_greedy, kmeans_labels, select_batch
from pipeline.strategies.selectors import ClusterMargin, KCenter, Stratified, Typical


def blobs(sizes, *, d=8, spread=40.0, seed=0):
    """Well-separated Gaussian blobs: (points, blob id per point, blob centres)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((len(sizes), d)) * spread
    blob = np.repeat(np.arange(len(sizes)), sizes)
    x = centres[blob] + rng.standard_normal((len(blob), d))
    return x.astype(np.float32), blob, centres


def naive_k_center(x, k, *, first=None, centers=None, weights=None):
    """Textbook greedy core-set in float64: one full distance pass per pick."""
    x = x.astype(np.float64)
    md = np.full(len(x), np.inf)
    picks = []
    for c in [] if centers is None else centers.astype(np.float64):
        md = np.minimum(md, ((x - c) ** 2).sum(1))
    if centers is None:
        picks, md = [first], ((x - x[first]) ** 2).sum(1)
    while len(picks) < k:
        key = md * (1.0 if weights is None else weights)
        key[picks] = -np.inf
        picks.append(int(np.argmax(key)))
        md = np.minimum(md, ((x - x[picks[-1]]) ** 2).sum(1))
    return picks


def test_names_cover_config_choices():
    assert set(SelectConfig.model_fields["diversity"].annotation.__args__) <= set(SELECTORS)
    assert "typical" in SELECTORS and "typical" in SelectConfig.model_fields["cold_start"].annotation.__args__


# ------------------------------------------------------------------------------------------------ k-center
def test_k_center_picks_one_per_blob():
    x, blob, _ = blobs([40] * 5)
    scores = np.random.default_rng(1).random(len(x))
    picks = KCenter().select(5, scores=scores, embeddings=x, seed=0)
    assert sorted(blob[picks]) == [0, 1, 2, 3, 4]
    assert picks[0] == np.argmax(scores)  # no labels: start from the most uncertain sample


def test_k_center_starts_from_labeled_centres():
    x, blob, _ = blobs([40] * 5)
    labeled = x[blob < 3][::7] + 0.01
    picks = KCenter().select(2, scores=np.zeros(len(x)), embeddings=x, seed=0, labeled_embeddings=labeled)
    assert sorted(blob[picks]) == [3, 4]


@pytest.mark.parametrize("case", ["first", "labeled", "weighted"])
def test_lazy_k_center_equals_naive_greedy(case):
    rng = np.random.default_rng({"first": 0, "labeled": 1, "weighted": 2}[case])
    # Anisotropic data over 3,000 rows: several blocks, stale bounds, and block growth all get exercised.
    x = (rng.standard_normal((3000, 12)) * rng.random(12) * 3).astype(np.float32)
    kw = {
        "first": {"first": 17},
        "labeled": {"centers": rng.standard_normal((40, 12)).astype(np.float32)},
        "weighted": {"first": 3, "weights": rng.random(3000)},
    }[case]
    got = k_center_greedy(x, 150, **kw)
    assert got.tolist() == naive_k_center(x, 150, **kw)


def test_k_center_uncertainty_options():
    x, blob, _ = blobs([40] * 5)
    scores = np.where(blob == 4, 0.0, 0.5) + np.random.default_rng(0).random(len(x)) * 0.01 * (blob != 4)
    plain = KCenter().select(5, scores=scores, embeddings=x, seed=0)
    product = KCenter("product").select(5, scores=scores, embeddings=x, seed=0)
    assert 4 in blob[plain]
    assert 4 not in blob[product]  # a certain blob is never worth visiting
    assert sorted(set(blob[product[:4]])) == [0, 1, 2, 3]
    top_m = KCenter("top_m", top_m_factor=3).select(5, scores=scores, embeddings=x, seed=0)
    assert set(top_m) <= set(np.argsort(-scores)[:15])


def test_k_center_errors_name_shapes():
    x, _, _ = blobs([10, 10])
    with pytest.raises(SelectionError, match=r"\[20, d\].*\(19, 8\)"):
        KCenter().select(2, scores=np.zeros(20), embeddings=x[:19], seed=0)
    with pytest.raises(SelectionError, match=r"\[m, 8\].*\(3, 5\)"):
        KCenter().select(2, scores=np.zeros(20), embeddings=x, seed=0, labeled_embeddings=np.zeros((3, 5)))
    bad = x.copy()
    bad[7, 2] = np.nan
    with pytest.raises(SelectionError, match="first at row 7"):
        KCenter().select(2, scores=np.zeros(20), embeddings=bad, seed=0)
    with pytest.raises(SelectionError, match="cannot pick 21 of 20"):
        KCenter().select(21, scores=np.zeros(20), embeddings=x, seed=0)


# ------------------------------------------------------------------------------------------ cluster-margin
def test_cluster_margin_round_robins_smallest_cluster_first():
    x, blob, _ = blobs([6, 20, 60])
    scores = np.random.default_rng(3).random(len(x))
    picks = ClusterMargin(n_clusters=3, margin_factor=100).select(9, scores=scores, embeddings=x, seed=0)
    # Three rounds, each visiting the clusters smallest first, each time the most uncertain one left.
    assert blob[picks].tolist() == [0, 1, 2] * 3
    for b in range(3):
        mine = picks[blob[picks] == b]
        assert mine.tolist() == np.argsort(-np.where(blob == b, scores, -1))[:3].tolist()


def test_cluster_margin_takes_only_the_top_uncertain():
    x, blob, _ = blobs([30, 30, 30, 30])
    scores = np.where(blob == 3, 0.9, 0.1) + np.random.default_rng(0).random(len(x)) * 0.01
    scores[blob == 2] = 0.5 + np.random.default_rng(1).random(30) * 0.01
    picks = ClusterMargin(n_clusters=4, margin_factor=5).select(8, scores=scores, embeddings=x, seed=0)
    # Top 40: the 30 of blob 3 and the 10 best of blob 2; blob 2 holds fewer of them, so it goes first.
    assert blob[picks].tolist() == [2, 3] * 4


# ---------------------------------------------------------------------------------------------- stratified
def test_stratified_balances_classes():
    rng = np.random.default_rng(0)
    pred = np.repeat(["cat", "dog", "emu"], [80, 15, 5])
    scores = rng.random(100)
    even = Stratified().select(12, scores=scores, predicted=pred, seed=0)
    assert sorted(np.unique(pred[even], return_counts=True)[1]) == [4, 4, 4]
    for c in ("cat", "dog", "emu"):  # the most uncertain of each class
        got = set(even[pred[even] == c])
        assert got == set(np.argsort(-np.where(pred == c, scores, -1))[:4])
    assert np.all(np.diff(scores[even]) <= 0)  # returned in score order
    # emu has only 5: its surplus goes to the others, which stay within one of each other.
    counts = dict(zip(*np.unique(pred[Stratified().select(24, scores=scores, predicted=pred, seed=0)],
                                 return_counts=True), strict=True))
    assert counts["emu"] == 5 and abs(counts["cat"] - counts["dog"]) <= 1 and sum(counts.values()) == 24
    prop = Stratified("proportional").select(20, scores=scores, predicted=pred, seed=0)
    assert np.unique(pred[prop], return_counts=True)[1].tolist() == [16, 3, 1]


def test_stratified_needs_predictions():
    with pytest.raises(SelectionError, match="predicted"):
        Stratified().select(2, scores=np.zeros(5), seed=0)
    with pytest.raises(SelectionError, match=r"\(5,\).*\(4,\)"):
        Stratified().select(2, scores=np.zeros(5), predicted=np.zeros(4), seed=0)


# ------------------------------------------------------------------------------------------------ typical
def test_typical_picks_one_central_point_per_cluster():
    x, blob, centres = blobs([80] * 5)
    picks = Typical().select(5, scores=np.zeros(len(x)), embeddings=x, seed=0)
    assert sorted(blob[picks]) == [0, 1, 2, 3, 4]
    for p in picks:
        dist = np.linalg.norm(x[blob == blob[p]] - centres[blob[p]], axis=1)
        assert np.linalg.norm(x[p] - centres[blob[p]]) <= np.quantile(dist, 0.2)


def test_typical_samples_large_clusters():
    x, blob, _ = blobs([300, 300])
    picks = Typical(max_cluster_points=50).select(2, scores=np.zeros(600), embeddings=x, seed=0)
    assert sorted(blob[picks]) == [0, 1]


def test_kmeans_is_seeded():
    x, blob, _ = blobs([50] * 4, d=16)
    a, b = kmeans_labels(x, 4, seed=7), kmeans_labels(x, 4, seed=7)
    np.testing.assert_array_equal(a, b)
    assert len(set(zip(a.tolist(), blob.tolist(), strict=True))) == 4  # the blobs are recovered


# ------------------------------------------------------------------------------------------- select_batch
def _pool(n=100, c=3, seed=0):
    rng = np.random.default_rng(seed)
    ids = [f"s{i:04d}" for i in range(n)]
    probs = rng.dirichlet(np.ones(c), size=n)
    emb = rng.standard_normal((n, 8)).astype(np.float32)
    return ids, probs, emb, probs.argmax(axis=1)


@pytest.mark.parametrize("diversity", sorted(SELECTORS))
def test_select_batch_is_deterministic_and_order_free(diversity):
    ids, probs, emb, pred = _pool()
    kw = dict(k=10, strategy="margin", diversity=diversity, seed=5, exclude={"s0003", "s0050"})
    a = select_batch(ids, probs=probs, embeddings=emb, predicted=pred, **kw)
    b = select_batch(ids, probs=probs, embeddings=emb, predicted=pred, **kw)
    perm = np.random.default_rng(9).permutation(len(ids))
    c = select_batch([ids[i] for i in perm], probs=probs[perm], embeddings=emb[perm], predicted=pred[perm], **kw)
    assert a.ids == b.ids == c.ids
    assert len(set(a.ids)) == 10 and a.ranks == list(range(1, 11))
    assert [ids[p] for p in a.positions] == a.ids
    assert not {"s0003", "s0050"} & set(a.ids)


def test_select_batch_honours_exclusions():
    ids, probs, emb, _ = _pool()
    scores = -np.sort(-(1 - probs.max(axis=1)))
    best = [ids[i] for i in np.argsort(-(1 - probs.max(axis=1)))[:5]]
    sel = select_batch(ids, k=5, strategy="least_confidence", diversity="top_k", probs=probs, exclude=set(best),
                       seed=0)
    assert not set(best) & set(sel.ids)
    np.testing.assert_allclose(sel.scores, scores[5:10])
    assert sel.rows()[0] == {"sample_id": sel.ids[0], "rank": 1, "score": sel.scores[0],
                             "strategy": "least_confidence", "diversity": "top_k"}


def test_pool_exhausted_names_the_numbers(caplog):
    ids, probs, _, _ = _pool(62)
    with pytest.raises(SelectionError, match=r"^Pool exhausted: 12 unlabeled samples left, 50 requested"):
        select_batch(ids, k=50, strategy="entropy", diversity="top_k", probs=probs, exclude=set(ids[:50]), seed=0)
    with caplog.at_level(logging.WARNING, logger="pipeline.strategies.pool"):
        sel = select_batch(ids, k=50, strategy="entropy", diversity="top_k", probs=probs, exclude=set(ids[:50]),
                           seed=0, allow_partial=True)
    assert sorted(sel.ids) == ids[50:]
    assert "12 unlabeled samples left" in caplog.text


def test_cold_start_and_input_errors():
    ids, probs, emb, _ = _pool(40)
    cold = select_batch(ids, k=4, strategy="entropy", diversity="typical", embeddings=emb, seed=0)
    assert len(cold.ids) == 4
    rnd = select_batch(ids, k=4, strategy="random", diversity="top_k", seed=0)
    assert rnd.ids == select_batch(ids, k=4, strategy="random", diversity="top_k", seed=0).ids
    assert rnd.ids != select_batch(ids, k=4, strategy="random", diversity="top_k", seed=1).ids
    with pytest.raises(SelectionError, match="diversity='typical'"):
        select_batch(ids, k=4, strategy="entropy", diversity="top_k", seed=0)
    with pytest.raises(SelectionError, match=r"probs has shape \(39, 3\) but there are 40"):
        select_batch(ids, k=4, strategy="entropy", diversity="top_k", probs=probs[:39], seed=0)
    with pytest.raises(SelectionError, match="'s0001' appears 2 times"):
        select_batch(ids + ["s0001"], k=4, strategy="random", diversity="top_k", seed=0)
    with pytest.raises(SelectionError, match="unknown diversity 'kcenter'"):
        select_batch(ids, k=4, strategy="entropy", diversity="kcenter", probs=probs, seed=0)
    with pytest.raises(SelectionError, match="bad options"):
        select_batch(ids, k=4, strategy="entropy", diversity="k_center", probs=probs, embeddings=emb, seed=0,
                     options={"uncertainy": "product"})
