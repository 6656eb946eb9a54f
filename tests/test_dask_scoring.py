"""Scale-out: 4 score shards on a 2-worker local Dask cluster (worker processes) give the local runner's selection."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from test_select_flow import make_adapter, make_prepared_pool, project, run_select

from pipeline.scoring import concat_scores, load_scores
from pipeline.store import executions, read_jsonl

# Two worker processes each import torch and load the model: 60-90 s here, hence slow (`make test-all` runs it).
pytestmark = pytest.mark.slow


def test_dask_runner_selects_what_the_local_runner_selects(prefect_harness, tiny_models, tmp_path):
    model = tiny_models["idefics3"]
    prepared = make_prepared_pool(tmp_path / "prepared", 16)
    from pipeline.preprocess import load_prepared

    ids = sorted(load_prepared(prepared["dir"])["sample_id"])
    pool = {"prepared": prepared, "adapter": make_adapter(model, tmp_path / "adapter"), "ids": ids,
            "exclude": ids[:1]}
    local = project(tmp_path / "local", model)
    dask = project(tmp_path / "dask", model, runner="dask")
    assert dask.select.shard_size == 4 and len(ids) == 16  # 4 shards

    ref_local, _ = run_select(local, pool)
    ref_dask, ran = run_select(dask, pool)

    assert ran == {"score_shard": 4, "select": 1}
    shard_pids = {e["pid"] for e in executions(dask.artifacts) if e["stage"] == "score_shard"}
    assert shard_pids and os.getpid() not in shard_pids  # scored in Dask worker processes, not in the flow's
    rows_local = read_jsonl(Path(ref_local["dir"]) / "selection.jsonl")
    rows_dask = read_jsonl(Path(ref_dask["dir"]) / "selection.jsonl")
    assert [r["sample_id"] for r in rows_dask] == [r["sample_id"] for r in rows_local]
    assert [r["rank"] for r in rows_dask] == [r["rank"] for r in rows_local]
    np.testing.assert_allclose([r["score"] for r in rows_dask], [r["score"] for r in rows_local], atol=1e-5)

    def pool_scores(cfg):
        parts = concat_scores([load_scores(p) for p in sorted((cfg.artifacts / "scores").iterdir())])
        order = np.argsort(parts.sample_ids)
        return np.asarray(parts.sample_ids)[order], parts.probs[order], parts.embeddings[order]

    (ids_l, probs_l, emb_l), (ids_d, probs_d, emb_d) = pool_scores(local), pool_scores(dask)
    assert ids_l.tolist() == ids_d.tolist() == ids
    np.testing.assert_allclose(probs_d, probs_l, atol=1e-5)
    np.testing.assert_allclose(emb_d, emb_l, atol=1e-4)
