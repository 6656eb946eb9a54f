"""Batch selectors and select_batch: coverage, round-robin, balance, typicality, exclusions, determinism."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from pipeline.config import SelectConfig
from pipeline.errors import SelectionError
from pipeline.strategies import SELECTORS, Candidates, k_center_greedy, kmeans_labels, select_batch
from pipeline.strategies.coverage import Blocks, MaxHerding, ProbCover, TypiClust, UncertaintyHerding
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
    assert set(SelectConfig.model_fields["cold_start"].annotation.__args__) - {"random"} <= set(SELECTORS)


# -------------------------------------------------------------------------------- contract of every selector
def _make(name: str):
    """A selector with the round's facts it asks for (`wants`)."""
    facts = {"n_classes": 3, "box_labels": ["a", "b", "c"]}
    return SELECTORS[name](**{f: facts[f] for f in SELECTORS[name].wants})


@pytest.mark.parametrize("name", sorted(SELECTORS))
class TestSelectorContract:
    """What select_batch relies on, for every registered selector: one class, so a new selector is checked too."""

    N = 120

    def _args(self, labeled: bool = False, seed: int = 0, name: str = "") -> dict:
        x, blob, _ = blobs([30] * 4)
        rng = np.random.default_rng(seed)
        predicted = blob % 3
        if name and SELECTORS[name].reads_predicted == "box_counts":  # [n, 3]: boxes per class in each answer
            predicted = np.stack([(blob % 3 == c) + (blob == c) for c in range(3)], axis=1).astype(int)
        return dict(scores=rng.random(self.N), embeddings=x, predicted=predicted, seed=3,
                    labeled_embeddings=x[::17] + 0.01 if labeled else None)

    @pytest.mark.parametrize("labeled", [False, True])
    def test_k_unique_indices_in_range(self, name, labeled):
        sel = _make(name)
        assert sel.info == {}
        picks = sel.select(10, **self._args(labeled, name=name))
        assert picks.dtype.kind == "i" and picks.shape == (10,)
        assert len(set(picks.tolist())) == 10 and 0 <= picks.min() and picks.max() < self.N
        assert isinstance(sel.info, dict)

    def test_deterministic_for_a_seed(self, name):
        a = _make(name).select(12, **self._args(True, name=name))
        b = _make(name).select(12, **self._args(True, name=name))
        np.testing.assert_array_equal(a, b)

    def test_k_equals_n_returns_every_candidate(self, name):
        picks = _make(name).select(self.N, **self._args(name=name))
        assert sorted(picks.tolist()) == list(range(self.N))

    def test_k_beyond_n_names_the_numbers(self, name):
        with pytest.raises(SelectionError, match=rf"cannot pick {self.N + 1} of {self.N}"):
            _make(name).select(self.N + 1, **self._args(name=name))
        with pytest.raises(SelectionError, match="cannot pick 0 of"):
            _make(name).select(0, **self._args(name=name))



@pytest.mark.parametrize("name", sorted(n for n, cls in SELECTORS.items() if not cls.needs_scores))
def test_scoreless_selectors_ignore_scores(name):
    contract = TestSelectorContract()
    a = SELECTORS[name]().select(8, **contract._args(seed=0))
    b = SELECTORS[name]().select(8, **contract._args(seed=1))  # other scores, same embeddings and seed
    np.testing.assert_array_equal(a, b)


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
    kw = dict(k=10, strategy="margin", diversity=diversity, seed=5)
    if SELECTORS[diversity].reads_predicted == "box_counts":  # boxes per class in each answer, and the class list
        pred = np.stack([pred == c for c in range(probs.shape[1])], axis=1).astype(int) * 2
        kw["options"] = {"box_labels": [str(c) for c in range(probs.shape[1])]}
    out = {"s0003", "s0050"}
    a = select_batch(Candidates(ids, probs=probs, embeddings=emb, predicted=pred, exclude=out), **kw)
    b = select_batch(Candidates(ids, probs=probs, embeddings=emb, predicted=pred, exclude=out), **kw)
    perm = np.random.default_rng(9).permutation(len(ids))
    c = select_batch(Candidates([ids[i] for i in perm], probs=probs[perm], embeddings=emb[perm], predicted=pred[perm],
                                exclude=out), **kw)
    assert a.ids == b.ids == c.ids
    assert len(set(a.ids)) == 10 and a.ranks == list(range(1, 11))
    assert [ids[p] for p in a.positions] == a.ids
    assert not {"s0003", "s0050"} & set(a.ids)


def test_select_batch_honours_exclusions():
    ids, probs, emb, _ = _pool()
    scores = -np.sort(-(1 - probs.max(axis=1)))
    best = [ids[i] for i in np.argsort(-(1 - probs.max(axis=1)))[:5]]
    sel = select_batch(Candidates(ids, probs=probs, exclude=set(best)), k=5, strategy="least_confidence", diversity="top_k",
                       seed=0)
    assert not set(best) & set(sel.ids)
    np.testing.assert_allclose(sel.scores, scores[5:10])
    assert sel.rows()[0] == {"sample_id": sel.ids[0], "rank": 1, "score": sel.scores[0],
                             "strategy": "least_confidence", "diversity": "top_k"}


def test_pool_exhausted_names_the_numbers(caplog):
    ids, probs, _, _ = _pool(62)
    with pytest.raises(SelectionError, match=r"^Pool exhausted: 12 unlabeled samples left, 50 requested"):
        select_batch(Candidates(ids, probs=probs, exclude=set(ids[:50])), k=50, strategy="entropy", diversity="top_k", seed=0)
    with caplog.at_level(logging.WARNING, logger="pipeline.strategies.pool"):
        sel = select_batch(Candidates(ids, probs=probs, exclude=set(ids[:50])), k=50, strategy="entropy", diversity="top_k",
                           seed=0, allow_partial=True)
    assert sorted(sel.ids) == ids[50:]
    assert "12 unlabeled samples left" in caplog.text


def test_cold_start_and_input_errors():
    ids, probs, emb, _ = _pool(40)
    cold = select_batch(Candidates(ids, embeddings=emb), k=4, strategy="entropy", diversity="typical", seed=0)
    assert len(cold.ids) == 4
    rnd = select_batch(Candidates(ids), k=4, strategy="random", diversity="top_k", seed=0)
    assert rnd.ids == select_batch(Candidates(ids), k=4, strategy="random", diversity="top_k", seed=0).ids
    assert rnd.ids != select_batch(Candidates(ids), k=4, strategy="random", diversity="top_k", seed=1).ids
    with pytest.raises(SelectionError, match=r"needs no scores \('maxherding', 'probcover', 'typical', 'typiclust'\)"):
        select_batch(Candidates(ids), k=4, strategy="entropy", diversity="top_k", seed=0)
    with pytest.raises(SelectionError, match=r"probs has shape \(39, 3\) but there are 40"):
        select_batch(Candidates(ids, probs=probs[:39]), k=4, strategy="entropy", diversity="top_k", seed=0)
    with pytest.raises(SelectionError, match="'s0001' appears 2 times"):
        select_batch(Candidates(ids + ["s0001"]), k=4, strategy="random", diversity="top_k", seed=0)
    with pytest.raises(SelectionError, match="unknown diversity 'kcenter'"):
        select_batch(Candidates(ids, probs=probs), k=4, strategy="entropy", diversity="kcenter", seed=0)
    with pytest.raises(SelectionError, match="bad options"):
        select_batch(Candidates(ids, probs=probs, embeddings=emb), k=4, strategy="entropy", diversity="k_center", seed=0,
                     options={"uncertainy": "product"})


# ------------------------------------------------------------------------------ coverage selectors (low budget)
COVERAGE = {"typiclust": TypiClust, "probcover": ProbCover, "maxherding": MaxHerding}


def noisy_blobs(n_blobs=5, per=60, noise=30, *, d=8, seed=0):
    """Dense Gaussian blobs plus sparse uniform background points over their bounding box (blob id -1)."""
    x, blob, centres = blobs([per] * n_blobs, d=d, seed=seed)
    rng = np.random.default_rng(seed + 100)
    lo, hi = centres.min(0) - 10, centres.max(0) + 10
    nz = rng.uniform(lo, hi, (noise, d)).astype(np.float32)
    return np.concatenate([x, nz]), np.r_[blob, np.full(noise, -1)]


def coverage_selector(name, **kw):
    return COVERAGE[name](**({"n_classes": 5} if name == "probcover" else {}), **kw)


@pytest.mark.parametrize("name", sorted(COVERAGE))
def test_coverage_picks_dense_blobs_not_noise(name):
    x, blob = noisy_blobs()
    zeros = np.zeros(len(x))
    picks = coverage_selector(name).select(5, scores=zeros, embeddings=x, seed=0)
    assert sorted(blob[picks]) == [0, 1, 2, 3, 4]  # one per blob, none in the background
    if name == "probcover":
        # Beyond one ball per blob ProbCover goes for the still uncovered background points, by design.
        return
    more = coverage_selector(name).select(15, scores=zeros, embeddings=x, seed=0)
    assert (blob[more] >= 0).mean() >= 0.9
    assert set(blob[more[:5]]) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("name", sorted(COVERAGE))
def test_labeled_blobs_count_as_covered(name):
    x, blob = noisy_blobs()
    labeled = x[(blob >= 0) & (blob < 3)][::20] + 0.05  # a few labels in blobs 0-2
    sel = coverage_selector(name)
    picks = sel.select(2, scores=np.zeros(len(x)), embeddings=x, seed=0, labeled_embeddings=labeled)
    assert sorted(blob[picks]) == [3, 4]


def test_typiclust_skips_tiny_clusters_and_revisits_big_ones():
    x, blob, _ = blobs([60, 60, 60, 60, 3])
    sel = TypiClust()
    picks = sel.select(5, scores=np.zeros(len(x)), embeddings=x, seed=0)
    assert 4 not in blob[picks] and set(blob[picks]) == {0, 1, 2, 3}
    assert sel.info["n_clusters"] == 5 and sel.info["picks_in_uncovered_clusters"] == 4


def test_probcover_radius_from_purity():
    x, blob, centres = blobs([60] * 5, seed=2)
    sel = ProbCover(n_classes=5)
    picks = sel.select(5, scores=np.zeros(len(x)), embeddings=x, seed=0)
    gap = min(np.linalg.norm(centres[i] - centres[j]) for i in range(5) for j in range(i))
    assert sel.info["purity"] >= sel.info["purity_target"] == 0.95
    # Pure balls reach across a blob (diameter ~ 4 sigma sqrt(2) here) but not into the nearest other blob.
    assert 6.0 < sel.info["radius"] < gap
    assert sorted(blob[picks]) == [0, 1, 2, 3, 4] and sel.info["coverage"] == 1.0
    fixed = ProbCover(radius=0.5)
    fixed.select(3, scores=np.zeros(len(x)), embeddings=x, seed=0)
    assert fixed.info["radius"] == 0.5 and fixed.info["purity"] is None


def test_probcover_each_pick_covers_the_most():
    """Neighbour lists as long as the set make degrees exact: every greedy pick must hold a largest uncovered ball."""
    x = np.random.default_rng(4).standard_normal((150, 3)).astype(np.float32)
    sel = ProbCover(radius=0.8, n_neighbors=149)
    picks = sel.select(25, scores=np.zeros(150), embeddings=x, seed=0)
    ball = np.linalg.norm(x[:, None] - x[None], axis=-1) <= 0.8
    covered = np.zeros(150, dtype=bool)
    for p in picks[: sel.info["greedy_picks"]]:
        degree = (ball & ~covered[None]).sum(1)
        assert degree[p] == degree.max()
        covered |= ball[p]


def test_maxherding_lazy_greedy_equals_plain_greedy():
    """With full neighbour lists the sparse kernel is the dense one; lazy greedy must pick what plain greedy does."""
    x = np.random.default_rng(5).standard_normal((120, 4)).astype(np.float32)
    sel = MaxHerding(bandwidth=0.9, n_neighbors=119)
    picks = sel.select(20, scores=np.zeros(120), embeddings=x, seed=0)
    kern = np.exp(-(np.linalg.norm(x[:, None] - x[None], axis=-1) ** 2) / (2 * 0.9**2))
    cur, want = np.zeros(120), []
    for _ in range(20):
        gain = np.maximum(kern - cur[None], 0).sum(1)
        gain[want] = -1
        want.append(int(np.argmax(gain)))
        cur = np.maximum(cur, kern[want[-1]])
    assert picks.tolist() == want
    assert sel.info["coverage"] == pytest.approx(cur.mean(), rel=1e-5)


def test_uncertainty_herding_equals_weighted_greedy():
    """Each pick maximises Σ_i U_i max(0, k(x_i, x_c) - cur_i) (Bae et al. 2025), U = score / max score."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((120, 4)).astype(np.float32)
    scores = rng.random(120) * 0.7
    sel = UncertaintyHerding(bandwidth=0.9, n_neighbors=119)
    picks = sel.select(20, scores=scores, embeddings=x, seed=0)
    kern = np.exp(-(np.linalg.norm(x[:, None] - x[None], axis=-1) ** 2) / (2 * 0.9**2))
    u = scores / scores.max()
    cur, want = np.zeros(120), []
    for _ in range(20):
        gain = (u[None] * np.maximum(kern - cur[None], 0)).sum(1)
        gain[want] = -1
        want.append(int(np.argmax(gain)))
        cur = np.maximum(cur, kern[want[-1]])
    assert picks.tolist() == want
    assert sel.info["uncertainty_coverage"] == pytest.approx((u * cur).sum() / u.sum(), rel=1e-5)


def test_uncertainty_herding_moves_from_coverage_to_uncertainty():
    """Flat scores (a model that knows nothing): MaxHerding's picks exactly. Uncertainty in one blob: most picks go
    there, spread over it, while the other blobs still get their first pick when the weight allows."""
    x, blob = noisy_blobs()
    flat = np.full(len(x), 0.9)
    uh = UncertaintyHerding().select(5, scores=flat, embeddings=x, seed=0)
    assert uh.tolist() == MaxHerding().select(5, scores=flat, embeddings=x, seed=0).tolist()
    unsure = np.where(blob == 2, 1.0, 0.01)
    picks = UncertaintyHerding().select(6, scores=unsure, embeddings=x, seed=0)
    assert (blob[picks] == 2).sum() >= 4
    assert len(set(picks.tolist())) == 6
    assert MaxHerding().select(6, scores=unsure, embeddings=x, seed=0).tolist() != picks.tolist()


def test_maxherding_reports_its_bandwidth():
    x, _, _ = blobs([40] * 3)
    sel = MaxHerding(bandwidth_neighbors=10)
    sel.select(3, scores=np.zeros(len(x)), embeddings=x, seed=0)
    tenth = np.sort(np.linalg.norm(x[:, None] - x[None], axis=-1), axis=1)[:, 10]
    assert sel.info["bandwidth"] == pytest.approx(np.median(tenth), rel=1e-4)
    assert sel.info["bandwidth_rule"] == "median distance to neighbour 10"


def test_blocks_find_neighbours_beyond_the_exact_size():
    """Above the exact size, k-means blocks must still find (nearly) every true neighbour and exact distances."""
    x, _, _ = blobs([100] * 20, d=16, spread=6.0, seed=1)
    b = Blocks(x, seed=0, exact_max=100)
    assert len(b.probe) > 1
    d2, idx = b.knn(10)
    x64 = x.astype(np.float64)
    sq = (x64**2).sum(1)
    full = sq[:, None] + sq[None, :] - 2 * x64 @ x64.T
    np.fill_diagonal(full, np.inf)
    true = np.argsort(full, axis=1)[:, :10]
    recall = np.mean([len(set(a) & set(t)) / 10 for a, t in zip(idx, true, strict=True)])
    assert recall > 0.95
    np.testing.assert_allclose(d2, np.take_along_axis(full, idx, 1), rtol=1e-3, atol=1e-2)
    rows, near = b.near(7)
    np.testing.assert_allclose(near, np.where(rows == 7, 0, full[7, rows]), rtol=1e-3, atol=1e-2)


@pytest.mark.parametrize("name", sorted(COVERAGE))
def test_coverage_selectors_through_blocks(name, monkeypatch):
    monkeypatch.setattr("pipeline.strategies.coverage._EXACT_MAX", 100)
    x, blob = noisy_blobs(per=80)
    picks = coverage_selector(name).select(5, scores=np.zeros(len(x)), embeddings=x, seed=0)
    assert sorted(blob[picks]) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("name", sorted(COVERAGE))
def test_select_batch_cold_start_with_coverage(name):
    x, blob = noisy_blobs()
    ids = [f"s{i:04d}" for i in range(len(x))]
    sel = select_batch(Candidates(ids, embeddings=x), k=5, strategy="entropy", diversity=name, seed=0,
                       options={"n_classes": 5} if name == "probcover" else None)
    assert sorted(blob[sel.positions]) == [0, 1, 2, 3, 4]
    # The selector's report travels with the selection.
    assert {"typiclust": "n_clusters", "probcover": "radius", "maxherding": "bandwidth"}[name] in sel.info
    later = select_batch(Candidates(ids, embeddings=x, exclude=sel.ids, labeled_embeddings=x[sel.positions[:3]]),
                         k=2, strategy="entropy", diversity=name, seed=0,
                         options={"n_classes": 5} if name == "probcover" else None)
    assert set(blob[later.positions]) == set(blob[sel.positions[3:]])
