"""flows/select.py inside a real Prefect flow: tiny 4-bit model + LoRA adapter, a prepared pool on disk, 4 shards.

Checks the selection file's rows, per-shard caching (a re-run executes no shard body), resume after a shard's output
is lost (only that shard runs again), and determinism (a fresh project and a resumed one give identical bytes).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prefect import flow

from benchmarks import _round_driver as driver
from flows.select import make_task_runner, select_ref
from pipeline.config import ModelConfig, ProjectConfig, parse_config
from pipeline.scoring import load_scores
from pipeline.store import atomic_dir, digest_dir, executions, read_jsonl

DIGITS = [str(d) for d in range(10)]
QUESTION = "Which digit is shown in the image?"
POOL = 14  # shard_size 4 → shards of 4, 4, 4, 2
ROW_FIELDS = {"sample_id", "rank", "score", "scores", "strategy", "diversity", "adapter_digest", "prediction",
              "confidence", "round_strategy"}


def make_prepared_pool(out_dir: Path, n: int, *, seed: int = 0) -> dict[str, str]:
    """A real prepared pool (preprocess_dataset on generated images of varied sizes); returns its reference."""
    return driver.build_prepared_pool(out_dir, n, seed=seed, question=QUESTION)


def make_adapter(model_dir: Path, out_dir: Path, *, seed: int = 0) -> dict[str, str]:
    """A LoRA adapter with random B (a fresh one is the identity), saved like training saves it."""
    import torch

    from pipeline.model.loading import load_model

    ld = load_model(ModelConfig(name_or_path=str(model_dir), family="idefics3", mode="qlora"), trainable=True)
    torch.manual_seed(seed)
    for name, p in ld.model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5)
    with atomic_dir(out_dir) as tmp:
        ld.model.save_pretrained(str(tmp))
    return {"dir": str(out_dir), "digest": digest_dir(out_dir)}


def project(root: Path, model_dir: Path, **select: Any) -> ProjectConfig:
    data = {
        "data": {"answers": DIGITS, "question": QUESTION},
        "model": {"name_or_path": str(model_dir), "family": "idefics3", "mode": "qlora"},
        "select": {"batch_size": 4, "strategy": "entropy", "diversity": "k_center", "shard_size": 4,
                   "score_batch_size": 4, **select},
        "paths": {"artifacts": str(root / "artifacts")},
    }
    return parse_config(data, root=root)


@flow(name="test-select")
def select_test_flow(cfg_data: dict, prepared: dict, adapter: dict | None, pool_ids: list[str],
                     exclude: list[str], round_dir: str) -> dict:
    cfg = ProjectConfig.model_validate(cfg_data)
    return select_ref(cfg, prepared=prepared, adapter=adapter, pool_ids=pool_ids, exclude=exclude,
                      round_dir=Path(round_dir))[0]


def run_select(cfg: ProjectConfig, pool: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
    """One select run; returns (selection ref, {stage: bodies executed during this run})."""
    before = len(executions(cfg.artifacts))
    ref = select_test_flow.with_options(task_runner=make_task_runner(cfg))(
        cfg.model_dump(mode="json"), pool["prepared"], pool["adapter"], pool["ids"], pool["exclude"],
        str(cfg.artifacts / "rounds" / "000"),
    )
    ran: dict[str, int] = {}
    for e in executions(cfg.artifacts)[before:]:
        ran[e["stage"]] = ran.get(e["stage"], 0) + 1
    return ref, ran


def shard_dirs(cfg: ProjectConfig) -> list[Path]:
    return sorted(p for p in (cfg.artifacts / "scores").iterdir() if p.is_dir())


def scored_ids(shard: Path) -> list[str]:
    return load_scores(shard).sample_ids  # verifies the shard's files against its manifest first


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_models) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("select-pool")
    prepared = make_prepared_pool(root / "prepared", POOL)
    from pipeline.preprocess import load_prepared

    ids = sorted(load_prepared(prepared["dir"])["sample_id"])
    assert len(ids) == POOL
    return {"prepared": prepared, "adapter": make_adapter(tiny_models["idefics3"], root / "adapter"),
            "ids": ids, "exclude": ids[:2], "model": tiny_models["idefics3"]}


@pytest.fixture(scope="module")
def first(prefect_harness, tmp_path_factory, pool) -> dict[str, Any]:
    """Project A: the first run and a second, fully cached run."""
    cfg = project(tmp_path_factory.mktemp("project-a"), pool["model"])
    ref, ran = run_select(cfg, pool)
    data = (Path(ref["dir"]) / "selection.jsonl").read_bytes()
    ref2, ran2 = run_select(cfg, pool)
    return {"cfg": cfg, "ref": ref, "ran": ran, "bytes": data, "ref2": ref2, "ran2": ran2}


def test_selection_rows_and_one_body_per_shard(first, pool):
    assert first["ran"] == {"score_shard": 4, "select": 1}
    rows = read_jsonl(Path(first["ref"]["dir"]) / "selection.jsonl")
    assert len(rows) == first["ref"]["n"] == 4
    for row in rows:
        assert set(row) == ROW_FIELDS
        assert row["adapter_digest"] == pool["adapter"]["digest"]
        assert (row["strategy"], row["diversity"]) == ("entropy", "k_center")
        assert row["prediction"] in DIGITS and 0 < row["confidence"] <= 1
        assert row["scores"] == {"entropy": row["score"]} and np.isfinite(row["score"])
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    picked = [r["sample_id"] for r in rows]
    assert len(set(picked)) == 4 and set(picked) <= set(pool["ids"]) and not set(picked) & set(pool["exclude"])
    # Every shard's scores sit next to a verified manifest; together they cover the pool exactly once.
    scored = [sid for d in shard_dirs(first["cfg"]) for sid in scored_ids(d)]
    assert sorted(scored) == pool["ids"]


def test_second_run_executes_no_shard_body(first):
    assert first["ran2"] == {}
    assert first["ref2"] == first["ref"]
    assert (Path(first["ref2"]["dir"]) / "selection.jsonl").read_bytes() == first["bytes"]


def test_lost_shard_resumes_alone_and_selection_is_byte_identical(first, pool, tmp_path):
    """A fresh project gives the same bytes; losing one shard's output re-runs that shard only, same bytes again."""
    cfg = project(tmp_path, pool["model"])
    ref, ran = run_select(cfg, pool)
    assert ran == {"score_shard": 4, "select": 1}
    selection = Path(ref["dir"]) / "selection.jsonl"
    assert selection.read_bytes() == first["bytes"]

    victim = shard_dirs(cfg)[2]
    scores_before = (victim / "scores.npz").read_bytes()
    shutil.rmtree(victim)
    ref, ran = run_select(cfg, pool)
    assert ran == {"score_shard": 1}  # the selection's inputs (shard keys) did not change: it stays cached
    assert (victim / "scores.npz").read_bytes() == scores_before
    assert selection.read_bytes() == first["bytes"]

    # Resume with the selection lost as well: one shard and the selection run again, with identical output.
    shutil.rmtree(shard_dirs(cfg)[0])
    shutil.rmtree(Path(ref["dir"]))
    ref, ran = run_select(cfg, pool)
    assert ran == {"score_shard": 1, "select": 1}
    assert selection.read_bytes() == first["bytes"]


def test_cold_start_in_a_pool_space_scores_nothing(prefect_harness, tmp_path, pool):
    """select.embeddings: pixels → one cached embeddings stage (fitted on the pool), a coverage cold start, and no
    model scoring at all; a re-run executes nothing."""
    cfg = project(tmp_path, pool["model"], embeddings={"source": "pixels", "pca_dim": 4}, cold_start="probcover")
    cold = {**pool, "adapter": None}
    ref, ran = run_select(cfg, cold)
    assert ran == {"embeddings": 1, "select": 1}
    rows = read_jsonl(Path(ref["dir"]) / "selection.jsonl")
    assert len(rows) == 4 and {(r["strategy"], r["diversity"]) for r in rows} == {("random", "probcover")}
    assert not set(r["sample_id"] for r in rows) & set(pool["exclude"])
    assert ref["embeddings"] == "pixels" and all(r["prediction"] is None for r in rows)
    _, ran2 = run_select(cfg, cold)
    assert ran2 == {}


def test_schedule_phase_reaches_the_selection(prefect_harness, tmp_path, pool):
    """After the cold start the schedule picks the phase: below labels_per_class × classes it is coverage."""
    cfg = project(tmp_path, pool["model"], embeddings="pixels",
                  schedule={"coverage": "maxherding", "labels_per_class": 1})
    labels = {s: "3" for s in pool["exclude"]}  # 2 labels < 1 per class × 10 classes

    @flow(name="test-select-phase")
    def phase_flow() -> dict:
        return select_ref(cfg, prepared=pool["prepared"], adapter=pool["adapter"], pool_ids=pool["ids"],
                          exclude=[], round_dir=cfg.artifacts / "rounds" / "001", labels=labels)[0]

    ref = phase_flow()
    assert ref["phase"]["phase"] == "coverage" and "2 labels < 10" in ref["phase"]["reason"]
    rows = read_jsonl(Path(ref["dir"]) / "selection.jsonl")
    assert {r["diversity"] for r in rows} == {"maxherding"} and not set(r["sample_id"] for r in rows) & set(labels)
    assert all(r["prediction"] in DIGITS for r in rows)  # scored: pre-annotations for the annotators
