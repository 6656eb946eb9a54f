import json

import pytest
from typer.testing import CliRunner

from pipeline.annotation.inbox import import_inbox, inbox_dir
from pipeline.annotation.label_files import read_label_file
from pipeline.annotation.labels import import_labels
from pipeline.annotation.ledger import Ledger, ledger_path
from pipeline.errors import LabelImportError

DIGITS = [str(i) for i in range(10)]
KNOWN = {f"s{i:03d}" for i in range(12)}


def _ann(label, who=1, cancelled=False, kind="choices"):
    value = {"choices": [label]} if kind == "choices" else {"text": [label]}
    result = [] if cancelled or label is None else [
        {"from_name": "answer", "to_name": "image", "type": kind, "value": value}]
    return {"completed_by": who, "result": result, "was_cancelled": cancelled}


def _task(sid, *anns, where="data"):
    t = {"id": 1, "data": {"image": f"/data/local-files/?d=rounds/001/export/images/{sid}.png", "text": "q"},
         "annotations": list(anns)}
    if where == "data":
        t["data"]["sample_id"] = sid
    elif where == "meta":
        t["meta"] = {"sample_id": sid}
    return t


def _write(path, obj):
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj, indent=2), encoding="utf-8")
    return path


@pytest.fixture
def env(tmp_path):
    led = Ledger(tmp_path / "artifacts" / "labels.jsonl")

    def run(path, *, answers=DIGITS, strict=False, round_index=1):
        return import_labels(path, known_ids=KNOWN, answers=answers, ledger=led, round_index=round_index,
                             rejections_dir=tmp_path / "artifacts" / "rejections", strict=strict)

    return led, run


def _ledger_bytes(led):
    return led.path.read_bytes() if led.path.exists() else b""


def test_label_studio_json_majority_tie_cancelled_and_accounting(tmp_path, env):
    led, run = env
    tasks = [
        _task("s000", _ann("3", 1), _ann("3", 2), _ann("5", 3)),  # majority 3, a conflict
        _task("s001", _ann("4", 1), _ann("7", 2)),  # tie: not accepted
        _task("s002", _ann(None, 1, cancelled=True), _ann("2", 2)),  # one skipped
        _task("s003", _ann("6", {"id": 9, "email": "a@b.c"}), where="meta"),  # ID from meta
        _task("s004", _ann("1", 1), where="image"),  # ID from the exported image name
        _task("s005"),  # never annotated: not a label row
        _task("s006", _ann(None, 4)),  # empty result = skipped
    ]
    rep = run(_write(tmp_path / "ls.json", tasks))
    assert rep.format == "label_studio"
    assert led.labels() == {"s000": "3", "s002": "2", "s003": "6", "s004": "1"}
    assert rep.rows_read == 10 and rep.skipped_cancelled == 2 and rep.unlabeled_tasks == 1
    assert rep.accepted_rows + len(rep.rejected) + rep.skipped_cancelled == rep.rows_read
    assert {(c.sample_id, c.outcome, c.label) for c in rep.conflicts} == {("s000", "majority", "3"),
                                                                          ("s001", "tie", None)}
    assert [r.sample_id for r in rep.rejected] == ["s001", "s001"] and "tie" in rep.rejected[0].reason
    s000 = led.current()["s000"]
    assert s000["annotator"] == "1,2" and len(s000["votes"]) == 3
    assert led.current()["s003"]["annotator"] == "a@b.c"
    assert {e["source_digest"] for e in led.entries()} == {rep.digest}
    rejected = [json.loads(x) for x in open(rep.rejections_file)]
    assert len(rejected) == 2 and rejected[0]["line"] == rep.rejected[0].line


def test_json_min_csv_and_jsonl_formats(tmp_path, env):
    led, run = env
    json_min = [{"image": "x", "sample_id": "s000", "answer": "1", "annotator": "u@x"},
                {"image": "y", "sample_id": "s001", "answer": {"choices": ["2"]}, "annotator": "u@x"},
                {"image": "z", "sample_id": "s002"}]
    rep = run(_write(tmp_path / "min.json", json_min))
    assert rep.format == "label_studio_min" and rep.unlabeled_tasks == 1 and len(rep.accepted) == 2
    rep = run(_write(tmp_path / "l.csv", "\ufeffsample_id,label,annotator\ns003, 3 ,bob\n\ns004,4,bob\n"))
    assert rep.format == "csv" and len(rep.accepted) == 2
    rep = run(_write(tmp_path / "l.jsonl", '{"sample_id": "s005", "label": "5"}\n\n{"sample_id": "s006", "label": "6"}\n'))
    assert rep.format == "jsonl" and len(rep.accepted) == 2
    assert led.labels() == {"s000": "1", "s001": "2"} | {f"s{i:03d}": str(i) for i in range(3, 7)}
    assert led.current()["s003"]["annotator"] == "bob" and led.current()["s005"]["annotator"] == "unknown"


def test_row_rejections_name_file_and_line(tmp_path, env):
    led, run = env
    text = ("sample_id,label\n"
            "s000,1\n"          # line 2 ok
            "s999,1\n"          # 3 unknown id
            "s001,cat\n"        # 4 not in the answer set
            "s002,  \n"         # 5 empty
            "s000,1\n"          # 6 duplicate of line 2
            "s003,3\n")         # 7 ok
    path = _write(tmp_path / "rows.csv", text)
    before = _ledger_bytes(led)
    with pytest.raises(LabelImportError) as exc:
        run(path, strict=True)
    msg = str(exc.value)
    assert "4 of 6 label rows rejected, nothing imported" in msg and f"{path}:3" in msg
    assert _ledger_bytes(led) == before

    rep = run(path)
    reasons = {r.line: r.reason for r in rep.rejected}
    assert set(reasons) == {3, 4, 5, 6}
    assert "unknown sample_id 's999'" in reasons[3] and "12 samples" in reasons[3]
    assert "'cat' is not in the answer set [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]" in reasons[4]
    assert "empty label" in reasons[5]
    assert f"duplicate row: s000 by unknown already given at {path}:2" in reasons[6]
    assert rep.rows_read == 6 and rep.accepted_rows == 2 and rep.accounted
    assert led.labels() == {"s000": "1", "s003": "3"}
    assert [json.loads(x)["line"] for x in open(rep.rejections_file)] == [3, 4, 5, 6]


@pytest.mark.parametrize(
    "name, text, where",
    [
        ("bad.json", '[\n  {"data": {"sample_id": "s000"},\n   "annotations": [}\n]', ":3:"),
        ("bad2.json", '[{"data": {"sample_id": "s000"}, "annotations": []}\n\n{"data": {}}]', ":3:"),
        ("obj.json", '{"tasks": []}', ":1: expected a JSON list"),
        ("empty.json", "  \n", "the file is empty"),
        ("bad.csv", 'sample_id,label\ns000,1\ns001,"2\n', ":3"),
        ("fields.csv", "sample_id,label\ns000,1\ns001,2,3\n", ":3: 3 fields, but the header has 2"),
        ("header.csv", "annotator,seconds\nbob,3\n", ":1: the header lacks column(s) label, sample_id (or id"),
        ("bad.jsonl", '{"sample_id": "s000", "label": "1"}\n{"sample_id": "s001", "label": }\n', ":2:"),
        ("list.jsonl", '["s000", "1"]\n', ":1: a list"),
        ("labels.txt", "s000 1\n", "unknown label file type '.txt'"),
    ],
)
def test_malformed_files_name_the_line_and_append_nothing(tmp_path, env, name, text, where):
    led, run = env
    run(_write(tmp_path / "ok.jsonl", '{"sample_id": "s011", "label": "1"}\n'))
    before = _ledger_bytes(led)
    path = _write(tmp_path / name, text)
    with pytest.raises(LabelImportError) as exc:
        run(path)
    assert f"{path}" in str(exc.value) and where in str(exc.value)
    assert _ledger_bytes(led) == before


def test_other_project_and_unannotated_exports_are_errors(tmp_path, env):
    led, run = env
    with pytest.raises(LabelImportError, match="none of its 2 sample IDs .* another project"):
        run(_write(tmp_path / "other.json", [_task("zz1", _ann("1")), _task("zz2", _ann("2"))]))
    with pytest.raises(LabelImportError, match="no label rows in 2 task"):
        run(_write(tmp_path / "todo.json", [_task("s000"), _task("s001")]))
    assert not led.path.exists()


def test_double_import_is_a_noop_and_a_changed_label_is_a_correction(tmp_path, env):
    led, run = env
    a = _write(tmp_path / "a.json", [_task("s000", _ann("1")), _task("s001", _ann("2"))])
    first = run(a)
    after_first = _ledger_bytes(led)
    again = run(a)
    assert again.already_imported and again.accepted == [] and _ledger_bytes(led) == after_first
    b = _write(tmp_path / "b.jsonl", '{"sample_id": "s000", "label": "7"}\n{"sample_id": "s001", "label": "2"}\n')
    rep = run(b, round_index=2)
    assert rep.corrections == 1 and rep.unchanged == ["s001"]
    hist = led.history("s000")
    assert [(e["kind"], e["label"], e["round"]) for e in hist] == [("label", "1", 1), ("correction", "7", 2)]
    assert hist[1]["supersedes"] == first.accepted[0]["entry_id"]
    assert led.labels()["s000"] == "7" and len(led.history("s001")) == 1


def test_open_answers_accept_free_text(tmp_path, env):
    led, run = env
    rep = run(_write(tmp_path / "open.json", [_task("s000", _ann(" a red bus ", kind="textarea"))]), answers=None)
    assert len(rep.accepted) == 1 and led.labels() == {"s000": "a red bus"}


def test_inbox_imports_each_file_on_its_own_and_rejects_a_corrupt_one_with_its_line(tmp_path):
    art = tmp_path / "artifacts"
    inbox = inbox_dir(art)
    inbox.mkdir(parents=True)
    _write(inbox / "1-good.csv", "sample_id,label\ns000,1\n")
    _write(inbox / "2-bad.json", '[{"data": {"sample_id": "s001"}, "annotations": [\n}]')
    _write(inbox / ".3-partial.json.tmp", "[")  # an atomic write still in progress
    (inbox / "notes.txt").write_text("ignored")
    _write(inbox / "3-more.jsonl", '{"sample_id": "s002", "label": "2"}\n')
    _write(inbox / "4-copy.csv", "sample_id,label\ns000,1\n")  # same bytes as 1-good.csv
    kw = dict(index=KNOWN, answers=DIGITS, round_index=1)
    reps = import_inbox(art, **kw)
    assert [r["file"].rsplit("/", 1)[1] for r in reps] == ["1-good.csv", "2-bad.json", "3-more.jsonl", "4-copy.csv"]
    assert "2-bad.json:2:" in reps[1]["error"] and "accepted" not in reps[1]
    assert [r.get("accepted") for r in reps] == [1, None, 1, 0] and reps[3]["already_imported"]
    led = Ledger(ledger_path(art))
    assert led.labels() == {"s000": "1", "s002": "2"}
    again = import_inbox(art, **kw)
    assert [r.get("already_imported") for r in again] == [True, None, True, True]  # the bad file is reported again
    assert led.labels() == {"s000": "1", "s002": "2"} and (inbox / "1-good.csv").exists()  # nothing is moved


@pytest.mark.parametrize("name, head, last", [
    ("copying.csv", "sample_id,label\ns000,a photo of a dog\n", "s001,José's café"),
    ("copying.jsonl", '{"sample_id": "s000", "label": "a photo of a dog"}\n', '{"sample_id": "s001", "label": "José\'s café"}'),
])
def test_an_inbox_file_still_being_copied_is_refused_and_read_again_next_round(tmp_path, name, head, last):
    """A last row without its line end is a copy in progress: a cut open answer ("José's ca") is never a label."""
    art = tmp_path / "artifacts"
    inbox = inbox_dir(art)
    inbox.mkdir(parents=True)
    (inbox / name).write_text(head + last[:-6], encoding="utf-8")
    kw = dict(index=KNOWN, answers=None, round_index=1)
    for _ in range(2):  # this round, and the next while the copy is still unfinished
        (rep,) = import_inbox(art, **kw)
        assert f"{name}:{head.count(chr(10)) + 1}: the last row has no line end" in rep["error"]
        assert "read again next time" in rep["error"]
        assert not ledger_path(art).exists()  # nothing imported, the file not marked: its whole rows wait too
    (inbox / name).write_text(head + last + "\n", encoding="utf-8")  # the copy finished
    (rep,) = import_inbox(art, **kw)
    assert rep["accepted"] == 2 and Ledger(ledger_path(art)).labels()["s001"] == "José's café"


def test_read_label_file_rejects_non_utf8(tmp_path):
    p = tmp_path / "latin.csv"
    p.write_bytes(b"sample_id,label\ns000,caf\xe9\n")
    with pytest.raises(LabelImportError, match=r"latin.csv:2: not UTF-8"):
        read_label_file(p)


def test_cli_import_and_history(tmp_path, make_vqa, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps table cells to the terminal width
    from flows.cli.main import app
    from pipeline.annotation.export import export_dir, export_selection
    from pipeline.config import load_config

    ds, _ = make_vqa(n=4)
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(f"paths: {{artifacts: {tmp_path / 'art'}}}\ndata: {{answers: {DIGITS}}}\n")
    cfg = load_config(cfg_path)
    sel = [{"sample_id": f"s00{i}", "rank": i, "score": 1.0, "scores": {}} for i in range(3)]
    export_selection(sel, ds, cfg.annotate, cfg.data.answers, cfg.artifacts, export_dir(cfg.artifacts, 1), round_index=1)
    runner = CliRunner()
    f1 = _write(tmp_path / "a.jsonl", '{"sample_id": "s000", "label": "4"}\n{"sample_id": "s003", "label": "4"}\n')
    res = runner.invoke(app, ["labels", "import", str(f1), "--config", str(cfg_path)])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())  # log lines wrap at the terminal width
    assert "1 labels appended" in out and "unknown sample_id 's003'" in out  # s003 never exported
    f2 = _write(tmp_path / "b.csv", "sample_id,label\ns000,9\n")
    assert runner.invoke(app, ["labels", "import", str(f2), "-c", str(cfg_path), "--round", "2"]).exit_code == 0
    res = runner.invoke(app, ["labels", "history", "s000", "-c", str(cfg_path)])
    assert res.exit_code == 0, res.output
    # Table cells wrap with the terminal width: check the words, and the kinds in the ledger the table shows.
    assert "s000" in res.output
    kinds = [e["kind"] for e in Ledger(ledger_path(cfg.artifacts)).history("s000")]
    assert kinds == ["label", "correction"]
    assert runner.invoke(app, ["labels", "history", "s001", "-c", str(cfg_path)]).exit_code == 1


def _ls_task(task_id, sid, *anns, task_set="001/export"):
    """A task as a Label Studio JSON export gives it back: its own ID, each annotation's ID, the set tamis pushed it
    in (data.tamis_set) and the image under that set's folder."""
    t = _task(sid, *anns)
    t["id"] = task_id
    t["data"]["tamis_set"] = task_set
    t["data"]["image"] = f"/data/local-files/?d=rounds/{task_set}/images/{sid}.png"
    for a in anns:
        a["id"] = task_id * 100 + a["completed_by"]
    return t


def test_a_whole_project_export_with_a_re_label_task_lands_the_correction(tmp_path, env):
    """Issue 36: import the round's export, then the whole-project export (Label Studio's default) that holds the
    round's task again and the label check's re-label task for the same sample: 3 → 8 is a correction, not a
    conflict between annotators, and the round's answer already taken is not read as a new vote."""
    led, run = env
    round_task = _ls_task(11, "s003", _ann("3", 1))
    run(_write(tmp_path / "round-001.json", [round_task, _ls_task(12, "s004", _ann("4", 1))]))
    assert led.labels()["s003"] == "3"
    relabel = _ls_task(31, "s003", _ann("8", 2), task_set="001/relabel")
    project = [round_task, _ls_task(12, "s004", _ann("4", 1)), relabel]
    rep = run(_write(tmp_path / "project.json", project), round_index=2)
    assert rep.conflicts == [] and rep.rejected == [] and rep.corrections == 1, rep.summary()
    assert rep.already_taken == 2 and rep.accounted  # the round's two annotations, taken by the first import
    assert [(e["kind"], e["label"]) for e in led.history("s003")] == [("label", "3"), ("correction", "8")]
    # The next whole-project export brings nothing new: a label corrected in tamis meanwhile is never reverted.
    run(_write(tmp_path / "fix.csv", "sample_id,label\ns003,9\n"), round_index=3)
    again = run(_write(tmp_path / "project-2.json", project + [_ls_task(13, "s005", _ann("5", 1))]), round_index=3)
    assert again.already_taken == 3 and [e["sample_id"] for e in again.accepted] == ["s005"]
    assert led.labels()["s003"] == "9"


def test_a_round_task_and_its_re_label_task_first_seen_together_are_label_then_correction(tmp_path, env):
    """Both tasks new in one export (the round's export never imported on its own): the round's answer is the label,
    the re-label task's answer corrects it; a re-label task known only by its image folder counts the same."""
    led, run = env
    relabel = _ls_task(31, "s003", _ann("8", 2), task_set="001/relabel")
    del relabel["data"]["tamis_set"]  # imported into Label Studio by hand, not pushed by tamis
    rep = run(_write(tmp_path / "project.json", [_ls_task(11, "s003", _ann("3", 1)), relabel]))
    assert rep.conflicts == [] and rep.rejected == [], rep.summary()
    assert [(e["kind"], e["label"]) for e in led.history("s003")] == [("label", "3"), ("correction", "8")]
    # Two annotators on one round task still vote (their tie is no correction).
    tie = run(_write(tmp_path / "tie.json", [_ls_task(14, "s006", _ann("1", 1), _ann("2", 2))]))
    assert [c.outcome for c in tie.conflicts] == ["tie"] and "s006" not in led.labels()


def test_the_first_import_makes_the_inbox_and_a_made_inbox_changes_no_round_input(tmp_path):
    """Round 0's message says "put the labeled file in artifacts/inbox": that folder must exist then (`cp f.csv
    artifacts/inbox` into a missing folder makes a file named inbox), and making it must not count as a change."""
    from pipeline.annotation.inbox import import_inbox, inbox_dir
    from pipeline.unchanged import _listing

    art = tmp_path / "artifacts"
    before = _listing(inbox_dir(art))
    assert import_inbox(art, index=set(), answers=None, round_index=0) == []
    assert inbox_dir(art).is_dir() and _listing(inbox_dir(art)) == before == []
