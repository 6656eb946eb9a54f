"""Outlier-aware selection: distance outliers, persistent uncertainty, the keep/downweight/exclude policy."""

import numpy as np
import pytest

from pipeline.errors import SelectionError
from pipeline.strategies.outliers import (
    apply_outlier_policy,
    find_outliers,
    near_labeled,
    outlier_scores,
    persistent_uncertainty,
    read_uncertainty_history,
    robust_z,
    write_uncertainty,
)


def _blobs(seed=0, n=60, d=8):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype(np.float32)


def test_robust_z_matches_its_definition_and_ignores_one_wild_value():
    x = np.array([1.0, 2.0, 3.0, 4.0, 100.0])
    med, mad = np.median(x), np.median(np.abs(x - np.median(x)))
    np.testing.assert_allclose(robust_z(x), (x - med) / (1.4826 * mad))
    # Over half the values tie: the MAD is 0, the mean absolute deviation still gives a scale.
    z = robust_z(np.array([1.0, 1.0, 1.0, 1.0, 5.0]))
    assert z[-1] > 3.5 and np.all(z[:-1] == 0)
    assert np.all(robust_z(np.full(4, 2.0)) == 0)


def test_a_point_far_from_everything_is_the_only_outlier():
    pool = _blobs()
    pool[7] += 40.0
    z = outlier_scores(pool, None, k=5)
    assert z.shape == (60,) and int(np.argmax(z)) == 7
    assert z[7] > 3.5 and (np.delete(z, 7) < 3.5).all()


def test_labeled_neighbours_count_so_a_labeled_region_is_not_an_outlier():
    pool = _blobs(1)
    far = np.full((1, 8), 40.0, np.float32)
    pool = np.concatenate([pool, far])
    assert outlier_scores(pool, None, k=3)[-1] > 3.5
    labeled = far + np.random.default_rng(2).normal(scale=0.5, size=(5, 8)).astype(np.float32)
    assert outlier_scores(pool, labeled, k=3)[-1] < 3.5


def test_exact_duplicates_leave_themselves_out_and_keep_their_twin():
    pool = _blobs(3, n=20)
    pool[5] = pool[4]
    z = outlier_scores(pool, None, k=1)
    # The twin is at distance 0: both are the least isolated samples.
    assert set(np.argsort(z)[:2]) == {4, 5}


def test_near_labeled_marks_pool_rows_with_a_labeled_neighbour():
    pool = np.array([[0, 0], [0.1, 0], [10, 10], [10.1, 10]], np.float32)
    labeled = np.array([[0.05, 0.0]], np.float32)
    np.testing.assert_array_equal(near_labeled(pool, labeled, k=1), [True, True, False, False])
    assert not near_labeled(pool, None, k=2).any()


def test_persistent_uncertainty_needs_every_one_of_the_last_rounds():
    rng = np.random.default_rng(0)
    ids = [f"s{i:02d}" for i in range(30)]
    history = []
    for r in range(4):
        scores = dict(zip(ids, rng.random(30), strict=True))
        scores["s00"] = 2.0  # always the most uncertain
        if r != 2:
            scores["s01"] = 2.0  # not in round 2
        history.append(scores)
    hard = persistent_uncertainty(history, min_rounds=3, quantile=0.05)
    assert "s00" in hard and "s01" not in hard
    assert "s01" in persistent_uncertainty(history[-1:] * 3, min_rounds=3, quantile=0.05)
    assert persistent_uncertainty(history, min_rounds=3, quantile=0.05, near={"s05"}) == set()
    assert persistent_uncertainty(history[:2], min_rounds=3) == set()
    with pytest.raises(SelectionError, match="quantile"):
        persistent_uncertainty(history, quantile=1.5)


def test_policy_keep_downweight_exclude():
    ids = ["a", "b", "c", "d"]
    scores = np.array([-3.0, -1.0, -2.0, -0.5])  # negative scores: a multiplicative weight would raise them
    flags = np.array([False, True, False, True])
    same, none = apply_outlier_policy(scores, flags, "keep", ids=ids)
    np.testing.assert_array_equal(same, scores)
    assert none == []
    down, none = apply_outlier_policy(scores, flags, "downweight", ids=ids, weight=0.5)
    assert none == [] and (down[flags] < scores[flags]).all() and (down[flags] >= scores.min()).all()
    np.testing.assert_array_equal(down[~flags], scores[~flags])
    zeroed, _ = apply_outlier_policy(scores, flags, "downweight", ids=ids, weight=0.0)
    assert (zeroed[flags] == scores.min()).all()
    kept, excluded = apply_outlier_policy(scores, flags, "exclude", ids=ids)
    np.testing.assert_array_equal(kept, scores)
    assert excluded == ["b", "d"]
    with pytest.raises(SelectionError, match="not one of"):
        apply_outlier_policy(scores, flags, "delete", ids=ids)
    with pytest.raises(SelectionError, match="aligned"):
        apply_outlier_policy(scores, flags[:3], "keep", ids=ids)


def test_find_outliers_reports_both_kinds_with_reasons(tmp_path):
    pool = _blobs(4, n=40)
    pool[3] += 50.0
    labeled = pool[10:12] + 0.01
    ids = [f"p{i:02d}" for i in range(40)]
    paths = []
    for r in range(3):
        scores = np.linspace(0, 1, 40)
        scores[10] = 5.0  # stays the most uncertain although labeled samples sit right next to it
        paths.append(write_uncertainty(tmp_path / f"r{r}.json", ids, scores))
    history = read_uncertainty_history([*paths, tmp_path / "missing.json"])
    assert len(history) == 3 and history[0]["p10"] == 5.0
    rep = find_outliers(ids + ["l0", "l1"], np.concatenate([pool, labeled]), history, labeled_ids={"l0", "l1"},
                        k=3, z_threshold=3.5, min_rounds=3, policy="downweight")
    assert rep.ids == ids  # the report covers the pool; labeled rows are neighbours only
    rows = {r["sample_id"]: r for r in rep.rows()}
    assert rows["p03"]["far"] and not rows["p03"]["persistent"]
    assert rows["p10"]["persistent"] and "despite labeled neighbours" in rows["p10"]["reasons"][0]
    assert rep.flags.sum() == len(rows) and rows["p03"]["policy"] == "downweight"


def test_bad_embeddings_are_clear_errors():
    pool = _blobs(5, n=5)
    with pytest.raises(SelectionError, match="only 4 other embeddings"):
        outlier_scores(pool, None, k=10)
    pool[2, 1] = np.nan
    with pytest.raises(SelectionError, match="row 2"):
        outlier_scores(pool, None, k=2)
    with pytest.raises(SelectionError, match=r"\[n, 8\]"):
        outlier_scores(_blobs(5, n=5), np.zeros((3, 4)), k=2)


def test_select_batch_downweights_flagged_samples_and_small_pools_flag_nothing():
    from pipeline.strategies import Candidates, select_batch

    ids = [f"s{i}" for i in range(6)]
    # margin: the closer the top two probabilities, the more uncertain; s0 is the most uncertain.
    probs = np.array([[0.5, 0.5], [0.6, 0.4], [0.7, 0.3], [0.8, 0.2], [0.9, 0.1], [0.95, 0.05]])
    plain = select_batch(Candidates(ids, probs=probs), k=2, strategy="margin", diversity="top_k", seed=0)
    assert plain.ids == ["s0", "s1"]
    down = select_batch(Candidates(ids, probs=probs), k=2, strategy="margin", diversity="top_k", seed=0, downweight={"s0"},
                        downweight_weight=0.0)
    assert down.ids == ["s1", "s2"]  # flagged s0 drops to the lowest score, not out of the pool
    last = select_batch(Candidates(ids, probs=probs), k=6, strategy="margin", diversity="top_k", seed=0, downweight={"s0"},
                        downweight_weight=0.0)
    assert last.ids[-1] == "s0"
    rep = find_outliers(["a", "b", "l"], _blobs(3, n=3), [], labeled_ids={"l"}, k=10, z_threshold=0.1, min_rounds=2)
    assert rep.ids == ["a", "b"] and not rep.flags.any()
