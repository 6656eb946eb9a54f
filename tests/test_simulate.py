import json

import pytest
from typer.testing import CliRunner

from pipeline.annotation.export import export_dir, export_selection
from pipeline.annotation.inbox import inbox_files
from pipeline.annotation.labels import import_labels
from pipeline.annotation.ledger import Ledger, ledger_path
from pipeline.annotation.simulate import sidecar_path, simulate_annotator
from pipeline.config import parse_config
from pipeline.errors import DataError

DIGITS = [str(i) for i in range(10)]


def _project(tmp_path, ds, ids, *, answers=DIGITS, round_index=1):
    cfg = parse_config({"paths": {"artifacts": "artifacts"}, "data": {"answers": answers}}, root=tmp_path)
    sel = [{"sample_id": sid, "rank": k, "score": 0.5, "prediction": "0", "confidence": 0.3, "scores": {}}
           for k, sid in enumerate(ids)]
    out = export_dir(cfg.artifacts, round_index)
    export_selection(sel, ds, cfg.annotate, cfg.data.answers, cfg.artifacts, out, round_index=round_index)
    return cfg, out


def _import(cfg, ids, answers=DIGITS):
    led = Ledger(ledger_path(cfg.artifacts))
    reps = [import_labels(p, known_ids=set(ids), answers=answers, ledger=led, round_index=1,
                          rejections_dir=cfg.artifacts / "rejections") for p in inbox_files(cfg.artifacts / "inbox")]
    return led, reps


def _truth(gt_path):
    return {r["sample_id"]: r["answer"] for r in map(json.loads, gt_path.read_text().splitlines())}


def test_simulated_export_imports_cleanly_and_is_idempotent(tmp_path, make_vqa):
    ds, gt = make_vqa()
    ids = [f"s{i:03d}" for i in range(12)]
    cfg, out = _project(tmp_path, ds, ids)
    inbox = cfg.artifacts / "inbox"
    path = simulate_annotator(out, gt, inbox, round_index=1)
    tasks = json.loads(path.read_text())
    ann = tasks[0]["annotations"][0]
    assert ann["completed_by"] == "simulated" and ann["was_cancelled"] is False
    assert ann["result"][0]["type"] == "choices" and ann["result"][0]["from_name"] == "answer"
    led, [rep] = _import(cfg, ids)
    assert rep.format == "label_studio" and len(rep.accepted) == 12 and not rep.rejected and rep.accounted
    assert led.labels() == _truth(gt)
    first = path.read_bytes()
    assert simulate_annotator(out, gt, inbox, round_index=1) == path and path.read_bytes() == first
    _, [again] = _import(cfg, ids)
    assert again.already_imported


def test_noise_flips_the_requested_fraction_and_records_them(tmp_path, make_vqa):
    ds, gt = make_vqa()
    ids = [f"s{i:03d}" for i in range(12)]
    cfg, out = _project(tmp_path, ds, ids)
    path = simulate_annotator(out, gt, cfg.artifacts / "inbox", round_index=1, noise=0.25, seed=7)
    side = json.loads(sidecar_path(path).read_text())
    flipped = {f["sample_id"]: f for f in side["flipped"]}
    assert len(flipped) == round(0.25 * 12) == 3 and side["answered"] == 12
    led, [rep] = _import(cfg, ids)
    truth = _truth(gt)
    wrong = {sid for sid, label in led.labels().items() if label != truth[sid]}
    assert wrong == set(flipped)
    assert all(f["given"] in DIGITS and f["given"] != f["true"] == truth[s] for s, f in flipped.items())
    same = simulate_annotator(out, gt, tmp_path / "inbox2", round_index=1, noise=0.25, seed=7)
    assert same.read_bytes() == path.read_bytes()  # seeded: the same flips again


def test_missing_ground_truth_comes_back_skipped_and_open_answers(tmp_path, make_vqa):
    ds, gt = make_vqa(open_answers=True)
    ids = ["s000", "s001", "s002"]
    # s001 keeps only its image name in the ground truth (fallback), s002 has none at all.
    rows = [json.loads(x) for x in gt.read_text().splitlines()]
    rows = [r for r in rows if r["sample_id"] != "s002"]
    rows[1].pop("sample_id")
    gt.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg, out = _project(tmp_path, ds, ids, answers=None)
    path = simulate_annotator(out, gt, cfg.artifacts / "inbox", round_index=1, noise=1.0)
    side = json.loads(sidecar_path(path).read_text())
    assert side["missing"] == ["s002"] and len(side["flipped"]) == 2
    result = json.loads(path.read_text())[0]["annotations"][0]["result"][0]
    assert result["type"] == "textarea"
    led, [rep] = _import(cfg, ids, answers=None)
    assert rep.skipped_cancelled == 1 and len(rep.accepted) == 2 and rep.accounted
    assert all(led.labels()[s] != f"a photo of {int(s[1:]) % 10}" for s in ("s000", "s001"))


def test_bad_noise_and_ground_truth_are_clear_errors(tmp_path, make_vqa):
    ds, gt = make_vqa(n=3)
    cfg, out = _project(tmp_path, ds, ["s000"])
    with pytest.raises(DataError, match="noise 1.5 is not a fraction"):
        simulate_annotator(out, gt, tmp_path / "in", round_index=1, noise=1.5)
    gt.write_text('{"sample_id": "s000", "answer": "1"}\n{"sample_id": "s001", "answer": \n')
    with pytest.raises(DataError, match=r"ground_truth.jsonl:2:"):
        simulate_annotator(out, gt, tmp_path / "in", round_index=1)


def test_cli_simulate_annotator(tmp_path, make_vqa):
    from flows.cli.main import app

    ds, gt = make_vqa(n=4)
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(f"paths: {{artifacts: {tmp_path / 'artifacts'}}}\n"
                        f"data: {{answers: {DIGITS}, ground_truth: {gt}}}\n")
    _project(tmp_path, ds, ["s000", "s003"], round_index=2)
    res = CliRunner().invoke(app, ["simulate-annotator", "--round", "2", "--config", str(cfg_path)])
    assert res.exit_code == 0, res.output
    labels = json.loads((tmp_path / "artifacts" / "inbox" / "simulated-round-002.json").read_text())
    assert [t["annotations"][0]["result"][0]["value"]["choices"] for t in labels] == [["0"], ["3"]]


# ------------------------------------------------------------------------------------------ a simulated crowd
def _crowd(**seconds):
    from pipeline.config import SimulatedAnnotator

    return [SimulatedAnnotator(name="ann", accuracy=1.0, seconds=seconds or 12.0),
            SimulatedAnnotator(name="bob", accuracy=0.0, seconds=seconds or 20.0),
            SimulatedAnnotator(name="cat", accuracy=1.0, seconds=seconds or 5.0)]


def test_crowd_gives_distinct_annotators_their_accuracy_and_times_through_the_import(tmp_path, make_vqa):
    from pipeline.annotation.simulate import simulate_annotators

    ds, gt = make_vqa()
    ids = [f"s{i:03d}" for i in range(12)]
    cfg, out = _project(tmp_path, ds, ids)
    inbox = cfg.artifacts / "inbox"
    path = simulate_annotators(out, gt, inbox, annotators=_crowd(), redundancy=2, round_index=1, seed=4)
    tasks = json.loads(path.read_text())
    truth = _truth(gt)
    for t in tasks:
        anns = t["annotations"]
        assert len({a["completed_by"] for a in anns}) == 2
        for a in anns:
            given = a["result"][0]["value"]["choices"][0]
            assert (given == truth[t["data"]["sample_id"]]) == (a["completed_by"] != "bob")
            assert a["lead_time"] == {"ann": 12.0, "bob": 20.0, "cat": 5.0}[a["completed_by"]]
    first = path.read_bytes()
    assert simulate_annotators(out, gt, inbox, annotators=_crowd(), redundancy=2, round_index=1,
                               seed=4).read_bytes() == first  # deterministic
    led, [rep] = _import(cfg, ids)
    times = led.times()
    assert len(times) == 24 and sum(t["seconds"] for t in times) == sum(
        a["lead_time"] for t in tasks for a in t["annotations"])


def test_crowd_excludes_who_labeled_before_and_refuses_too_few_annotators(tmp_path, make_vqa):
    from pipeline.annotation.simulate import simulate_annotators

    ds, gt = make_vqa(n=6)
    ids = [f"s{i:03d}" for i in range(6)]
    _, out = _project(tmp_path, ds, ids)
    done = {s: {"ann", "bob"} for s in ids}
    path = simulate_annotators(out, gt, tmp_path / "in", annotators=_crowd(), round_index=1, exclude=done)
    assert {a["completed_by"] for t in json.loads(path.read_text()) for a in t["annotations"]} == {"cat"}
    with pytest.raises(DataError, match="simulate_redundancy = 4"):
        simulate_annotators(out, gt, tmp_path / "in", annotators=_crowd(), redundancy=4, round_index=1)


def test_time_model_depends_on_the_stated_property_with_seeded_noise(tmp_path):
    from PIL import Image

    from pipeline.annotation.simulate import annotator_seconds, sample_property
    from pipeline.config import SecondsModel, SimulatedAnnotator

    flat, busy = tmp_path / "flat.png", tmp_path / "busy.png"
    Image.new("L", (16, 16), 128).save(flat)
    Image.frombytes("L", (16, 16), bytes((255 if (x + y) % 2 else 0) for y in range(16) for x in range(16))).save(busy)
    assert sample_property("detail", image=flat, question="") == 0.0
    assert sample_property("detail", image=busy, question="") == pytest.approx(1.0)
    assert sample_property("pixels", image=busy, question="") == pytest.approx(256 / 1e6)
    assert sample_property("question_length", image=None, question="Which digit is shown?") == 4
    exact = SimulatedAnnotator(name="a", seconds=SecondsModel(base=10, per="detail", scale=40, noise=0.0))
    assert annotator_seconds(exact, sample_id="x", seed=0, image=flat, question="") == 10.0
    assert annotator_seconds(exact, sample_id="x", seed=0, image=busy, question="") == 50.0
    noisy = SimulatedAnnotator(name="a", seconds=SecondsModel(base=10, per="detail", scale=40, noise=0.3))
    s = [annotator_seconds(noisy, sample_id=f"x{i}", seed=0, image=busy, question="") for i in range(50)]
    assert s == [annotator_seconds(noisy, sample_id=f"x{i}", seed=0, image=busy, question="") for i in range(50)]
    assert len(set(s)) == 50 and 35 < sorted(s)[25] < 70  # spread around 50 s, median near it
