"""What a round shows in the Prefect UI and on the terminal, without a server: run names and tags, the summary with
its curve, the annotator hand-off, progress, the labels a resumed round receives, `tamis status`."""

import base64
import json
import re
from dataclasses import replace

import pytest
import yaml
from typer.testing import CliRunner

from pipeline.annotation.inbox import receive_labels
from pipeline.config import ProjectConfig
from pipeline.errors import DataError
from pipeline.metrics import plot_learning_curve
from pipeline.model.train import planned_train_steps
from pipeline.report import (
    ROUND_STAGES,
    RoundProgress,
    StepReporter,
    curve_table,
    handoff_markdown,
    import_record,
    merge_equal_metrics,
    png_data_uri,
    run_name,
    run_tags,
    state_message,
    summary_markdown,
)
from pipeline.round.stop import main_metric, should_wait
from pipeline.round_state import RoundState

ROWS = [
    {"round": 1, "labels": 6, "metric": "accuracy", "value": 0.25, "strategy": "margin+none"},
    {"round": 1, "labels": 6, "metric": "exact_match", "value": 0.25, "strategy": "margin+none"},
    {"round": 2, "labels": 12, "metric": "accuracy", "value": 0.5, "strategy": "margin+none"},
    {"round": 2, "labels": 12, "metric": "exact_match", "value": 0.5, "strategy": "margin+none"},
]
STATE = RoundState(round=2, labeled=12, pool=40, selected=6, strategy="margin+none",
                   metrics={"accuracy": 0.5, "exact_match": 0.5}, export_dir="/p/art/rounds/002/export")


def test_run_names_and_tags_say_which_round():
    assert run_name(3) == "round-003" and run_name(3, rerun=True) == "round-003-rerun"
    assert run_name(12, suffix="score-pool") == "round-012-score-pool" and run_name(None) == "round-next"
    assert run_tags(3) == ["tamis", "round-003"]
    assert run_tags(3, rerun=True, stopped="max rounds", waiting=True) == [
        "tamis", "round-003", "rerun", "stopped", "waiting-for-labels"]
    assert state_message(STATE) == "round 2: 12 labels, accuracy = exact_match 0.500; 6 samples exported for annotation"
    assert state_message(replace(STATE, stopped="label budget spent")).endswith("; stopped: label budget spent")


def test_equal_metrics_are_shown_once():
    assert merge_equal_metrics({"accuracy": 0.5, "exact_match": 0.5}) == {"accuracy = exact_match": 0.5}
    assert merge_equal_metrics({"exact_match": 0.2, "token_f1": 0.45}) == {"exact_match": 0.2, "token_f1": 0.45}
    assert curve_table(ROWS) == ["| round | labels | accuracy = exact_match |", "|---|---|---|",
                                 "| 1 | 6 | 0.2500 |", "| 2 | 12 | 0.5000 |"]
    # Values that differ in one round keep their own columns; a round without a metric shows a dash.
    rows = [*ROWS[:2], {**ROWS[2], "value": 0.75}, ROWS[3]]
    assert curve_table(rows)[0] == "| round | labels | accuracy = exact_match | accuracy | exact_match |"
    assert curve_table(rows)[3] == "| 2 | 12 | — | 0.7500 | 0.5000 |"


def test_summary_carries_the_curve_as_a_picture_and_its_file(tmp_path):
    png = plot_learning_curve(ROWS, tmp_path / "learning_curve.png")
    uri = png_data_uri(png)
    assert base64.b64decode(uri.split(",", 1)[1]) == png.read_bytes()
    md = summary_markdown(STATE, ROWS, curve_uri=uri, curve_path=png)
    assert f"![learning curve]({uri})" in md and f"PNG: `{png}`" in md
    assert "- test metrics: accuracy = exact_match = 0.5000" in md
    assert "| 2 | 12 | 0.5000 |" in md and md.count("0.5000") == 2
    text = summary_markdown(STATE, ROWS, curve_path=png)  # the summary.md file: no inline image
    assert "data:image" not in text and "## Learning curve" in text


def test_the_reports_curve_is_the_one_the_round_drew_and_stops_at_its_round(tmp_path):
    """The round's report shows the learning curve write_up just drew, read back rather than drawn a second time; the
    report of an earlier round (a rerun, `tamis report --round 1`) leaves later rounds out, on the same chance axis."""
    from pipeline.metrics import learning_curve, round_curve_png

    answers = ["0", "1", "2", "3"]
    drawn = learning_curve(tmp_path, ROWS, answers=answers)
    drawn.write_bytes(drawn.read_bytes() + b"as learning_curve left it")  # the bytes prove the file was read back
    assert round_curve_png(ROWS, 2, answers=answers, drawn=drawn) == drawn.read_bytes()
    first = plot_learning_curve(ROWS[:2], tmp_path / "round1.png", chance=0.25).read_bytes()
    assert round_curve_png(ROWS, 1, answers=answers, drawn=drawn) == first
    assert round_curve_png(ROWS, 1, answers=answers) == first and round_curve_png(ROWS, 0, drawn=drawn) is None


def test_handoff_gives_copyable_paths_and_commands_not_file_links(tmp_path):
    art = tmp_path / "my art"
    md = handoff_markdown(art / "rounds/002/export", artifacts=art, round_index=2, count=6,
                          tasks_file="label_studio_tasks.json", label_config_file="label_config.xml",
                          csv_file="annotate.csv", waiting=True)
    assert "file://" not in md
    assert f"```\n{(art / 'rounds/002/export').resolve()}\n```" in md
    assert f"--directory '{(art / 'rounds/002/export').resolve()}'" in md  # quoted: the path has a space
    assert "http://127.0.0.1:8765/label_studio_tasks.json" in md
    assert f"LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT='{art.resolve()}' \\\n  label-studio start" in md
    assert "tamis resume --labels FILE" in md
    later = handoff_markdown(art / "x", artifacts=art, round_index=0, count=1, tasks_file="t.json",
                             label_config_file="c.xml", csv_file="a.csv")
    assert "tamis labels import FILE" in later and "resume" not in later


def test_round_progress_moves_with_the_stages_and_training_reports_every_n_steps():
    seen = []
    progress = RoundProgress(lambda p, text: seen.append((p, text)))
    for stage, _ in ROUND_STAGES[:3]:
        progress.start(stage)
        progress.finish(stage)
    progress.start("train")
    assert seen[0] == (0.0, "ingest…") and seen[-1][1].startswith("train… (done: ingest, prepare, import labels)")
    progress.skip("train", "evaluate", "label check")
    progress.start("score pool")
    percents = [p for p, _ in seen]
    assert percents == sorted(percents) and 0 < percents[-1] < 100
    progress.complete("round 2: done")
    assert seen[-1] == (100.0, "round 2: done")

    reports, opened = [], []

    def open_sink(total):
        opened.append(total)
        return lambda p, text: reports.append((p, text))

    reporter = StepReporter(open_sink, every=10)
    for step in range(1, 46):
        reporter(step, 45, 2.0 / step)  # the loop's own total comes with each step
    assert opened == [45]  # one progress artifact, titled with the loop's total
    assert [round(p) for p, _ in reports] == [2, 22, 44, 67, 89, 100]  # step 1, every 10th, the last
    assert reports[-1][1].startswith("step 45 / 45, loss 0.0444")
    assert planned_train_steps(None, 2.0, 30, 4) == 15 and planned_train_steps(7, 2.0, 30, 4) == 7


def test_import_record_keeps_the_imports_that_brought_a_rerun_rounds_labels():
    first = {"file": "a.json", "accepted": 6, "already_imported": False}
    previous = RoundState(imports=[first])
    again = [{"file": "a.json", "accepted": 0, "already_imported": True}]
    assert import_record(previous, again) == [first]
    assert import_record(None, [first]) == [first]


def test_labels_received_by_a_resumed_round_land_in_the_inbox_once(tmp_path):
    art = tmp_path / "art"
    export = tmp_path / "annotators" / "export.json"
    export.parent.mkdir()
    export.write_text('[{"data": {"sample_id": "a"}}]')
    dest = receive_labels(art, export, labels_from=export.parent)
    assert dest == art / "inbox" / "export.json" and dest.read_bytes() == export.read_bytes()
    assert receive_labels(art, export, labels_from=export.parent) == dest  # the same content is not copied twice
    export.write_text('[{"data": {"sample_id": "b"}}]')
    # nothing in the inbox is overwritten
    assert receive_labels(art, export, labels_from=export.parent) == art / "inbox" / "export-1.json"
    with pytest.raises(DataError, match=r"missing\.json does not exist"):
        receive_labels(art, tmp_path / "annotators" / "missing.json", labels_from=export.parent)
    (tmp_path / "annotators" / "labels.xlsx").write_text("x")
    with pytest.raises(DataError, match=r"labels\.xlsx: the inbox reads only \.csv, \.json, \.jsonl"):
        receive_labels(art, tmp_path / "annotators" / "labels.xlsx", labels_from=export.parent)


def test_a_resumed_rounds_labels_file_must_lie_inside_a_configured_folder(tmp_path):
    """The resume form is filled in by whoever reaches the Prefect API: a path outside the artifacts folder and
    rounds.labels_from (a worker's secrets, another project's files; through a link too) is refused with the fix."""
    art = tmp_path / "art"
    secret = tmp_path / "home" / "credentials.json"
    secret.parent.mkdir()
    secret.write_text('{"aws": "key"}')
    drop = tmp_path / "annotators"
    drop.mkdir()
    (drop / "link.json").symlink_to(secret)
    for path, labels_from in ((secret, None), (secret, drop), (drop / "link.json", drop),
                              (drop / ".." / "home" / "credentials.json", drop)):
        with pytest.raises(DataError, match=r"lies outside the folders a resumed round may read labels from .*"
                                            r"set rounds\.labels_from"):
            receive_labels(art, path, labels_from=labels_from)
    assert not (art / "inbox").exists()
    (art / "rounds").mkdir(parents=True)
    (art / "rounds" / "answers.json").write_text("[]")
    assert receive_labels(art, art / "rounds" / "answers.json").parent == art / "inbox"  # the artifacts folder is fine


def test_only_a_deployed_round_that_exported_waits_for_labels():
    cfg = ProjectConfig.model_validate({"rounds": {"wait_for_labels": True}})
    assert should_wait(cfg.rounds, STATE, deployed=True)
    assert not should_wait(cfg.rounds, STATE, deployed=False)  # no worker to start it again after a suspend
    assert not should_wait(cfg.rounds, replace(STATE, stopped="max rounds", export_dir=None), deployed=True)
    assert not should_wait(ProjectConfig().rounds, STATE, deployed=True)


MAX_ROUNDS_3 = "rounds.max_rounds = 3: round 2 is the last (0–2); trained, selects nothing"


def _project_with_rounds(tmp_path):
    art = tmp_path / "art"
    for r, stopped in ((0, None), (1, None), (2, MAX_ROUNDS_3)):
        d = art / "rounds" / f"{r:03d}"
        d.mkdir(parents=True)
        state = {"round": r, "labeled": 6 * r, "pool": 40 - 6 * r, "strategy": "margin+cluster_margin",
                 "selected": 0 if stopped else 6, "stopped": stopped,
                 "metrics": {"accuracy": 0.5, "exact_match": 0.5} if r else None}
        if not stopped:
            (d / "export").mkdir()
            (d / "export" / "manifest.json").write_text("{}")
        (d / "round.json").write_text(json.dumps(state))
    (art / "metrics.jsonl").write_text("".join(json.dumps({**row, "round": row["round"]}) + "\n" for row in ROWS))
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"paths": {"artifacts": str(art)}}))
    return config


def test_status_counts_agree_with_its_table_and_json_only_when_asked(tmp_path, monkeypatch):
    from flows.cli.main import app

    config = _project_with_rounds(tmp_path)
    monkeypatch.delenv("COLUMNS", raising=False)
    res = CliRunner().invoke(app, ["status", "-c", str(config)])
    assert res.exit_code == 0, res.output
    out = res.output
    assert "{" not in out and '"rounds_done"' not in out  # no raw dump
    table_rounds = [line for line in out.splitlines() if re.match(r"│\s+\d+ │", line)]
    assert len(table_rounds) == 3
    assert "rounds finished: 3 (exported for annotation: 2)" in out
    assert "last evaluated round 2: accuracy = exact_match 0.500" in out
    # Piped (no terminal, no COLUMNS): the table keeps its natural width instead of rich's 80 columns.
    assert "accuracy" in out and "strategy" in out and "…" not in out
    assert "margin+cluster_margin" in out and MAX_ROUNDS_3 in out

    res = CliRunner().invoke(app, ["status", "-c", str(config), "--json"])
    data = json.loads(res.output)
    assert data["rounds_done"] == 3 == len(data["rounds"]) and data["rounds_exported"] == [0, 1]
    assert data["rounds"][2]["stopped"].startswith("rounds.max_rounds")


def test_rounds_table_names_the_metric_it_shows():
    from rich.console import Console

    from flows.cli.cmd_rounds import _rounds_table

    open_rounds = [RoundState(round=0, labeled=0, strategy="cold start: random", metrics=None),
                   RoundState(round=1, labeled=40, strategy="token_entropy+cluster_margin",
                              metrics={"exact_match": 0.5, "token_f1": 0.625, "edit_similarity": 0.7})]
    console = Console(width=200, record=True)
    console.print(_rounds_table(open_rounds, main_metric(None)))
    text = console.export_text()
    assert "token f1" in text and "accuracy" not in text and "0.625" in text
    console.print(_rounds_table([STATE], main_metric(["0", "1"])))
    text = console.export_text()
    assert "accuracy" in text and "0.500" in text


def test_resume_names_what_is_missing(tmp_path):
    from flows.cli.main import app
    from pipeline.errors import ConfigError

    config = _project_with_rounds(tmp_path)
    res = CliRunner().invoke(app, ["resume", "-c", str(config), "--labels", str(tmp_path / "nope.json")])
    assert isinstance(res.exception, DataError) and "--labels" in str(res.exception) and "nope.json" in str(res.exception)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        res = CliRunner().invoke(app, ["resume", "-c", str(config)])
    assert isinstance(res.exception, ConfigError) and "`tamis resume`" in str(res.exception)


def test_library_logs_to_the_ui_skip_known_harmless_warnings_and_need_a_run():
    import logging

    from flows.ui import HarmlessFilter, detach, library_logs_to_ui

    def rec(msg):
        return logging.LogRecord("py.warnings", logging.WARNING, "x.py", 1, msg, None, None)

    noisy = rec("/site-packages/peft/peft_model.py:1: FutureWarning: `is_gradient_checkpointing` is deprecated")
    assert not HarmlessFilter().filter(noisy) and HarmlessFilter().filter(rec("UserWarning: something new"))
    before = logging.getLogger("pipeline").handlers[:]
    with library_logs_to_ui():  # outside a flow run: nothing attached, nothing sent
        assert logging.getLogger("pipeline").handlers == before
    refs = [{"dir": "a", "digest": "b"}]
    assert detach(refs) == refs and detach(refs) is not refs and detach(refs)[0] is not refs[0]


def test_next_steps_say_where_the_batch_is_how_labels_come_back_and_what_comes_next(tmp_path):
    from pipeline.report import next_steps

    files = {"tasks": "label_studio_tasks.json", "csv": "annotate.csv", "jsonl": "annotate.jsonl"}
    export = tmp_path / "art" / "rounds" / "000" / "export"
    state = RoundState(round=0, labeled=0, selected=40, export_dir=str(export))
    lines = next_steps(state, artifacts=tmp_path / "art", config="my.yaml", files=files, batch_size=40, max_rounds=4)
    text = "\n".join(lines)
    assert f"batch for annotators (40 images): {export}" in text and "annotate.csv" in text
    assert f"into {(tmp_path / 'art' / 'inbox').resolve()}" in text and "`tamis round -c my.yaml`" in text
    assert "next round (1): imports them, trains the adapter on 40 labels, evaluates it and selects 40 more" in text
    # The round before the last: its successor only trains and evaluates (rounds.max_rounds counts every round).
    last = next_steps(replace(state, round=2, labeled=80), artifacts=tmp_path / "art", config="", files=files,
                      batch_size=40, max_rounds=4)
    assert "next round (3): imports them, trains the adapter on 120 labels, evaluates it, and stops there" in last[-1]
    stopped = next_steps(replace(state, stopped="rounds.max_rounds = 4: …", adapter={"adapter_dir": "/a/3"}),
                         artifacts=tmp_path, config="", files=files, batch_size=40, max_rounds=4)
    assert stopped == ["stopped: rounds.max_rounds = 4: …", "the model: adapter /a/3 (docs/use-your-model.md)"]


HOSTILE = ["cat | dog", "![x](http://evil.example/p.png)", "<script>alert(1)</script>", "a_b *c*\nd", "back\\slash"]


def test_the_summary_shows_class_and_annotator_names_as_text_never_as_markup():
    """Issue 46 #15: summary.md (a Prefect markdown artifact) copied names raw: a `|` shifted the table's columns,
    `![](http://…)` fetched a remote image when viewed, `<script>` reached the markdown."""
    from pathlib import Path

    from markdown_it import MarkdownIt

    from pipeline.labelcheck import label_report_markdown
    from pipeline.perclass import EvalReport, per_class_report

    refs = [HOSTILE[i % 5] for i in range(20)]
    pc = per_class_report([HOSTILE[(i * 3) % 5] for i in range(20)], refs, HOSTILE, resamples=20)
    who = {"annotator": "eve | ![](http://evil.example/a.png)", "votes": 3, "shared": 3, "agreement": 1.0,
           "accuracy": None}
    consensus = {"method": "majority", "model_rater": False, "annotators": [who], "samples": 3, "undecided": 0,
                 "mean_confidence": 1.0}
    issue = {"rank": 1, "sample_id": "s|1", "given_label": HOSTILE[1], "suggested_label": HOSTILE[2],
             "confidence": 0.9, "signals": ["model"], "annotators": [who["annotator"]], "origin": "human",
             "source_file": "/inbox/<b>x</b>.csv"}
    checked = label_report_markdown([issue], {who["annotator"]: {"n": 3, "agree_majority": 1.0, "n_model": 3,
                                                                 "agree_model": 0.5}}, method="kfold", checked=3)
    state = replace(STATE, consensus=consensus, imports=[{"file": "l|x.csv", "error": "![](http://evil.example/e.png)"}])
    md = summary_markdown(state, [], checked, evaluation=EvalReport(Path("/nowhere"), pc, None))
    html = MarkdownIt("commonmark").enable("table").render(md)
    assert "<img" not in html and not [u for u in re.findall(r'(?:src|href)="([^"]*)"', html) if "evil" in u]
    assert "<script" not in html and "<b>" not in html
    for table in re.findall(r"<table>.*?</table>", html, flags=re.S):
        header = len(re.findall(r"<th[ >]", table.split("</thead>")[0]))
        assert {len(re.findall(r"<td[ >]", row)) for row in re.findall(r"<tr>(.*?)</tr>", table.split("</thead>")[1],
                                                                     flags=re.S)} == {header}
    text = re.sub(r"<[^>]+>", "", html)  # what the reader sees: every name, as written (its newline a space)
    for name in [*HOSTILE[:4], "back\\slash", who["annotator"]]:
        shown = name.replace("\n", " ").replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        assert shown in text, name


def test_escape_md_leaves_plain_text_alone_and_escapes_each_markup_character():
    from pipeline.mdtext import escape_md

    assert escape_md("golden retriever 3") == "golden retriever 3"
    assert escape_md("a|b") == "a\\|b" and escape_md("x\r\ny\nz") == "x y z"
    assert escape_md("\\`*_[]()!|<>#") == "".join("\\" + c for c in "\\`*_[]()!|<>#")
