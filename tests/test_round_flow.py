"""End to end: two labeling rounds with the tiny 4-bit model under a Prefect test server."""

import json
import shutil
from collections import Counter

import pytest
import yaml

from pipeline.annotation.ledger import Ledger, ledger_path
from pipeline.config import load_config
from pipeline.data.demo import write_digits
from pipeline.errors import DataError, LockError
from pipeline.lock import ProjectLock
from pipeline.round_state import completed_rounds
from pipeline.store import executions, read_jsonl, read_manifest


def write_project(root, tiny_models, limit=60, data=None, **overrides):
    """A tiny project under `root` (its config → root/tamis.yaml): `limit` digits, or the `data` section given (a
    `data` without sources is laid over the digits' section: other answers or another question for the same images)."""
    data = dict(data or {})
    if "sources" not in data:
        digits = write_digits(root / "digits", limit=limit)
        data = {"sources": [{"kind": "jsonl", "path": str(digits / "manifest.jsonl")}],
                "answers": [str(d) for d in range(10)], "question": "Which digit is shown in the image?",
                "ground_truth": str(digits / "ground_truth.jsonl"), **data}
    model_dir = root / "model"
    shutil.copytree(tiny_models["idefics3"], model_dir)
    cfg = {
        "seed": 0,
        "paths": {"artifacts": str(root / "artifacts")},
        "data": data,
        "preprocess": {"size": 32, "pad": "square"},
        "model": {"name_or_path": str(model_dir), "family": "idefics3", "mode": "qlora"},
        "train": {"batch_size": 4, "effective_batch_size": 4, "max_steps": 2, "learning_rate": 0.002,
                  "checkpoint_every": 1},
        "select": {"batch_size": 6, "strategy": "margin", "diversity": "cluster_margin", "shard_size": 16},
        "rounds": {"max_rounds": 5, "simulate_annotator": True},
    }
    for section, values in overrides.items():
        cfg[section].update(values)
    path = root / "tamis.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def stage_runs(artifacts):
    return Counter(e["stage"] for e in executions(artifacts))


def test_two_rounds_cached_rerun_label_import_and_corrupt_inbox(tmp_path, tiny_models, prefect_harness):
    from flows.round import labeling_round

    config = write_project(tmp_path, tiny_models)
    art = load_config(config).artifacts

    first = labeling_round(str(config))
    assert first["round"] == 0 and first["labeled"] == 0 and first["selected"] == 6
    assert first["strategy"].startswith("cold start")
    tasks = json.loads((art / "rounds/000/export/label_studio_tasks.json").read_text())
    assert len(tasks) == 6
    assert (art / "inbox/simulated-round-000.json").is_file()  # the simulated annotator's Label Studio export

    second = labeling_round(str(config), simulate=False)
    assert second["round"] == 1 and second["labeled"] == 6
    ledger = Ledger(ledger_path(art))
    assert sorted(ledger.labels()) == sorted(t["data"]["sample_id"] for t in tasks)
    assert set(second["metrics"]) == {"accuracy", "exact_match"}
    selection = read_jsonl(art / "rounds/001/selection/selection.jsonl")
    assert len(selection) == 6 and not {r["sample_id"] for r in selection} & set(ledger.labels())
    assert {"sample_id", "rank", "score", "strategy", "adapter_digest", "prediction", "confidence"} <= set(selection[0])
    for stage_dir in ("rounds/001/export", "rounds/001/selection"):
        read_manifest(art / stage_dir)  # digests verify
    # One name for what chose each round's batch: the CLI table / round.json, selection.jsonl, metrics.jsonl and the
    # summary the Prefect UI shows.
    cold = read_jsonl(art / "rounds/000/selection/selection.jsonl")
    assert {r["round_strategy"] for r in cold} == {first["strategy"]} == {"cold start: typical"}
    assert {r["round_strategy"] for r in selection} == {second["strategy"]} == {"margin+cluster_margin"}
    assert json.loads((art / "rounds/001/round.json").read_text())["strategy"] == second["strategy"]
    assert {m["strategy"] for m in read_jsonl(art / "metrics.jsonl")} == {second["strategy"]}
    assert f"- strategy: {second['strategy']}" in (art / "rounds/001/summary.md").read_text()

    before = stage_runs(art)
    again = labeling_round(str(config), simulate=False)
    assert again["round"] == 1 and again["metrics"] == second["metrics"]
    assert stage_runs(art) == before  # a finished round re-runs without executing any stage body
    # The re-run keeps the record of the import that brought round 1's labels (round.json and summary.md).
    assert [i["accepted"] for i in again["imports"]] == [6]
    assert json.loads((art / "rounds/001/round.json").read_text())["imports"] == again["imports"]
    assert "6 labels appended" in (art / "rounds/001/summary.md").read_text()
    assert {e["round"] for e in ledger.entries()} == {1}  # the round `tamis labels import` would record too

    # A corrupt inbox file is rejected with its line number; the ledger does not change.
    entries = len(ledger.entries())
    (art / "inbox" / "broken.json").write_text('[\n  {"data": {"sample_id": "x"},\n  "annotations": [\n')
    third = labeling_round(str(config), simulate=False)
    rejected = [i for i in third["imports"] if "error" in i]
    assert len(rejected) == 1 and "broken.json" in rejected[0]["file"] and "line" in rejected[0]["error"]
    assert [i["accepted"] for i in third["imports"] if "error" not in i] == [6]
    assert len(ledger.entries()) == entries
    assert third["round"] == 1  # nothing new was labeled: still the same round
    assert [s.round for s in completed_rounds(art)] == [0, 1]
    assert (art / "learning_curve.png").stat().st_size > 0
    check_round_runs_in_the_api(art, ["round-000", "round-001", "round-001-rerun", "round-001-rerun"])


def check_round_runs_in_the_api(art, names):
    """What the Prefect UI shows of these rounds: run names and tags, task inputs the Task Runs tab accepts, the
    curve as a picture, the export's folder as text."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterParentTaskRunId,
    )
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = [r for r in client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["labeling-round"])), sort=FlowRunSort.START_TIME_ASC,
            flow_run_filter=FlowRunFilter(parent_task_run_id=FlowRunFilterParentTaskRunId(is_null_=True)))
            if r.parameters.get("config_path", "").startswith(str(art.parent))]
        assert [r.name for r in runs] == names
        assert {"tamis", "round-001", "rerun"} <= set(runs[-1].tags) and runs[-1].state.message.startswith("round 1:")
        sub = [r for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_task_run_id=FlowRunFilterParentTaskRunId(is_null_=False))) if r.name.endswith("-score-pool")]
        assert "round-001-score-pool" in {r.name for r in sub}
        for run in runs[:2]:
            task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [run.id]}))
            inputs = {i.input_type for tr in task_runs for values in tr.task_inputs.values() for i in values}
            # The V1 UI's Task Runs tab lists nothing when any task input is a "flow_run" (a subflow's result).
            assert inputs <= {"task_run", "parameter", "constant"}, (run.name, inputs)
        arts = {a.key: a for a in client.read_artifacts(
            flow_run_filter=FlowRunFilter(id={"any_": [runs[1].id]}))}
    assert "![learning curve](data:image/png;base64," in arts["round-summary"].data
    assert "| round | labels | accuracy = exact_match |" in arts["round-summary"].data
    # The evaluation's per-class table, with the confusion matrix inline as the curve is.
    assert "| answer | precision | recall | F1 | support |" in arts["round-summary"].data
    assert "![confusion matrix](data:image/png;base64," in arts["round-summary"].data
    assert arts["learning-curve"].type == "image" and arts["learning-curve"].data.startswith("data:image/png")
    assert "file://" not in arts["export-folder"].data
    assert str(art / "rounds" / "001" / "export") in arts["export-folder"].data
    assert {"round-progress", "training-progress"} <= set(arts)


def test_second_concurrent_round_is_refused(tmp_path, tiny_models, prefect_harness):
    from flows.round import labeling_round

    config = write_project(tmp_path, tiny_models)
    art = load_config(config).artifacts
    with ProjectLock(art / "round.lock"):
        with pytest.raises(LockError, match="Another labeling round is running"):
            labeling_round(str(config))


def test_label_checks_relabel_queue_and_outliers_in_rounds(tmp_path, tiny_models, prefect_harness, monkeypatch):
    """A noisy annotator: round 1 checks its labels (k-fold) — a weak model abstains and queues nothing; an accurate
    one sends the likeliest errors back with the batch, a careful reviewer answers them, and round 2 imports the
    fixes as corrections; pool outliers are reported and, with select.outliers exclude, never selected; re-labels
    count against the label budget."""
    import dataclasses

    import numpy as np
    from typer.testing import CliRunner

    import pipeline.labelcheck.check
    from flows.cli.main import app
    from flows.round import labeling_round
    from pipeline.annotation.simulate import sidecar_path

    config = write_project(tmp_path, tiny_models, limit=120, select={"batch_size": 20},
                           rounds={"simulate_noise": 0.5})
    raw = yaml.safe_load(config.read_text())
    raw["labelcheck"] = {"method": "kfold", "kfold": 2, "relabel_top_n": 3}
    raw["select"]["outliers"] = "exclude"
    raw["select"]["outlier_z"] = 2.0  # low enough that the tiny pool has some to exclude
    config.write_text(yaml.safe_dump(raw))
    cfg = load_config(config)
    art = cfg.artifacts
    truth = {json.loads(line)["sample_id"]: json.loads(line)["answer"]
             for line in open(cfg.data.ground_truth, encoding="utf-8")}

    labeling_round(str(config))
    cli = CliRunner()
    res = cli.invoke(app, ["labels", "issues", "-c", str(config)])
    assert isinstance(res.exception, DataError) and "no label check in any round" in str(res.exception)
    flips = {f["sample_id"]: f for f in
             json.loads(sidecar_path(art / "inbox/simulated-round-000.json").read_text())["flipped"]}
    assert len(flips) == 10

    # A 2-step model on 20 labels cannot tell its own mistakes from wrong labels: the check says so, queues nothing.
    weak = labeling_round(str(config), simulate=False)
    check = weak["labelcheck"]
    assert weak["round"] == 1 and check["checked"] == 20 and check["abstained"] and check["issues"] == 0
    assert "model not yet accurate enough to judge labels (OOS accuracy" in check["message"]
    assert weak["relabel"] == 0 and "relabel_dir" not in weak and not (art / "rounds/001/relabel/relabel.jsonl").exists()
    summary = (art / "rounds/001/summary.md").read_text()
    assert "label check: model not yet accurate enough to judge labels (OOS accuracy" in summary
    assert "No label is judged or queued for re-labeling" in summary
    res = cli.invoke(app, ["labels", "issues", "-c", str(config)], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "round 1: label check: model not yet accurate enough" in " ".join(res.output.split())

    # An accurate model (an oracle stands in for one: the tiny model would need minutes of training) judges the
    # same labels: a perfect model agrees with half of them at 50 % noise, so the floor goes to 0.4; re-running
    # the round re-runs only the check (the fold scores are reused) and the queue.
    real_oos = pipeline.labelcheck.out_of_sample_probs

    def oracle(cfg, rows, *args, **kwargs):
        oos = real_oos(cfg, rows, *args, **kwargs)
        probs = np.full(oos.probs.shape, 0.1 / 9, dtype=np.float32)
        probs[np.arange(len(oos.sample_ids)), [int(truth[s]) for s in oos.sample_ids]] = 0.9
        return dataclasses.replace(oos, probs=probs)

    # check_labels looks out_of_sample_probs up in its own module (pipeline/labelcheck/check.py).
    monkeypatch.setattr(pipeline.labelcheck.check, "out_of_sample_probs", oracle)
    raw["labelcheck"].update(min_oos_accuracy=0.4, knn_k=0)
    config.write_text(yaml.safe_dump(raw))
    before = stage_runs(art)
    first = labeling_round(str(config))
    runs = stage_runs(art) - before
    assert runs["labelcheck"] == 1 and runs["train"] == 0 and runs["relabel"] == 1
    assert first["round"] == 1 and first["labeled"] == 20
    check = first["labelcheck"]
    assert check["method"] == "kfold" and check["checked"] == 20 and check["issues"] >= 1 and not check["abstained"]
    read_manifest(check["dir"])  # digests verify
    issues = read_jsonl(f"{check['dir']}/issues.jsonl")
    assert len(issues) == check["issues"]
    assert {"sample_id", "given_label", "suggested_label", "score", "annotators", "source_file", "confidence",
            "signals"} <= set(issues[0])
    assert all(r["signals"] == ["model"] and r["confidence"] >= 0.3 for r in issues)
    assert {r["sample_id"] for r in issues} <= set(flips)  # the oracle only ever flags planted flips
    assert all(r["annotators"] == ["simulated"] and r["source_file"].endswith("simulated-round-000.json")
               for r in issues)
    # The queue holds the top of the report, as a separate Label Studio task set with both pre-annotations.
    queued = [r["sample_id"] for r in read_jsonl(art / "rounds/001/relabel/relabel.jsonl")]
    assert queued == [r["sample_id"] for r in issues[:3]] and first["relabel"] == len(queued)
    tasks = json.loads((art / "rounds/001/relabel/label_studio_tasks.json").read_text())
    assert {p["model_version"] for t in tasks for p in t["predictions"]} == {"current-label", "suggested-label"}
    assert not set(queued) & {r["sample_id"] for r in read_jsonl(art / "rounds/001/selection/selection.jsonl")}
    # Outliers: reported with reasons; excluded ones are not in the batch.
    outliers = read_jsonl(art / "rounds/001/selection/outliers.jsonl")
    assert first["outliers"]["flagged"] == len(outliers) >= 1 and first["outliers"]["policy"] == "exclude"
    assert all(r["reasons"] for r in outliers)
    selected = {r["sample_id"] for r in read_jsonl(art / "rounds/001/selection/selection.jsonl")}
    assert not selected & {r["sample_id"] for r in outliers}
    assert (art / "inbox/simulated-relabel-001.json").is_file()
    summary = (art / "rounds/001/summary.md").read_text()
    assert "## Label quality" in summary and f"{check['issues']} likely label errors among 20" in summary
    assert "agree with model |" in summary and "| simulated | 0 | – | 20 |" in summary  # annotator agreement
    assert f"Outliers in the pool: {len(outliers)} flagged" in summary and "rounds/001/relabel" in summary
    # 80 columns, as under CI: the sample column never wraps, whatever the terminal width.
    res = cli.invoke(app, ["labels", "issues", "-c", str(config), "--top", "3"], env={"COLUMNS": "80"})
    text = " ".join(res.output.split())
    assert res.exit_code == 0, res.output
    assert f"round 1: {check['issues']} likely label errors among 20 labels checked (kfold)" in text
    assert issues[0]["sample_id"] in res.output and "rounds/001/relabel" in text.replace(" ", "")

    second = labeling_round(str(config), simulate=False)
    ledger = Ledger(ledger_path(art))
    for sid in queued:  # the reviewer's answer now wins; a changed label is a correction, the old entry kept
        assert ledger.labels()[sid] == truth[sid]
        kinds = [e["kind"] for e in ledger.history(sid)]
        assert kinds == (["label", "correction"] if sid in flips else ["label"])
    assert second["labels_spent"] == second["labeled"] + len(queued)
    # Later rounds never queue a sample twice; its uncertainty history feeds the persistent-outlier check.
    assert (art / "rounds/001/selection/uncertainty.json").is_file()

    # Switching to the cheap heldout check re-runs only the check: round 1's adapter scores the 20 labels that came
    # in since it was trained; the round is not retrained.
    before = stage_runs(art)
    raw["labelcheck"]["method"] = "heldout"
    config.write_text(yaml.safe_dump(raw))
    again = labeling_round(str(config), simulate=False)
    assert again["round"] == 2 and again["labelcheck"]["method"] == "heldout"
    assert again["labelcheck"]["checked"] == 20
    runs = stage_runs(art) - before
    assert runs["labelcheck"] == 1 and runs["train"] == 0 and runs["score_shard"] == 0
    # A longer re-label queue re-exports the queue only: the check itself is keyed on what its probabilities use.
    before = stage_runs(art)
    raw["labelcheck"]["relabel_top_n"] = 4
    config.write_text(yaml.safe_dump(raw))
    labeling_round(str(config), simulate=False)
    runs = stage_runs(art) - before
    assert runs["labelcheck"] == 0 and runs["relabel"] == 1 and runs["train"] == 0


@pytest.mark.slow
def test_the_stop_set_is_predicted_by_each_adapter_and_never_exported(tmp_path, tiny_models, prefect_harness):
    """rounds.stop_set: every trained round scores the same pool samples, records its answers and their agreement
    with the previous adapter's; none of them is ever selected."""
    from flows.round import labeling_round

    config = write_project(tmp_path, tiny_models, limit=80, rounds={"stop_set": 8})
    art = load_config(config).artifacts
    states = [labeling_round(str(config)) for _ in range(3)]
    assert [s["round"] for s in states] == [0, 1, 2]
    assert "stability" not in states[0]  # the cold start has no adapter to ask
    assert states[1]["stability"]["history"] == [] and states[1]["stability"]["n"] == 8
    second = states[2]["stability"]
    assert len(second["history"]) == 1 and -1 <= second["kappa"] <= 1 and "agreement" in second
    stop = json.loads((art / "rounds/002/stopset.json").read_text())["ids"]
    assert stop == json.loads((art / "rounds/001/stopset.json").read_text())["ids"] and len(stop) == 8
    exported = {t["data"]["sample_id"] for r in range(3)
                for t in json.loads((art / f"rounds/{r:03d}/export/label_studio_tasks.json").read_text())}
    assert not exported & set(stop)
    assert "stop set (8 pool samples): agreement with the previous adapter" in (
        art / "rounds/002/summary.md").read_text()
    # With three agreements (round 4) the summary carries the default stop's forecast (rounds.stop_when_converged) and, on a
    # stop, its reason.
    later = [labeling_round(str(config)) for _ in range(2)]
    assert len(later[-1]["stability"]["history"]) == 3 and "remaining_change" in later[-1]["stability"]
    summary = (art / "rounds/004/summary.md").read_text()
    assert "forecast change still to come" in summary or "disagreement not falling (at its floor)" in summary
    if later[-1]["stopped"] and later[-1]["stopped"].startswith("converged"):
        assert later[-1]["stopped"] in summary


def test_a_project_without_a_labeled_test_split_is_refused_before_training(tmp_path, tiny_models, prefect_harness):
    from flows.round import labeling_round

    config = write_project(tmp_path, tiny_models, limit=40)
    manifest = tmp_path / "digits" / "manifest.jsonl"
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    # The held-out rows become seed labels: the round has labels to train on but nothing to evaluate with.
    manifest.write_text("".join(json.dumps({**r, "split": "train"} if r["split"] == "test" else r) + "\n"
                                for r in rows))
    with pytest.raises(DataError, match="no labeled test rows among the 40 ingested samples.*split: test"):
        labeling_round(str(config))
    assert "train" not in stage_runs(load_config(config).artifacts)


def test_new_pool_images_do_not_retrain_or_re_evaluate_the_adapter(tmp_path, tiny_models, prefect_harness):
    from flows.round import labeling_round

    config = write_project(tmp_path, tiny_models, limit=40)
    art = load_config(config).artifacts
    labeling_round(str(config))  # round 0: the simulated annotator answers its batch
    first = labeling_round(str(config), simulate=False)  # round 1 trains on those labels
    before = stage_runs(art)
    # Twenty more digits arrive in the pool (the labeled set is the same): a re-run of round 1 over a bigger pool.
    digits = tmp_path / "digits"
    more = write_digits(tmp_path / "more", limit=80)
    rows = [json.loads(line) for line in (more / "manifest.jsonl").read_text().splitlines()]
    known = {json.loads(line)["image"] for line in (digits / "manifest.jsonl").read_text().splitlines()}
    new = [r for r in rows if r["image"] not in known and r["split"] == "pool"][:20]
    for r in new:
        shutil.copy(more / r["image"], digits / r["image"])
    with (digits / "manifest.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in new)
    again = labeling_round(str(config), simulate=False)
    ran = stage_runs(art) - before
    assert again["round"] == 1 and again["pool"] == first["pool"] + len(new)
    assert ran["ingest"] == 1 and ran["preprocess"] >= 1  # the new shard
    assert ran["train"] == 0  # the same labels: the same adapter
    assert again["adapter"]["adapter_digest"] == first["adapter"]["adapter_digest"]
    # The same test rows: the adapter's evaluation is reused, metrics and all.
    assert ran["evaluate"] == 0 and again["metrics"] == first["metrics"]


@pytest.mark.slow  # 158 s here: three rounds with training; tests/test_rounds.py checks the keys in a second
def test_new_weights_in_the_model_folder_retrain_re_evaluate_and_re_score(tmp_path, tiny_models, prefect_harness):
    """Issue 36: replace the model folder's weights and run the round again: the adapter is trained anew on the same
    labels, evaluated and the pool scored with it (the keys held only the folder's path, and nothing retrained)."""
    from test_rounds import _reweigh

    from flows.round import labeling_round

    config = write_project(tmp_path, tiny_models, limit=40)
    art = load_config(config).artifacts
    labeling_round(str(config))
    first = labeling_round(str(config), simulate=False)
    before = stage_runs(art)
    _reweigh(tmp_path / "model")
    again = labeling_round(str(config), simulate=False)
    ran = stage_runs(art) - before
    assert again["round"] == 1 and ran["train"] == 1 and ran["evaluate"] == 1 and ran["score_shard"] >= 1, ran
    assert again["adapter"]["adapter_dir"] != first["adapter"]["adapter_dir"]
    assert ran["ingest"] == 0 and ran["preprocess"] == 0  # the data did not change


@pytest.mark.slow  # three `tamis round` processes, one of them killed
def test_a_round_killed_after_its_evaluation_and_run_again_shows_one_entry_per_round(tmp_path, tiny_models,
                                                                                    prefect_harness):
    """Issue 47: round 1 is killed (SIGKILL) once its evaluation is in metrics.jsonl, before round.json; the team
    changes the strategy and runs it again. The curve, the summary's table and `tamis status` read one entry for
    round 1, the one round.json has."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from prefect.settings import PREFECT_API_URL

    from pipeline.metrics import _curve_lines, read_metrics
    from pipeline.report import curve_table
    from pipeline.status import status_summary

    config = write_project(tmp_path, tiny_models)
    art = load_config(config).artifacts
    tamis = [str(Path(sys.executable).parent / "tamis"), "round", "-c", str(config)]
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}  # the session's test server
    first = subprocess.run(tamis, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout + first.stderr

    run = subprocess.Popen([*tamis, "--no-simulate"], env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 900
    while not any(m["round"] == 1 for m in read_jsonl(art / "metrics.jsonl")):
        assert run.poll() is None and time.monotonic() < deadline, "round 1 ended before its evaluation was logged"
        time.sleep(0.02)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    assert not (art / "rounds" / "001" / "round.json").exists()  # killed past its evaluation, before its end
    killed = {m["strategy"] for m in read_jsonl(art / "metrics.jsonl")}

    cfg = yaml.safe_load(config.read_text())
    cfg["select"].update(strategy="entropy", diversity="top_k")
    config.write_text(yaml.safe_dump(cfg))
    again = subprocess.run([*tamis, "--no-simulate"], env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout + again.stderr
    state = json.loads((art / "rounds" / "001" / "round.json").read_text())
    assert state["round"] == 1 and state["strategy"] not in killed

    rows = read_metrics(art)
    assert sorted((m["round"], m["metric"]) for m in rows) == [(1, "accuracy"), (1, "exact_match")]
    assert {m["strategy"] for m in rows} == {state["strategy"]} and {m["labels"] for m in rows} == {state["labeled"]}
    acc = next(m for m in rows if m["metric"] == "accuracy")
    assert _curve_lines(rows, "accuracy") == {state["strategy"]: {state["labeled"]: (state["metrics"]["accuracy"],
                                                                                   acc.get("ci95"))}}
    assert len(curve_table(rows)) == 3  # the table's header, its rule and round 1
    assert status_summary(art)["last_metrics"] == state["metrics"]
    assert f"- strategy: {state['strategy']}" in (art / "rounds" / "001" / "summary.md").read_text()
