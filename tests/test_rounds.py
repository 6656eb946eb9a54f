"""The round's decisions as plain functions (pipeline/round/): no Prefect server, real files in a tmp project."""

import json

import datasets
import pytest

from pipeline.annotation.export import TASKS_FILE
from pipeline.config import parse_config
from pipeline.metrics import book_metrics, read_metrics
from pipeline.round.params import train_params
from pipeline.round.plan import PoolData, eligible_pool, plan_round, round_labels
from pipeline.round.records import SUMMARY_FILE, write_round
from pipeline.round.simulate import answer_round
from pipeline.round.stop import main_metric, stop_reason
from pipeline.round_state import ROUND_FILE, RoundState, completed_rounds, round_dir

IDS = [f"s{i:02d}" for i in range(10)]
SPLITS = ["train", "train", "test", "pool", "pool", "pool", "pool", "pool", "pool", "pool"]
ANSWERS = ["1", "2", "3", None, None, None, None, None, None, None]


@pytest.fixture
def pool():
    return PoolData.of(datasets.Dataset.from_dict({"sample_id": IDS, "split": SPLITS, "answer": ANSWERS}))


def cfg(tmp_path, **sections):
    return parse_config({"paths": {"artifacts": "artifacts"}, "data": {"answers": [str(d) for d in range(10)]},
                         **sections}, root=tmp_path)


def _sections(c):
    """What train_params reads of the project."""
    return dict(artifacts=c.artifacts, model=c.model, train=c.train, seed=c.seed)


def finish(art, plan, **state):
    write_round(plan, plan.state([], **state), "summary")


def test_seed_labels_come_from_the_train_split_and_the_ledger_overrides_them(pool):
    labels = round_labels(pool, {"s01": "7", "s05": "4", "elsewhere": "9"})
    # The test split's answer never trains; a label for a sample of another dataset is not this round's.
    assert labels == {"s00": "1", "s01": "7", "s05": "4"}


def test_round_numbers_advance_only_when_the_labeled_set_changes(tmp_path):
    art = tmp_path / "artifacts"
    first = plan_round(art, {})
    assert (first.index, first.rerun, first.previous) == (0, None, [])
    finish(art, first, adapter=None)
    again = plan_round(art, {})  # nothing new: a re-run of round 0, which is not its own history
    assert (again.index, again.rerun.round, again.previous) == (0, 0, [])
    more = plan_round(art, {"s03": "5"})
    assert more.index == 1 and more.rerun is None and [p.round for p in more.previous] == [0]
    assert more.dir == round_dir(art, 1) and more.labeled_digest != first.labeled_digest


def test_warm_start_is_the_previous_rounds_adapter_never_the_rounds_own(tmp_path):
    art = tmp_path / "artifacts"
    finish(art, plan_round(art, {"s03": "5"}), adapter={"adapter_digest": "a0", "adapter_dir": "x0"})
    finish(art, plan_round(art, {"s03": "5", "s04": "6"}), adapter={"adapter_digest": "a1", "adapter_dir": "x1"})
    rerun = plan_round(art, {"s03": "5", "s04": "6"})  # re-run of round 1
    assert rerun.index == 1 and rerun.warm_start("warm")["adapter_digest"] == "a0"
    assert rerun.warm_start("fresh") is None
    nxt = plan_round(art, {"s03": "5", "s04": "6", "s05": "1"})
    assert nxt.warm_start("warm")["adapter_digest"] == "a1"


def test_train_folder_follows_the_labels_and_the_warm_start(tmp_path):
    c = cfg(tmp_path, train={"init": "warm"})
    art = c.artifacts

    def params(labels):
        plan = plan_round(art, labels)
        # The labeled set's digest is its content (labeled_set): here the labels' own digest stands for it.
        return train_params(plan, artifacts=c.artifacts, model=c.model, train=c.train, seed=c.seed, labeled={"dataset": "l", "digest": plan.labeled_digest}, augmented=None)

    a = params({"s03": "5"})
    assert a.init_adapter is None and a.out_dir.startswith(str(art / "train"))
    assert params({"s03": "5"}) == a  # the same round: the same key
    assert params({"s03": "6"}).out_dir != a.out_dir
    finish(art, plan_round(art, {"s03": "5"}), adapter={"adapter_digest": "a0", "adapter_dir": "x0"})
    b = params({"s03": "5", "s04": "1"})
    assert b.init_adapter["adapter_digest"] == "a0" and b.out_dir != a.out_dir


def test_the_pool_leaves_out_labeled_flagged_and_still_exported_samples(tmp_path, pool):
    art = tmp_path / "artifacts"
    export = round_dir(art, 0) / "export"
    export.mkdir(parents=True)
    (export / TASKS_FILE).write_text(json.dumps([{"data": {"sample_id": s}} for s in ("s03", "s04")]))
    plan = plan_round(art, {"s00": "1", "s03": "5"})  # s03 came back labeled, s04 is still with the annotators
    assert plan.index == 0  # no round finished: the export's round is still "before" only from round 1 on
    finish(art, plan)
    plan = plan_round(art, {"s00": "1", "s03": "5", "s09": "2"})
    ids, exclude, out = eligible_pool(art, pool, plan, quality_excluded={"s05"})
    assert ids == ["s06", "s07", "s08"]
    assert exclude == {"s00", "s03", "s09", "s05", "s04"} and out == {"s04"}  # s04: exported, not labeled yet


def test_an_unreadable_earlier_export_is_named_with_the_fix(tmp_path, pool):
    from pipeline.errors import TamisError

    art = tmp_path / "artifacts"
    finish(art, plan_round(art, {}))
    (round_dir(art, 0) / "export").mkdir(parents=True)
    (round_dir(art, 0) / "export" / TASKS_FILE).write_text("[{")
    with pytest.raises(TamisError, match=r"000/export/label_studio_tasks.json: unreadable export .*re-run the export"):
        eligible_pool(art, pool, plan_round(art, {"s03": "1"}), set())


@pytest.mark.parametrize("rounds,n_labels,curve,pool_left,expect", [
    ({"max_rounds": 3}, 10, [], 5, None),
    ({"max_rounds": 3}, 10, [], 0, "pool exhausted"),
    ({"max_rounds": 2}, 10, [], 5, "rounds.max_rounds = 2: round 1 is the last (0–1); trained, selects nothing"),
    ({"label_budget": 10}, 10, [], 5, "label budget spent: 10 labels ≥ rounds.label_budget = 10"),
    ({"label_budget": 11}, 10, [], 5, None),
    ({"target_metric": 0.9}, 10, [0.5, 0.91], 5, "target reached: accuracy = 0.9100"),
    ({"target_metric": 0.9}, 10, [0.95, 0.85], 5, None),  # the newest round counts, not the best
    ({"plateau_rounds": 2}, 10, [0.5, 0.6, 0.603, 0.604], 5, "plateau: accuracy has not improved"),
    ({"plateau_rounds": 2}, 10, [0.5, 0.6, 0.603, 0.61], 5, None),
    ({"plateau_rounds": 2}, 10, [0.5, 0.6], 5, None),  # too short to tell
])
def test_each_stopping_rule(tmp_path, rounds, n_labels, curve, pool_left, expect):
    c = cfg(tmp_path, rounds={"max_rounds": 10, **rounds})
    metrics = [{"round": r, "metric": "accuracy", "value": v} for r, v in enumerate(curve)]
    metrics += [{"round": 0, "metric": "exact_match", "value": 1.0}]  # another metric never stops a round
    reason = stop_reason(c.rounds, 1, n_labels, metrics, pool_left)
    assert reason is None if expect is None else reason.startswith(expect), reason


def test_open_answers_stop_on_token_f1(tmp_path):
    c = parse_config({"paths": {"artifacts": "a"}, "data": {"answers": None}, "rounds": {"target_metric": 0.5}},
                     root=tmp_path)
    metrics = [{"round": 0, "metric": "accuracy", "value": 0.9}, {"round": 0, "metric": "token_f1", "value": 0.4}]
    main = main_metric(c.data.answers)
    assert stop_reason(c.rounds, 0, 5, metrics, 10, main=main) is None
    assert stop_reason(c.rounds, 0, 5, metrics + [{"round": 1, "metric": "token_f1", "value": 0.6}], 10,
                       main=main).startswith("target reached: token_f1")


def test_summary_is_written_before_the_round_counts_as_finished(tmp_path):
    art = tmp_path / "artifacts"
    plan = plan_round(art, {"s03": "5"})
    write_round(plan, plan.state([], selected=3), "# Round 0")
    assert (plan.dir / SUMMARY_FILE).read_text() == "# Round 0\n"
    assert json.loads((plan.dir / ROUND_FILE).read_text())["selected"] == 3
    assert [s.round for s in completed_rounds(art)] == [0]


def test_metrics_are_booked_once_per_round(tmp_path):
    art = tmp_path / "artifacts"
    for _ in range(2):  # a re-run of the round books nothing new
        book_metrics(art, round_index=0, labels=10, metrics={"accuracy": 0.5, "exact_match": 0.5}, strategy="m")
    book_metrics(art, round_index=1, labels=20, metrics={"accuracy": 0.6}, strategy="m")
    assert [(m["round"], m["metric"], m["labels"]) for m in read_metrics(art)] == [
        (0, "accuracy", 10), (0, "exact_match", 10), (1, "accuracy", 20)]


def test_a_round_that_exported_nothing_is_not_answered(tmp_path):
    art = tmp_path / "artifacts"
    answer_round(art, RoundState(round=0, stopped="pool exhausted"), ground_truth=None, noise=0.0, seed=0)
    assert not (art / "inbox").exists()


def _queue(art, round_index, ids, *, finished=True):
    """A relabel queue as the relabel stage leaves it: relabel.jsonl, then (when the export finished) its manifest."""
    from pipeline.labelcheck.relabel import RELABEL_TABLE, relabel_dir
    from pipeline.store import atomic_write_jsonl, write_manifest

    folder = relabel_dir(art, round_index)
    atomic_write_jsonl(folder / RELABEL_TABLE, [{"sample_id": s} for s in ids])
    if finished:
        write_manifest(folder, stage="relabel", stage_version="1", inputs={}, config={},
                       outputs={RELABEL_TABLE: RELABEL_TABLE}, info={"round": round_index, "count": len(ids)})


def test_the_label_budget_counts_re_label_tasks_sent_back(tmp_path):
    """rounds.label_budget pays for an annotator's time: 8 labels plus 2 re-label tasks spend a budget of 10, from
    the round after the queue went out; a queue whose export never finished was never handed out and costs nothing."""
    from pipeline.labelcheck import labels_spent

    c = cfg(tmp_path, rounds={"max_rounds": 10, "label_budget": 10})
    art = c.artifacts
    _queue(art, 0, ["s03", "s04"])
    assert stop_reason(c.rounds, 0, labels_spent(8, art, before_round=0), [], 5) is None  # its own queue: counted later
    assert stop_reason(c.rounds, 1, labels_spent(8, art, before_round=1), [], 5) == (
        "label budget spent: 10 labels ≥ rounds.label_budget = 10")
    assert stop_reason(c.rounds, 1, 8, [], 5) is None  # the labels alone are within the budget
    _queue(art, 1, ["s05", "s06", "s07"], finished=False)  # killed mid-export: no manifest
    assert labels_spent(7, art, before_round=2) == 9
    assert stop_reason(c.rounds, 2, labels_spent(7, art, before_round=2), [], 5) is None


def test_the_last_round_trains_on_its_new_labels_and_selects_nothing(tmp_path, pool):
    """At rounds.max_rounds the round still imports and trains on the labels of the previous batch (a new labeled
    set: a new round, a new training job warm-started from the previous adapter), then stops: no selection, nothing
    for the annotator; run again with the same labels it is the same stopped round, not one more."""
    c = cfg(tmp_path, rounds={"max_rounds": 2}, train={"init": "warm"})
    art = c.artifacts
    finish(art, plan_round(art, round_labels(pool, {})), adapter={"adapter_digest": "a0", "adapter_dir": "x0"},
           selected=3)
    last = plan_round(art, round_labels(pool, {"s03": "5", "s04": "6"}))
    assert last.index == 1 and last.rerun is None and len(last.labels) == 4  # 2 seed labels + the batch
    refs = dict(labeled={"dataset": "l", "digest": "l"}, augmented=None)
    job = train_params(last, **_sections(c), **refs)
    assert job.out_dir.startswith(str(art / "train")) and job.init_adapter["adapter_digest"] == "a0"
    ids = eligible_pool(art, pool, last, set()).ids
    reason = stop_reason(c.rounds, last.index, len(last.labels), [{"round": 1, "metric": "accuracy", "value": 0.4}], len(ids))
    assert ids and reason == "rounds.max_rounds = 2: round 1 is the last (0–1); trained, selects nothing"  # the pool is not what stops it
    finish(art, last, adapter={"adapter_digest": "a1", "adapter_dir": "x1"}, stopped=reason)
    answer_round(art, RoundState(round=1, stopped=reason), ground_truth=None, noise=0.0, seed=0)
    assert not (art / "inbox").exists()
    again = plan_round(art, round_labels(pool, {"s03": "5", "s04": "6"}))
    assert again.index == 1 and again.rerun.stopped == reason and again.rerun.adapter["adapter_digest"] == "a1"
    # The same training job (warm from round 0's adapter, never its own): a cached re-run trains nothing.
    assert train_params(again, **_sections(c), **refs) == job


def _export(art, round_index, ids):
    """A round's export as the export stage leaves it (only the task list matters to what is still out)."""
    folder = round_dir(art, round_index) / "export"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / TASKS_FILE).write_text(json.dumps([{"data": {"sample_id": s}} for s in ids]))


def test_the_label_budget_is_a_cap_the_last_batch_is_cut_to_what_is_left(tmp_path):
    """rounds.label_budget 90 with batches of 40: 40, 40, then 10, and nothing after; a round run before all of the
    last batch came back counts what is still with the annotators, so the budget is never exceeded."""
    from pipeline.labelcheck import labels_spent
    from pipeline.round.plan import still_out
    from pipeline.round.stop import budget_batch
    from pipeline.selection import plan_selection

    c = cfg(tmp_path, rounds={"max_rounds": 10, "label_budget": 90}, select={"batch_size": 40, "cold_start": "random"})
    art = c.artifacts
    pool = [f"p{i:03d}" for i in range(200)]
    labels, batches = {}, []
    for _ in range(5):
        plan = plan_round(art, labels)
        out = len(still_out(art, plan))
        spent = labels_spent(len(plan.labels), art, before_round=plan.index)
        if stop_reason(c.rounds, plan.index, spent, [], len(pool), outstanding=out):
            break
        eligible = [s for s in pool if s not in labels]
        sp = plan_selection(c, round_dir=plan.dir, pool_ids=eligible, exclude=sorted(labels), labels=plan.labels,
                            adapter=None, space=None, history_dirs=[],
                            batch_size=budget_batch(c.rounds, c.select.batch_size, spent, out))
        # The select stage picks select.batch_size of its parameters (its key: a cut batch is another selection).
        chosen = eligible[:sp.params.select["batch_size"]]
        _export(art, plan.index, chosen)
        finish(art, plan)
        batches.append(len(chosen))
        labels |= dict.fromkeys(chosen, "1")
    assert batches == [40, 40, 10]
    assert stop_reason(c.rounds, 3, 90, [], 100).startswith("label budget spent: 90 labels")
    # Half of a batch of 40 still out: the budget holds them, so 90 - 50 - 20 = 20 is what the next round may send.
    assert budget_batch(c.rounds, 40, 50, 20) == 20
    assert stop_reason(c.rounds, 2, 70, [], 100, outstanding=20).startswith(
        "label budget spent: 70 labels + 20 tasks still with the annotators ≥ rounds.label_budget = 90")
    assert budget_batch(cfg(tmp_path).rounds, 40, 500) == 40  # no budget: never cut
    # The label check's re-label queue goes out with the batch: it gets what the batch left, no more.
    from pipeline.labelcheck import plan_relabel
    from pipeline.round.stop import budget_left

    c = cfg(tmp_path, rounds={"label_budget": 90}, labelcheck={"relabel_top_n": 20})
    assert budget_left(c.rounds, RoundState(labels_spent=70, selected=10, tasks_out=5)) == 5
    assert budget_left(c.rounds, RoundState(labels_spent=80, selected=10)) == 0
    assert budget_left(cfg(tmp_path).rounds, RoundState(labels_spent=80, selected=10)) is None
    relabel = {"artifacts": c.artifacts, "annotate": c.annotate, "labelcheck": c.labelcheck, "answers": None,
               "check": {"dir": "x", "digest": "d"}, "prepared": {"dir": "p", "digest": "q"}, "round_index": 2}
    assert plan_relabel(**relabel, cap=5).top_n == 5 and plan_relabel(**relabel).top_n == 20


def _reweigh(model_dir, scale=1.5):
    """New weights at the same path: every floating tensor of the checkpoint scaled, saved over the old file."""
    import torch
    from safetensors.torch import load_file, save_file

    for f in sorted(model_dir.glob("*.safetensors")):
        tensors = {k: (v * scale if v.is_floating_point() else v) for k, v in load_file(f).items()}
        save_file({k: t.contiguous() for k, t in tensors.items()}, f, metadata={"format": "pt"})
    assert torch  # the checkpoint is torch's format


def test_train_evaluate_and_score_keys_know_the_models_weights_and_libraries(tmp_path, tiny_models, monkeypatch):
    """Issue 36: the keys held the model section (a path string): new weights at the same path reused the old
    adapter. Now they hold the checkpoint's content and the library versions; a re-saved file with the same bytes
    (a touch) keeps them."""
    import os
    import shutil

    from pipeline.model import identity
    from pipeline.round.params import evaluate_params

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_models["idefics3"], model_dir)
    c = cfg(tmp_path, model={"name_or_path": str(model_dir), "family": "idefics3"})
    plan = plan_round(c.artifacts, {"s03": "5"})
    refs = dict(labeled={"dataset": "l", "digest": plan.labeled_digest}, augmented=None)
    adapter = {"dir": "t0", "digest": "m0", "adapter_digest": "a0", "adapter_dir": "x0"}  # the train stage's result

    def keys():
        job = train_params(plan, **_sections(c), **refs)
        return job.out_dir, job.model, evaluate_params(
            artifacts=c.artifacts, model=c.model, answers=c.data.answers, batch_size=c.select.score_batch_size,
            test={"digest": "t"}, adapter=adapter).model

    before = keys()
    assert before[1]["identity"]["checkpoint"].startswith("sha256:")
    assert set(before[1]["identity"]["libraries"]) == {"torch", "transformers", "peft", "bitsandbytes"}
    for f in model_dir.iterdir():  # the same bytes, a newer mtime: read again, the same digest
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 5_000_000_000))
    assert keys() == before
    _reweigh(model_dir)
    after = keys()
    assert after[0] != before[0] and after[1] != before[1] and after[2] != before[2]
    monkeypatch.setattr(identity, "library_versions", lambda: {"torch": "9.9", "transformers": "1", "peft": "1",
                                                               "bitsandbytes": "1"})
    assert keys()[0] != after[0]  # a library upgrade retrains too
    # The model section of stages not keyed on the content (config show, the embeddings stage) has no identity.
    assert "identity" not in c.section("model")


def test_a_hub_id_keys_on_the_revision_it_resolves_to(tmp_path, monkeypatch):
    from pipeline.config import ModelConfig
    from pipeline.model import identity

    monkeypatch.setattr(identity, "hub_revision", lambda name: "3f9a0c1")
    got = identity.model_identity(ModelConfig(name_or_path="HuggingFaceTB/SmolVLM-256M-Instruct"), tmp_path)
    assert got["checkpoint"] == "hub:HuggingFaceTB/SmolVLM-256M-Instruct@3f9a0c1"
    monkeypatch.setattr(identity, "hub_revision", lambda name: "77aa001")  # the ID moved on: another key
    assert identity.model_identity(ModelConfig(name_or_path="HuggingFaceTB/SmolVLM-256M-Instruct"),
                                   tmp_path)["checkpoint"].endswith("@77aa001")
