"""Consensus (pipeline/annotation/consensus.py): the parts on a simulated crowd, the derived labels through the real
import path, the redundancy queue and its budget, and `tamis labels annotators`."""

import json
import random

import pytest
from typer.testing import CliRunner

from pipeline.annotation.consensus import (
    CONSENSUS,
    CONSENSUS_FILE,
    Majority,
    Vote,
    apply_consensus,
    read_consensus,
    read_votes,
    round_record,
    votes_path,
)
from pipeline.annotation.export import TASKS_FILE, export_dir, export_selection
from pipeline.annotation.inbox import inbox_files
from pipeline.annotation.labels import import_labels
from pipeline.annotation.ledger import Ledger, ledger_path
from pipeline.annotation.redundancy import (
    export_redundancy,
    redundancy_candidates,
    redundancy_dir,
    redundancy_queued,
    redundancy_spent,
    settle_votes,
)
from pipeline.annotation.simulate import simulate_annotators
from pipeline.config import SimulatedAnnotator, parse_config
from pipeline.labelcheck import labels_spent

DIGITS = [str(i) for i in range(10)]
CROWD = {"careful": 0.95, "average": 0.80, "careless": 0.60}


def _crowd_votes(n: int, seed: int) -> tuple[dict[str, str], dict[str, list[Vote]]]:
    """n samples of 10 classes, 2 of the 3 annotators each (seeded), each right with their accuracy."""
    rng = random.Random(seed)
    truth, votes = {}, {}
    for i in range(n):
        sid = f"s{i:04d}"
        truth[sid] = t = rng.choice(DIGITS)
        votes[sid] = [Vote(sid, a, t if rng.random() < CROWD[a] else rng.choice([k for k in DIGITS if k != t]))
                      for a in rng.sample(sorted(CROWD), 2)]
    return truth, votes


def _majority_random_ties(decisions, seed):
    """Majority vote with ties broken at random: the usual baseline (tamis's importer rejects ties instead)."""
    rng = random.Random(seed)
    return {s: d.label if d.label is not None else rng.choice(sorted(d.votes)) for s, d in decisions.items()}


@pytest.mark.parametrize("method,tolerance", [("dawid_skene", 0.12), ("one_coin", 0.06)])
def test_dawid_skene_beats_majority_and_estimates_the_annotators(method, tolerance):
    truth, votes = _crowd_votes(600, seed=3)
    mv = _majority_random_ties(Majority().decide(votes), seed=3)
    part = CONSENSUS[method]()
    ds = part.decide(votes)
    acc = {name: sum(truth[s] == lab for s, lab in labels.items()) / len(truth)
           for name, labels in (("majority", mv), (method, {s: d.label for s, d in ds.items()}))}
    assert acc[method] >= acc["majority"] + 0.03, acc
    # Each annotator's estimated accuracy against what they actually got right on this sample of votes.
    real = {a: [v.label == truth[v.sample_id] for vs in votes.values() for v in vs if v.annotator == a] for a in CROWD}
    quality = part.annotators(votes, ds)
    for a, hits in real.items():
        assert quality[a].accuracy == pytest.approx(sum(hits) / len(hits), abs=tolerance), (a, quality[a])
    assert quality["careful"].accuracy > quality["average"].accuracy > quality["careless"].accuracy
    assert all(0 < d.confidence <= 1 for d in ds.values())
    if method == "dawid_skene":  # the full model's confusion: columns (true labels) sum to one
        conf = quality["careless"].confusion
        assert sum(conf[g]["3"] for g in conf) == pytest.approx(1.0, abs=1e-3)


def test_majority_part_is_the_importers_rule():
    m = Majority()
    assert m.decide_one(["3"]).outcome == "agreed"
    d = m.decide_one(["3", "5", "3"])
    assert (d.label, d.outcome, d.votes) == ("3", "majority", {"3": 2, "5": 1})
    assert d.confidence == pytest.approx(2 / 3)
    tie = m.decide_one(["5", "3"])
    assert tie.label is None and tie.outcome == "tie" and tie.votes == {"3": 1, "5": 1}


# ------------------------------------------------------------------------------------ through the import path
def _project(tmp_path, make_vqa, n=30, **annotate):
    ds, gt = make_vqa(n=n)
    cfg = parse_config({"paths": {"artifacts": "artifacts"}, "data": {"answers": DIGITS, "ground_truth": str(gt)},
                        "annotate": annotate}, root=tmp_path)
    ids = [f"s{i:03d}" for i in range(n)]
    sel = [{"sample_id": s, "rank": k, "score": 0.5, "prediction": "0", "confidence": 0.3, "scores": {}}
           for k, s in enumerate(ids)]
    export_selection(sel, ds, cfg.annotate, cfg.data.answers, cfg.artifacts, export_dir(cfg.artifacts, 0), round_index=0)
    return cfg, ds, gt, ids


def _import_inbox(cfg, ids, round_index=0):
    led = Ledger(ledger_path(cfg.artifacts))
    return [import_labels(p, known_ids=set(ids), answers=DIGITS, ledger=led, round_index=round_index,
                          rejections_dir=cfg.artifacts / "rejections") for p in inbox_files(cfg.artifacts / "inbox")]


ANNOTATORS = [SimulatedAnnotator(name="ann", accuracy=1.0), SimulatedAnnotator(name="bob", accuracy=0.9),
              SimulatedAnnotator(name="cat", accuracy=0.3)]


def test_single_annotator_majority_leaves_the_outputs_as_they_were(tmp_path, make_vqa):
    cfg, _, gt, ids = _project(tmp_path, make_vqa)
    simulate_annotators(export_dir(cfg.artifacts, 0), gt, cfg.artifacts / "inbox", annotators=ANNOTATORS[:1],
                        round_index=0)
    [rep] = _import_inbox(cfg, ids)
    assert len(rep.accepted) == 30 and not rep.conflicts
    ledger = ledger_path(cfg.artifacts).read_bytes()
    assert all("consensus" not in e for e in Ledger(ledger_path(cfg.artifacts)).entries())
    # The default consensus appends nothing, and a round with one vote per sample records nothing new.
    assert settle_votes(cfg.artifacts, cfg.annotate, answers=DIGITS, round_index=0) == {}
    assert ledger_path(cfg.artifacts).read_bytes() == ledger
    assert len(read_votes(cfg.artifacts)) == 30


def test_dawid_skene_labels_the_ties_majority_rejects_and_keeps_every_raw_vote(tmp_path, make_vqa):
    cfg, _, gt, ids = _project(tmp_path, make_vqa)
    simulate_annotators(export_dir(cfg.artifacts, 0), gt, cfg.artifacts / "inbox", annotators=ANNOTATORS,
                        redundancy=2, round_index=0, seed=1)
    [rep] = _import_inbox(cfg, ids)
    ties = sorted(c.sample_id for c in rep.conflicts if c.outcome == "tie")
    assert ties and rep.accounted
    led = Ledger(ledger_path(cfg.artifacts))
    before = ledger_path(cfg.artifacts).read_bytes()
    assert not set(ties) & set(led.labels())  # majority: a tie is no label
    # Majority (per file): nothing to append, the record says which samples are undecided.
    rec = apply_consensus(cfg.artifacts, cfg.annotate, answers=DIGITS, round_index=0)
    assert ledger_path(cfg.artifacts).read_bytes() == before
    assert sorted(s for s, d in rec.samples.items() if d.label is None) == ties
    assert sum(len(v) for v in read_votes(cfg.artifacts).values()) == 60  # every raw vote, the tied ones too

    ds_cfg = cfg.annotate.model_copy(update={"consensus": "dawid_skene"})
    rec = apply_consensus(cfg.artifacts, ds_cfg, answers=DIGITS, round_index=0)
    labels, entries = led.labels(), led.entries()
    assert set(ties) <= set(labels) and not any(d.label is None for d in rec.samples.values())
    new = entries[30 - len(ties):]
    assert new and all(e["consensus"]["method"] == "dawid_skene" and len(e["votes"]) >= 2 for e in new)
    assert json.loads((cfg.artifacts / CONSENSUS_FILE).read_text())["method"] == "dawid_skene"
    assert read_consensus(cfg.artifacts).annotators["cat"].accuracy < read_consensus(cfg.artifacts).annotators[
        "ann"].accuracy
    # Derived, so idempotent: the same votes append nothing more.
    after = ledger_path(cfg.artifacts).read_bytes()
    apply_consensus(cfg.artifacts, ds_cfg, answers=DIGITS, round_index=0)
    assert ledger_path(cfg.artifacts).read_bytes() == after
    state = round_record(rec)
    assert state["method"] == "dawid_skene" and {r["annotator"] for r in state["annotators"]} == {"ann", "bob", "cat"}
    # The round summary (summary.md and the Prefect UI's round-summary artifact are one text) carries their table.
    from pipeline.report import summary_markdown
    from pipeline.round_state import RoundState

    md = summary_markdown(RoundState(round=0, labeled=30, pool=0, strategy="random", consensus=state), [])
    table = md[md.index("### Annotators (consensus: dawid_skene)"):].splitlines()
    assert {row.split(" | ")[0].strip("| ") for row in table[4:7]} == {"ann", "bob", "cat"}


def test_model_as_a_rater_votes_with_the_exported_predictions(tmp_path, make_vqa):
    cfg, _, gt, ids = _project(tmp_path, make_vqa, n=12, consensus="dawid_skene", consensus_model_rater=True)
    simulate_annotators(export_dir(cfg.artifacts, 0), gt, cfg.artifacts / "inbox", annotators=ANNOTATORS[:2],
                        redundancy=2, round_index=0)
    _import_inbox(cfg, ids)
    rec = apply_consensus(cfg.artifacts, cfg.annotate, answers=DIGITS, round_index=0)
    model = rec.annotators["model"]  # the export predicted "0" for every sample: right on 2 of 12 (s000, s010)
    assert model.votes == 12 and model.agreement < 0.5 and rec.model_rater


def test_redundancy_requeues_unsure_samples_counts_them_and_settles_them(tmp_path, make_vqa):
    cfg, ds, gt, ids = _project(tmp_path, make_vqa, redundancy={"threshold": 0.8, "max_labels": 3})
    simulate_annotators(export_dir(cfg.artifacts, 0), gt, cfg.artifacts / "inbox", annotators=ANNOTATORS,
                        redundancy=2, round_index=0, seed=1)
    [rep] = _import_inbox(cfg, ids)
    ties = sorted(c.sample_id for c in rep.conflicts if c.outcome == "tie")
    rec = apply_consensus(cfg.artifacts, cfg.annotate, answers=DIGITS, round_index=0)
    rows = redundancy_candidates(rec, cfg.annotate.redundancy, queued={})
    assert sorted(r["sample_id"] for r in rows) == ties  # a 1–1 tie is 0.5 < 0.8; an agreed pair is 1.0
    out = redundancy_dir(cfg.artifacts, 0)
    m = export_redundancy(rows, ds, out, annotate=cfg.annotate, answers=DIGITS, artifacts=cfg.artifacts,
                          round_index=0)
    assert m.info["count"] == len(ties) and (out / TASKS_FILE).is_file()
    tasks = json.loads((out / TASKS_FILE).read_text())
    assert all(t["predictions"] == [] for t in tasks)  # a second opinion is not shown the first
    # They count against rounds.label_budget from the next round on, as re-label tasks do.
    assert redundancy_spent(cfg.artifacts, before_round=1) == len(ties)
    assert labels_spent(30 - len(ties), cfg.artifacts, before_round=1) == 30
    assert redundancy_candidates(rec, cfg.annotate.redundancy, queued=redundancy_queued(cfg.artifacts)) == []

    # Another annotator (never one who voted) answers; the third vote decides over all three.
    voted = {s: {v.annotator for v in vs} for s, vs in read_votes(cfg.artifacts).items()}
    simulate_annotators(out, gt, cfg.artifacts / "inbox", annotators=ANNOTATORS, round_index=0, kind="consensus",
                        exclude=voted, seed=1)
    _import_inbox(cfg, ids, round_index=1)
    votes = read_votes(cfg.artifacts)
    assert all(len(votes[s]) == 3 and len({v.annotator for v in votes[s]}) == 3 for s in ties)
    settled = settle_votes(cfg.artifacts, cfg.annotate, answers=DIGITS, round_index=1)["consensus"]
    rec = read_consensus(cfg.artifacts)
    labels = Ledger(ledger_path(cfg.artifacts)).labels()
    for s in ties:
        d = rec.samples[s]
        assert d.n == 3 and (d.label is None or labels[s] == d.label)
    assert settled["samples"] == 30


def test_the_redundancy_queue_is_capped_by_the_label_budget_and_says_so(tmp_path, make_vqa):
    """Issue 46, row 19: each second opinion costs a label; the queue gets what the budget leaves after the batch and
    the re-label tasks, least confident first, and the round says how many it held back and why."""
    from pipeline.annotation.redundancy import queue_redundancy
    from pipeline.report import summary_markdown
    from pipeline.round.stop import redundancy_cap
    from pipeline.round_state import RoundState, round_dir

    cfg, ds, gt, ids = _project(tmp_path, make_vqa, redundancy={"threshold": 0.8, "max_labels": 3})
    simulate_annotators(export_dir(cfg.artifacts, 0), gt, cfg.artifacts / "inbox", annotators=ANNOTATORS,
                        redundancy=2, round_index=0, seed=1)
    [rep] = _import_inbox(cfg, ids)
    ties = [c.sample_id for c in rep.conflicts if c.outcome == "tie"]
    assert len(ties) > 3
    apply_consensus(cfg.artifacts, cfg.annotate, answers=DIGITS, round_index=0)
    rounds_cfg = parse_config({"rounds": {"label_budget": 45}}, root=tmp_path).rounds
    # 30 labels spent, a batch of 10 and 2 re-label tasks: the budget of 45 leaves 3 second opinions.
    state = RoundState(round=1, labels_spent=30, selected=10, relabel=2)
    assert redundancy_cap(rounds_cfg, state) == 3
    assert redundancy_cap(rounds_cfg, RoundState(round=1, labels_spent=40, selected=10)) == 0
    state.update(queue_redundancy(cfg.artifacts, cfg.annotate, answers=DIGITS, round_index=1,
                                  dataset=ds, round_folder=round_dir(cfg.artifacts, 1),
                                  cap=redundancy_cap(rounds_cfg, state)))
    assert state.consensus_requeued == 3 and redundancy_spent(cfg.artifacts, before_round=2) == 3
    assert state.consensus_trimmed["count"] == len(ties) - 3
    why = state.consensus_trimmed["reason"]
    assert f"{len(ties) - 3} of {len(ties)} samples" in why and "rounds.label_budget leaves 3" in why
    assert why in summary_markdown(state, [])
    assert RoundState.from_json(state.to_json()).consensus_trimmed == state.consensus_trimmed  # round.json keeps it


def test_votes_log_counts_a_file_imported_twice_once(tmp_path, make_vqa):
    cfg, _, gt, ids = _project(tmp_path, make_vqa, n=6)
    simulate_annotators(export_dir(cfg.artifacts, 0), gt, cfg.artifacts / "inbox", annotators=ANNOTATORS,
                        redundancy=3, round_index=0)
    _import_inbox(cfg, ids)
    rows = votes_path(cfg.artifacts).read_text().splitlines()
    votes_path(cfg.artifacts).write_text("\n".join(rows + rows) + "\n")  # a crash between the logs and the ledger
    assert sum(len(v) for v in read_votes(cfg.artifacts).values()) == 18


def test_cli_labels_annotators(tmp_path, make_vqa):
    from flows.cli.main import app

    cfg, _, gt, ids = _project(tmp_path, make_vqa, consensus="one_coin")
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(f"paths: {{artifacts: {cfg.artifacts}}}\ndata: {{answers: {DIGITS}, ground_truth: {gt}}}\n"
                        "annotate: {consensus: one_coin}\n")
    res = CliRunner().invoke(app, ["labels", "annotators", "--config", str(cfg_path)])
    assert res.exit_code == 0 and "no votes yet" in res.output, res.output
    simulate_annotators(export_dir(cfg.artifacts, 0), gt, cfg.artifacts / "inbox", annotators=ANNOTATORS,
                        redundancy=2, round_index=0, seed=1)
    _import_inbox(cfg, ids)
    before = ledger_path(cfg.artifacts).read_bytes()
    res = CliRunner().invoke(app, ["labels", "annotators", "--config", str(cfg_path)])
    assert res.exit_code == 0, res.output
    assert "consensus: one_coin" in res.output and all(n in res.output for n in ("ann", "bob", "cat"))
    res = CliRunner().invoke(app, ["labels", "annotators", "--config", str(cfg_path), "--json"])
    data = json.loads(res.output)
    assert data["method"] == "one_coin" and data["samples"] == 30 and set(data["annotators"]) == {"ann", "bob", "cat"}
    assert data["annotators"]["ann"]["votes"] + data["annotators"]["bob"]["votes"] + data["annotators"]["cat"][
        "votes"] == 60
    assert data["pending_ledger_changes"] > 0  # the ties one_coin would label
    assert ledger_path(cfg.artifacts).read_bytes() == before  # the command only reads


@pytest.mark.slow
def test_rounds_with_a_crowd_dawid_skene_and_redundancy(tmp_path, tiny_models, prefect_harness):
    """Two rounds end to end: the crowd answers round 0 with 2 labels per sample, round 1 derives the consensus
    before it plans its labeled set, reports the annotators and sends the unsure samples out again, counted."""
    from flows.round import labeling_round
    from pipeline.config import load_config
    from tests.test_round_flow import write_project

    crowd = [{"name": "ann", "accuracy": 1.0, "seconds": 10}, {"name": "bob", "accuracy": 0.9, "seconds": 20},
             {"name": "cat", "accuracy": 0.3, "seconds": {"base": 5, "per": "detail", "scale": 30}}]
    import yaml

    # label_budget 13: 6 labels in round 0, a batch of 6 in round 1, which leaves 1 for its re-label and redundancy
    # tasks (issue 46, row 19: the queue is capped, and the round says by how much)
    config = write_project(tmp_path, tiny_models, rounds={"simulate_annotators": crowd, "simulate_redundancy": 2,
                                                          "label_budget": 13})
    raw = yaml.safe_load(config.read_text())
    # threshold 1: every sample short of certainty goes out again, so the queue is never empty here
    raw["annotate"] = {"consensus": "dawid_skene", "redundancy": {"threshold": 1.0, "max_labels": 3}}
    config.write_text(yaml.safe_dump(raw))
    art = load_config(config).artifacts
    first = labeling_round(str(config))
    assert "consensus" not in first  # no votes yet
    second = labeling_round(str(config))
    assert second["labeled"] == 6 and second["consensus"]["method"] == "dawid_skene"
    assert {r["annotator"] for r in second["consensus"]["annotators"]} <= {"ann", "bob", "cat"}
    summary = (art / "rounds/001/summary.md").read_text()
    assert "### Annotators (consensus: dawid_skene)" in summary
    assert read_consensus(art).method == "dawid_skene" and len(read_votes(art)) == 6
    n = second["consensus_requeued"]  # the unsure ones went out again, and the budget knows
    assert n > 0 and n == len(redundancy_queued(art)[1]) and redundancy_spent(art, before_round=2) == n
    assert "Redundancy tasks" in summary
    assert n + (second.get("relabel") or 0) <= 1 and second["consensus_trimmed"]["count"] > 0, second
    assert "Redundancy tasks held back: " in summary and "rounds.label_budget leaves" in summary
    crowd_file = json.loads((art / "inbox/simulated-consensus-001.json").read_text())
    voted = read_votes(art)
    assert all(a["completed_by"] not in {v.annotator for v in voted[t["data"]["sample_id"]]}
               for t in crowd_file for a in t["annotations"])  # another annotator, never a second look by the same
    third = labeling_round(str(config), simulate=False)
    assert third["labels_spent"] == third["labeled"] + n
    assert all(len(read_votes(art)[s]) == 3 for s in (r["sample_id"] for r in redundancy_queued(art)[1]))


def test_a_tie_before_a_labeled_sample_in_one_file_imports(tmp_path):
    """The tie check once reused the name of the label comparison: the next sample with a current label crashed."""
    led = Ledger(ledger_path(tmp_path))
    first, second = tmp_path / "a.csv", tmp_path / "b.csv"
    first.write_text("sample_id,label,annotator\nx1,4,ann\n")
    second.write_text("sample_id,label,annotator\nx0,1,ann\nx0,2,bob\nx1,4,bob\nx1,4,cat\n")
    for f in (first, second):
        rep = import_labels(f, known_ids={"x0", "x1"}, answers=DIGITS, ledger=led, round_index=0,
                            rejections_dir=tmp_path / "rej")
    assert [c.outcome for c in rep.conflicts] == ["tie"] and rep.unchanged == ["x1"]
    assert led.labels() == {"x1": "4"}
    assert sorted((v.annotator, v.label) for v in read_votes(tmp_path)["x0"]) == [("ann", "1"), ("bob", "2")]
    assert len(read_votes(tmp_path)["x1"]) == 3  # a vote that repeats the current label is still a raw vote


def test_consensus_settings_leave_the_export_cache_keys_of_existing_projects_alone():
    """The export and relabel stages key on the whole annotate section: the consensus fields at their defaults stay
    out of its dump (an existing project keeps its keys); set, they are in it and survive a YAML round trip."""
    import yaml

    default = parse_config({}).section("annotate")
    assert not {"consensus", "consensus_model_rater", "redundancy"} & set(default)
    cfg = parse_config({"annotate": {"consensus": "one_coin", "consensus_model_rater": True,
                                     "redundancy": {"threshold": 0.7}}})
    section = cfg.section("annotate")
    assert section["consensus"] == "one_coin" and section["redundancy"] == {"threshold": 0.7, "max_labels": 3}
    again = parse_config(yaml.safe_load(cfg.to_yaml())).annotate
    assert again == cfg.annotate
