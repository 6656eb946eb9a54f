"""StageRef: a stage's output as the next stage takes it, typed, without moving a cache key."""

import dataclasses

import pytest

from flows.stages import plain_params
from pipeline.errors import ArtifactError
from pipeline.labelcheck.stage import RelabelParams
from pipeline.stage_ref import StageRef, key_fields

PREPARED = {"dir": "art/prepared/x", "digest": "p" * 64, "info": {"rows": 3}}


def test_a_task_result_round_trips_through_its_ref():
    ref = StageRef.of(PREPARED)
    assert (ref.dir, ref.digest, ref.extra) == ("art/prepared/x", "p" * 64, {"info": {"rows": 3}})
    assert ref.as_dict() == PREPARED


def test_a_ref_without_its_folder_names_what_is_missing():
    with pytest.raises(ArtifactError, match="needs dir, got fields \\['digest'\\]"):
        StageRef.of({"digest": "d"})


def test_typing_a_field_as_a_stage_ref_moves_no_cache_key():
    """The relabel stage's `check` and `prepared` were dicts: keyed the same as StageRefs, so no queue is rebuilt."""
    typed = RelabelParams(artifacts="art", check=StageRef("art/labelcheck/c", "c" * 64), prepared=StageRef.of(PREPARED),
                          annotate={"formats": ["csv"]}, answers=None, top_n=3, min_confidence=0.8,
                          already_queued=["s1"], round_index=2, out_dir="art/rounds/002/relabel")
    as_dicts = {**dataclasses.asdict(typed), "check": {"dir": "art/labelcheck/c", "digest": "c" * 64},
                "prepared": PREPARED}
    assert key_fields(typed) == as_dicts == plain_params({"params": typed})
    assert dataclasses.asdict(typed) != as_dicts  # what plain asdict() would have keyed on instead


def test_the_export_stage_is_keyed_as_when_its_refs_were_dicts():
    from pipeline.annotation.export import export_params
    from pipeline.config import AnnotateConfig

    selection = {"dir": "art/rounds/001/selection", "digest": "s" * 64, "count": 8, "strategy": "entropy"}
    params = export_params(AnnotateConfig(), ["a", "b"], artifacts="art", selection=selection, prepared=PREPARED,
                           round_index=1)
    assert params.selection.extra == {"count": 8, "strategy": "entropy"}
    assert key_fields(params) == {**dataclasses.asdict(params), "selection": selection, "prepared": PREPARED}


def test_the_embeddings_stage_is_keyed_and_placed_as_when_its_ref_was_a_dict(tmp_path):
    from pipeline.config import ProjectConfig
    from pipeline.embeddings import embeddings_params
    from pipeline.store import digest_json

    cfg = ProjectConfig.model_validate({"paths": {"artifacts": str(tmp_path)}, "select": {"embeddings": "pixels"}})
    params = embeddings_params(cfg, PREPARED)
    assert params.prepared == StageRef.of(PREPARED)
    as_dicts = {**dataclasses.asdict(params), "prepared": PREPARED}
    assert key_fields(params) == as_dicts
    folder_key = {k: v for k, v in as_dicts.items() if k not in ("artifacts", "out_dir")}
    assert params.out_dir == str(tmp_path / "embeddings" / digest_json(folder_key)[:16])


def test_the_prepare_flows_typed_refs_key_its_consumers_as_their_dicts_did(tmp_path):
    """The round holds the prepare and quality refs as PreparedRefs (issue 48): each consumer given the typed ref
    keys and places its stage exactly as it did given the task's dict, and latest.json's form round-trips."""
    from pipeline.config import ProjectConfig
    from pipeline.embeddings import embeddings_params
    from pipeline.score_stage import plan_pool_scoring
    from pipeline.stage_ref import PreparedRefs

    quality = {"dir": "art/quality/q", "digest": "q" * 64, "info": {"rows": 3, "flags": {"blur": 1}}}
    refs = PreparedRefs.of({"prepare": PREPARED, "quality": quality})
    assert refs.as_dict() == {"prepare": PREPARED, "quality": quality}
    assert refs.quality.info == {"rows": 3, "flags": {"blur": 1}} and StageRef.of(refs.prepare) is refs.prepare
    cfg = ProjectConfig.model_validate({"paths": {"artifacts": str(tmp_path)}, "select": {"embeddings": "pixels"},
                                        "model": {"name_or_path": str(tmp_path / "model"), "family": "idefics3"}})
    assert embeddings_params(cfg, refs.prepare) == embeddings_params(cfg, PREPARED)
    typed, plain = (plan_pool_scoring(cfg, prepared=p, adapter=None, pool_ids=["s2", "s1"])
                    for p in (refs.prepare, PREPARED))
    assert typed == plain and typed.parts["prepared"] == PREPARED  # the score-pool subflow's parameters stay JSON


def test_the_score_shards_are_keyed_and_placed_as_when_their_refs_were_dicts():
    from pipeline.score_stage import shard_params
    from pipeline.store import digest_json

    adapter = {"dir": "art/train/x/adapter", "digest": "a" * 64}
    model, scoring = {"name_or_path": "m"}, {"seed": 0}
    shards = shard_params("art", model=model, scoring=scoring, adapter=adapter, prepared=PREPARED,
                          pool_ids=["s1", "s2", "s3"], shard_size=2)
    assert [p.adapter for p in shards] == [StageRef.of(adapter)] * 2
    for p in shards:
        assert key_fields(p) == {**dataclasses.asdict(p), "adapter": adapter, "prepared": PREPARED}
        assert p.inputs() == {"adapter": "a" * 64, "prepared": "p" * 64, "shard": digest_json(p.shard_ids)}
        folder = digest_json({"adapter": "a" * 64, "prepared": "p" * 64, "ids": p.shard_ids, "model": model,
                              "scoring": scoring})
        assert p.out_dir == f"art/scores/{folder[:16]}"
    base = shard_params("art", model=model, scoring=scoring, adapter=None, prepared=PREPARED, pool_ids=["s1"],
                        shard_size=2)[0]
    assert base.adapter is None and base.inputs()["adapter"] == "base"


def test_the_select_stage_is_keyed_as_when_its_space_and_shards_were_dicts(tmp_path):
    from pipeline.config import ProjectConfig
    from pipeline.selection import plan_selection

    cfg = ProjectConfig.model_validate({"paths": {"artifacts": str(tmp_path)}, "data": {"answers": ["a", "b"]}})
    space = {"dir": str(tmp_path / "embeddings" / "e"), "digest": "e" * 64}
    shards = [{"dir": str(tmp_path / "scores" / "s"), "digest": "s" * 64}]
    plan = plan_selection(cfg, round_dir=tmp_path / "r", pool_ids=["s1", "s2"], exclude=[], labels={},
                          adapter=None, space=space, history_dirs=[])
    params = plan.stage_params(shards)
    assert (params.space, params.shard_refs) == (StageRef.of(space), [StageRef.of(shards[0])])
    assert key_fields(params) == {**dataclasses.asdict(params), "space": space, "shard_refs": shards}


def test_the_train_and_evaluate_stages_are_keyed_as_when_their_refs_were_dicts(tmp_path):
    from pipeline.config import ProjectConfig
    from pipeline.round.params import evaluate_params, train_params
    from pipeline.round.plan import plan_round

    cfg = ProjectConfig.model_validate({"paths": {"artifacts": str(tmp_path)}})
    augmented = {"dir": str(tmp_path / "augment" / "x"), "digest": "g" * 64, "info": {"copies": 2}}
    labeled = {"dataset": "l", "digest": "l" * 64}
    train = train_params(plan_round(tmp_path, {"s1": "a"}), artifacts=tmp_path, model=cfg.model, train=cfg.train,
                         seed=0, labeled=labeled, augmented=augmented)
    assert train.augmented == StageRef.of(augmented)
    assert key_fields(train) == {**dataclasses.asdict(train), "augmented": augmented}
    adapter = {"dir": "art/train/t", "digest": "t" * 64, "adapter_dir": "art/train/t/adapter", "adapter_digest": "a0"}
    ev = evaluate_params(artifacts=tmp_path, model=cfg.model, answers=None, batch_size=4,
                         test={"dataset": "d", "digest": "t"}, adapter=adapter)
    assert ev.adapter.extra == {"adapter_dir": "art/train/t/adapter", "adapter_digest": "a0"}
    assert key_fields(ev) == {**dataclasses.asdict(ev), "adapter": adapter}
