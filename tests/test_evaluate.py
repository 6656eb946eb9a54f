import json

import pytest
from PIL import Image

from pipeline.annotation.ledger import Ledger, ledger_path, make_entry
from pipeline.answer_metrics import accuracy, exact_match, score_answers, token_f1
from pipeline.errors import DataError
from pipeline.meaning import normalize_answer
from pipeline.metrics import append_metrics, plot_learning_curve, read_metrics
from pipeline.status import status_summary
from pipeline.store import read_jsonl


def test_metric_functions():
    assert accuracy(["3", " 4", None, "5"], ["3", "4", "1", "6"]) == 0.5
    assert normalize_answer("The  Red, bus!") == "red bus"
    assert exact_match(["the red bus", "A cat."], ["Red bus", "dog"]) == 0.5
    # SQuAD F1: pred "red bus stop" vs ref "the red bus": 2 common tokens, P=2/3, R=2/2 → F1 = 0.8.
    assert token_f1(["red bus stop"], ["the red bus"]) == pytest.approx(0.8)
    assert token_f1(["", "x"], ["", "y"]) == 0.5
    assert score_answers(["1", "2"], ["1", "3"], closed=True) == {"accuracy": 0.5, "exact_match": 0.5}
    assert set(score_answers(["a b"], ["a"], closed=False)) == {"exact_match", "token_f1", "edit_similarity"}
    with pytest.raises(DataError, match="2 predictions for 3 references"):
        accuracy(["1", "2"], ["1", "2", "3"])
    with pytest.raises(DataError, match="test split is empty"):
        token_f1([], [])


def test_metrics_log_curve_and_status(tmp_path):
    art = tmp_path / "artifacts"
    for strategy, values in {"margin": [0.2, 0.5, 0.7], "random": [0.2, 0.3, 0.4]}.items():
        for r, v in enumerate(values):
            append_metrics(art, {"round": r, "labels": 40 * (r + 1), "metric": "accuracy", "value": v,
                                 "strategy": strategy})
    append_metrics(art, {"round": 2, "labels": 120, "metric": "exact_match", "value": 0.75, "strategy": "margin"})
    with pytest.raises(DataError, match="lacks labels, metric"):
        append_metrics(art, {"round": 3, "value": 1.0, "strategy": "margin"})
    rows = read_jsonl(art / "metrics.jsonl")  # the log: two strategies per round, as a comparison plots them
    assert len(rows) == 7 and all("time" in r for r in rows)
    # The project's series: one row per round and metric, the newest logged.
    assert [(m["round"], m["metric"], m["strategy"]) for m in read_metrics(art)] == [
        (0, "accuracy", "random"), (1, "accuracy", "random"), (2, "accuracy", "random"), (2, "exact_match", "margin")]

    png = plot_learning_curve(rows, art / "learning_curve.png")
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size == (600, 400)
    assert plot_learning_curve(rows, art / "again.png").read_bytes() == png.read_bytes()
    em = plot_learning_curve(rows, art / "em.png", metric="exact_match")
    assert em.read_bytes() != png.read_bytes()
    with pytest.raises(DataError, match="no rows for metric 'f1'"):
        plot_learning_curve(rows, art / "x.png", metric="f1")
    with pytest.raises(DataError, match="no metrics to plot"):
        plot_learning_curve([], art / "x.png")

    led = Ledger(ledger_path(art))
    e = make_entry("s1", "1", annotator="a", round_index=0, source_file="f", source_digest="d1")
    led.append([e, make_entry("s2", "2", annotator="a", round_index=0, source_file="f", source_digest="d1")])
    led.append([make_entry("s1", "7", annotator="b", round_index=1, source_file="g", source_digest="d2",
                           supersedes=e)])
    (art / "rounds" / "000" / "export").mkdir(parents=True)
    (art / "rounds" / "000" / "export" / "manifest.json").write_text("{}")
    (art / "rounds" / "001" / "export").mkdir(parents=True)  # not finished: no manifest
    (art / "rounds" / "000" / "round.json").write_text('{"round": 0}')
    (art / "rounds" / "002").mkdir()
    (art / "rounds" / "002" / "round.json").write_text('{"round": 2, "stopped": "max rounds"}')  # finished, no export
    (art / "inbox").mkdir()
    (art / "inbox" / "new.csv").write_text("sample_id,label\n")
    s = status_summary(art)
    # rounds_done counts finished rounds as `tamis status` lists them, a stopped round that exported nothing too.
    assert s["rounds_exported"] == [0] and s["rounds_done"] == 2
    assert s["labeled"] == 2 and s["ledger_entries"] == 3 and s["corrections"] == 1
    assert s["inbox_pending"] == [str(art / "inbox" / "new.csv")]
    assert s["last_round_evaluated"] == 2
    assert s["last_metrics"] == {"accuracy": 0.4, "exact_match": 0.75}
    json.dumps(s)  # plain data for `tamis status --json`
