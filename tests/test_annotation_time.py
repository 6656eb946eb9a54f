"""Annotator time: Label Studio's lead_time and a `seconds` column reach an append-only log beside the ledger, and
`tamis status` / the round summary report hours, per-annotator median and p90, and the next batch's forecast."""

import json

import pytest

from pipeline.annotation.labels import import_labels
from pipeline.annotation.ledger import Ledger, ledger_path
from pipeline.status import annotation_time

DIGITS = [str(i) for i in range(10)]
KNOWN = {f"s{i:03d}" for i in range(12)}


def ls_task(sid, *anns):
    return {"id": int(sid[1:]) + 1, "data": {"sample_id": sid}, "annotations": list(anns)}


def ls_ann(label, who, seconds, ann_id):
    return {"id": ann_id, "completed_by": who, "was_cancelled": False, "lead_time": seconds,
            "result": [{"from_name": "answer", "to_name": "image", "type": "choices", "value": {"choices": [label]}}]}


@pytest.fixture
def project(tmp_path):
    art = tmp_path / "artifacts"
    led = Ledger(ledger_path(art))

    def run(path, **kw):
        return import_labels(path, known_ids=KNOWN, answers=DIGITS, ledger=led, round_index=1,
                             rejections_dir=art / "rejections", **kw)

    return art, led, run


def test_label_studio_lead_time_is_kept_per_annotation_outvoted_ones_too(tmp_path, project):
    art, led, run = project
    f = tmp_path / "export.json"
    f.write_text(json.dumps([
        ls_task("s000", ls_ann("3", 1, 12.5, 1), ls_ann("3", 2, 30.0, 2), ls_ann("4", 3, 7.5, 3)),
        ls_task("s001", ls_ann("1", 1, 20.0, 4)),
    ]))
    rep = run(f)
    assert len(rep.accepted) == 2 and "4 timed annotations, 0.02 h" in rep.summary()
    assert sorted((t["sample_id"], t["annotator"], t["seconds"]) for t in led.times()) == [
        ("s000", "1", 12.5), ("s000", "2", 30.0), ("s000", "3", 7.5), ("s001", "1", 20.0)]
    assert run(f).already_imported and len(led.times()) == 4  # the same file again adds nothing


def test_a_confirming_relabel_changes_no_label_but_its_time_counts(tmp_path, project):
    art, led, run = project
    (tmp_path / "a.csv").write_text("sample_id,label,seconds\ns000,3,10\n")
    (tmp_path / "b.csv").write_text("sample_id,label,annotator,seconds\ns000,3,reviewer,40\n")
    run(tmp_path / "a.csv")
    rep = run(tmp_path / "b.csv")
    assert rep.unchanged == ["s000"] and not rep.accepted
    assert [t["seconds"] for t in led.times()] == [10.0, 40.0]


def test_json_min_and_jsonl_times_and_bad_times_are_rejected_with_the_fix(tmp_path, project):
    art, led, run = project
    (tmp_path / "min.json").write_text(json.dumps([{"sample_id": "s002", "answer": "2", "lead_time": 8}]))
    (tmp_path / "t.jsonl").write_text('{"sample_id": "s003", "label": "5", "lead_time": "6.5"}\n'
                                      '{"sample_id": "s004", "label": "5"}\n')
    (tmp_path / "bad.csv").write_text("sample_id,label,seconds\ns005,1,soon\ns006,1,-3\ns007,1,\n")
    assert run(tmp_path / "min.json").times[0]["seconds"] == 8.0
    assert [t["seconds"] for t in run(tmp_path / "t.jsonl").times] == [6.5]  # s004 has no time: none recorded
    rep = run(tmp_path / "bad.csv")
    reasons = {r.sample_id: r.reason for r in rep.rejected}
    assert "'soon' is not a number of seconds" in reasons["s005"] and "must be a finite number" in reasons["s006"]
    assert [e["sample_id"] for e in rep.accepted] == ["s007"] and not rep.times  # an empty cell is unknown


def test_a_dry_run_writes_no_time(tmp_path, project):
    art, led, run = project
    (tmp_path / "a.csv").write_text("sample_id,label,seconds\ns000,3,10\n")
    assert run(tmp_path / "a.csv", dry_run=True).times and not led.times_path.exists()


def test_status_reports_hours_per_annotator_and_the_next_batch(tmp_path, project):
    art, led, run = project
    assert annotation_time(art) is None  # nothing timed: nothing claimed
    rows = "".join(f"s{i:03d},{i % 10},{who},{sec}\n" for i, (who, sec) in enumerate(
        [("ann", 10), ("ann", 20), ("ann", 30), ("ann", 100), ("bob", 60), ("bob", 60)]))
    (tmp_path / "t.csv").write_text("sample_id,label,annotator,seconds\n" + rows)
    run(tmp_path / "t.csv")
    t = annotation_time(art, next_batch=36)
    assert t["hours"] == pytest.approx(280 / 3600, abs=1e-3) and t["timed"] == 6
    assert t["annotators"]["ann"] == {"n": 4, "median_s": 25.0, "p90_s": 79.0}
    assert t["annotators"]["bob"]["median_s"] == 60.0
    assert t["median_s"] == 45.0 and t["next_batch_hours"] == pytest.approx(36 * 45 / 3600, abs=1e-3)


# ------------------------------------------------------------------ each annotation counted once (issue 46, row 8)
def _votes_and_time(art):
    from pipeline.annotation.consensus import read_votes

    votes = sorted((v.sample_id, v.annotator, v.label) for vs in read_votes(art).values() for v in vs)
    return votes, sum(t["seconds"] for t in Ledger(ledger_path(art)).times())


def _import(art, path, known):
    return import_labels(path, known_ids=known, answers=DIGITS, ledger=Ledger(ledger_path(art)), round_index=1,
                         rejections_dir=art / "rejections")


def test_a_csv_imported_half_written_then_whole_books_time_and_votes_once(tmp_path):
    """20 rows of a 40-row file, then all 40: the same seconds and votes as the 40 imported once (200 s, not 300)."""
    known = {f"x{i:02d}" for i in range(20)}
    rows = [f"x{i // 2:02d},{i % 10 // 2},{'ann' if i % 2 else 'bob'},5\n" for i in range(40)]
    head = "sample_id,label,annotator,seconds\n"
    whole, half = tmp_path / "whole.csv", tmp_path / "half.csv"
    whole.write_text(head + "".join(rows))
    half.write_text(head + "".join(rows[:20]))
    _import(tmp_path / "once", whole, known)
    _import(tmp_path / "twice", half, known)
    half.write_text(head + "".join(rows))  # the copy finished: the same file, whole
    rep = _import(tmp_path / "twice", half, known)
    once, twice = _votes_and_time(tmp_path / "once"), _votes_and_time(tmp_path / "twice")
    assert once[1] == 200.0 and twice == once and len(twice[0]) == 40
    assert not rep.already_imported and len(rep.times) == 20  # only the 20 rows it had not seen
    assert Ledger(ledger_path(tmp_path / "twice")).labels() == Ledger(ledger_path(tmp_path / "once")).labels()


def test_cumulative_label_studio_exports_count_each_annotation_once_its_newest_version(tmp_path, project):
    art, led, run = project
    a1 = ls_ann("3", 1, 10.0, 101) | {"updated_at": "2026-01-01T10:00:00Z"}
    b = ls_ann("3", 2, 20.0, 102) | {"updated_at": "2026-01-02T10:00:00Z"}
    a2 = ls_ann("5", 1, 15.0, 101) | {"updated_at": "2026-01-03T10:00:00Z"}  # annotation 101 edited: 5 s more
    for n, anns in enumerate(([a1], [a1, b], [a2, b])):  # v1, v2 (a second opinion), v3 (the first one edited)
        (tmp_path / f"v{n}.json").write_text(json.dumps([ls_task("s000", *anns)]))
        run(tmp_path / f"v{n}.json")
    votes, seconds = _votes_and_time(art)
    assert votes == [("s000", "1", "5"), ("s000", "2", "3")] and seconds == 35.0
    # An older export imported late, with a third opinion: it re-reads 101's older version, which stays replaced.
    (tmp_path / "late.json").write_text(json.dumps([ls_task("s000", a1, b, ls_ann("5", 3, 7.0, 103))]))
    run(tmp_path / "late.json")
    assert _votes_and_time(art) == (votes + [("s000", "3", "5")], seconds + 7.0)


def test_the_newest_version_of_an_annotation_is_chosen_by_instant_not_by_text():
    """updated_at as text sorts `…:00Z` after `…:00.400000Z`; the version from 0.4 s later must win (issue 46 #10,
    the time and vote logs' side of it)."""
    from pipeline.annotation.counted import count_once

    key = '["ls", "s1", "7", "11", "ann"]'
    older = {"annotation": key, "updated_at": "2026-01-01T10:00:00Z", "label": "old", "seconds": 5.0}
    newer = {"annotation": key, "updated_at": "2026-01-01T10:00:00.400000Z", "label": "new", "seconds": 9.0}
    for rows in ([older, newer], [newer, older]):
        assert [r["label"] for r in count_once(rows)] == ["new"]
