"""pipeline.selection.select_step: one selection step on arrays, as the label-efficiency benchmark's learners call it."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.errors import SelectionError
from pipeline.selection import Space, select_step
from pipeline.strategies import Candidates, select_batch


def _pool(n: int = 120, d: int = 8, c: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = [f"s{i:03d}" for i in range(n)]
    emb = (rng.standard_normal((c, d)) * 4)[rng.integers(0, c, n)] + rng.standard_normal((n, d))
    probs = rng.dirichlet(np.ones(c), n)
    return ids, emb.astype(np.float32), probs


def test_it_picks_what_select_batch_picks_with_the_labeled_rows_looked_up():
    ids, emb, probs = _pool()
    labeled = {"s003", "s050", "s111"}
    at = [ids.index(s) for s in sorted(labeled)]
    want = select_batch(Candidates(ids, probs=probs, embeddings=emb, exclude=labeled, labeled_embeddings=emb[at]),
                        k=10, strategy="margin", diversity="k_center", seed=5)
    got = select_step(ids, k=10, strategy="margin", diversity="k_center", seed=5, labeled=labeled, probs=probs,
                      embeddings=emb)
    assert got.ids == want.ids and not set(got.ids) & labeled
    # The same embeddings through a selection space (keyed by sample ID, in another row order) pick the same.
    order = np.random.default_rng(1).permutation(len(ids))
    space = Space([ids[i] for i in order], emb[order], "pool")
    assert select_step(ids, k=10, strategy="margin", diversity="k_center", seed=5, labeled=labeled, probs=probs,
                       space=space).ids == want.ids


def test_a_selector_that_takes_n_classes_gets_the_tasks_unless_options_say_otherwise():
    ids, emb, _ = _pool()
    got = select_step(ids, k=6, strategy="random", diversity="probcover", seed=0, embeddings=emb, n_classes=4)
    assert got.info["n_classes"] == 4
    assert select_step(ids, k=6, strategy="random", diversity="probcover", seed=0, embeddings=emb, n_classes=4,
                       options={"n_classes": 7}).info["n_classes"] == 7
    # A selector without that parameter is built without it (k_center would refuse an unknown option).
    assert len(select_step(ids, k=6, strategy="random", diversity="typiclust", seed=0, embeddings=emb,
                           n_classes=4).ids) == 6


def test_unknown_names_are_reported_by_select_batch():
    ids, emb, _ = _pool()
    with pytest.raises(SelectionError, match="unknown diversity 'nope'"):
        select_step(ids, k=2, strategy="random", diversity="nope", seed=0, embeddings=emb, n_classes=4)
