"""Rejected label rows after a round (issue 47): named with file:line and reason in the round's output, counted by
`tamis status`, their samples back among the next batch's candidates, their annotations not taken for ever."""

import json

import pyarrow as pa

from pipeline.annotation.inbox import import_inbox, inbox_dir
from pipeline.annotation.labels import import_labels
from pipeline.annotation.ledger import Ledger, ledger_path
from pipeline.annotation.matching import SampleIndex
from pipeline.report import rejection_lines, summary_markdown
from pipeline.round.plan import PoolData, RoundPlan, eligible_pool
from pipeline.round_state import RoundState
from pipeline.status import status_summary

DIGITS = [str(i) for i in range(10)]
IDS = [f"s{i:03d}" for i in range(12)]


def _export(art, round_index, sids):
    folder = art / "rounds" / f"{round_index:03d}" / "export"
    folder.mkdir(parents=True)
    tasks = [{"id": i, "data": {"sample_id": s, "image": f"images/{s}.png"}} for i, s in enumerate(sids)]
    (folder / "label_studio_tasks.json").write_text(json.dumps(tasks))


def _plan(art, index):
    return RoundPlan(index=index, dir=art / "rounds" / f"{index:03d}", labels=Ledger(ledger_path(art)).labels(),
                     labeled_digest="-", rerun=None, previous=[], history=[])


def test_rejected_rows_are_named_counted_and_their_samples_return_to_the_candidates(tmp_path):
    art = tmp_path / "artifacts"
    _export(art, 0, ["s000", "s001", "s002", "s003"])
    inbox_dir(art).mkdir(parents=True)
    (inbox_dir(art) / "batch0.csv").write_text("sample_id,label\ns000,3\ns001,x\ns002,\ns003,4\n")
    (inbox_dir(art) / "late.csv").write_text("sample_id,label\ns001,y\n")  # rejected whole: read by every round
    imports = import_inbox(art, index=set(IDS), answers=DIGITS, round_index=1)

    # The round's output: each rejected row with its file:line and reason, and where the full list is.
    lines = rejection_lines(imports)
    text = "\n".join(lines)
    assert "2 label rows rejected in" in lines[0] and "return to the candidates" in lines[0]
    assert "batch0.csv:3: label 'x' is not in the answer set" in text and "batch0.csv:4: empty label" in text
    assert f"full list: {art / 'rejections'}" in text and "late.csv:2: label 'y'" in text
    summary = summary_markdown(RoundState(round=1, labeled=2, imports=imports), [])
    assert "batch0.csv:3: label 'x' is not in the answer set" in summary

    # Their samples are not "still with the annotators": they are candidates again, and no promised task.
    pool = PoolData(ids=pa.array(IDS), splits=pa.array(["pool"] * len(IDS)), answers=pa.nulls(len(IDS), pa.string()),
                    index=SampleIndex(IDS))
    pool_ids, _, out = eligible_pool(art, pool, _plan(art, 1), set())
    assert {"s001", "s002"} <= set(pool_ids) and not {"s000", "s003"} & set(pool_ids)
    assert not out

    # Exported again (round 1), they are out again, also when a later round reads a rejection of them again.
    _export(art, 1, ["s001", "s002"])
    import_inbox(art, index=set(IDS), answers=DIGITS, round_index=2)
    import_inbox(art, index=set(IDS), answers=DIGITS, round_index=3)
    pool_ids, _, out = eligible_pool(art, pool, _plan(art, 3), set())
    assert not {"s001", "s002"} & set(pool_ids)
    assert len(out) == 2

    status = status_summary(art)
    assert status["rejected_rows"] == 3 and status["rejected_unlabeled"] == 2
    assert status["rejections_dir"] == str(art / "rejections")


def _ls(sid, task, ann, label):
    return {"id": task, "data": {"sample_id": sid, "image": f"images/{sid}.png"},
            "annotations": [{"id": ann, "completed_by": 1, "was_cancelled": False, "result": [
                {"from_name": "answer", "to_name": "image", "type": "choices", "value": {"choices": [label]}}]}]}


def test_a_rejected_annotation_is_read_again_in_the_next_whole_project_export(tmp_path):
    led = Ledger(tmp_path / "artifacts" / "labels.jsonl")

    def run(tasks, name, answers):
        path = tmp_path / name
        path.write_text(json.dumps(tasks))
        return import_labels(path, known_ids=set(IDS), answers=answers, ledger=led, round_index=1,
                             rejections_dir=tmp_path / "artifacts" / "rejections")

    first = run([_ls("s000", 1, 11, "3"), _ls("s001", 2, 12, "ten")], "export1.json", DIGITS)
    assert [r.sample_id for r in first.rejected] == ["s001"]
    # The project adds the answer; Label Studio's next whole-project export brings every task again.
    again = run([_ls("s000", 1, 11, "3"), _ls("s001", 2, 12, "ten"), _ls("s002", 3, 13, "4")], "export2.json",
                [*DIGITS, "ten"])
    assert again.already_taken == 1  # s000's annotation, taken by the first import
    assert led.labels() == {"s000": "3", "s001": "ten", "s002": "4"}
