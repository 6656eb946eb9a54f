"""Per-class evaluation (pipeline/perclass.py) against scikit-learn, the honest learning curve, and the summary's
per-class section."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.errors import DataError
from pipeline.metrics import curve_figure
from pipeline.perclass import (
    EvalReport,
    bootstrap_intervals,
    load_eval_report,
    mean_interval,
    per_class_report,
    per_group_report,
    plot_confusion,
)
from pipeline.report import summary_markdown

ANSWERS = ["cat", "dog", "bird", "fish"]


def noisy(n=120, seed=3):
    rng = np.random.default_rng(seed)
    refs = [ANSWERS[i] for i in rng.choice(3, size=n, p=[0.5, 0.3, 0.2])]  # "fish" never in the test split
    preds = [r if rng.random() < 0.6 else ANSWERS[int(rng.integers(0, 4))] for r in refs]
    return preds, refs


def test_per_class_report_matches_scikit_learn():
    from sklearn.metrics import confusion_matrix, f1_score, precision_recall_fscore_support

    preds, refs = noisy()
    rep = per_class_report(preds, refs, ANSWERS)
    p, r, f, s = precision_recall_fscore_support(refs, preds, labels=ANSWERS, zero_division=0)
    assert [c["answer"] for c in rep["per_class"]] == ANSWERS
    np.testing.assert_allclose([c["precision"] for c in rep["per_class"]], p, atol=1e-6)
    np.testing.assert_allclose([c["recall"] for c in rep["per_class"]], r, atol=1e-6)
    np.testing.assert_allclose([c["f1"] for c in rep["per_class"]], f, atol=1e-6)
    assert [c["support"] for c in rep["per_class"]] == list(s) and s[-1] == 0
    assert rep["confusion"] == confusion_matrix(refs, preds, labels=ANSWERS).tolist()
    assert rep["confusion_columns"] == ANSWERS
    # Macro-F1 over the answers the test split holds (fish has no test row).
    assert rep["macro_f1"] == pytest.approx(f1_score(refs, preds, labels=ANSWERS[:3], average="macro"), abs=1e-6)
    assert rep["accuracy"] == pytest.approx(np.mean([a == b for a, b in zip(preds, refs, strict=True)]))
    assert rep["accuracy_ci95"][0] < rep["accuracy"] < rep["accuracy_ci95"][1]
    assert rep["macro_f1_ci95"][0] < rep["macro_f1"] < rep["macro_f1_ci95"][1]
    assert rep["n"] == 120 and rep["bootstrap"] == {"resamples": 1000, "seed": 0}
    json.dumps(rep)  # plain JSON for per_class.json


def test_the_bootstrap_from_confusion_counts_equals_scikit_learn_on_each_resample():
    from sklearn.metrics import f1_score

    preds, refs = noisy(n=60)
    true = np.array([ANSWERS.index(x) for x in refs])
    pred = np.array([ANSWERS.index(x) for x in preds])
    keep = np.bincount(true, minlength=4) > 0
    fast = bootstrap_intervals(true, pred, 4, keep, resamples=50, seed=7)
    idx = np.random.default_rng(7).integers(0, 60, size=(50, 60))  # the same draws
    macro = [f1_score(true[i], pred[i], labels=[0, 1, 2], average="macro", zero_division=0) for i in idx]
    acc = [(true[i] == pred[i]).mean() for i in idx]
    assert fast["macro_f1"] == pytest.approx([np.percentile(macro, 2.5), np.percentile(macro, 97.5)], abs=1e-6)
    assert fast["accuracy"] == pytest.approx([np.percentile(acc, 2.5), np.percentile(acc, 97.5)], abs=1e-6)


def many_answers(n_answers, n_rows, seed=5):
    """A test split over `n_answers` answers, 70 % right, the misses mostly between neighbouring answers."""
    rng = np.random.default_rng(seed)
    answers = [f"species {k:03d}" for k in range(n_answers)]
    true = rng.integers(0, n_answers, size=n_rows)
    wrong = (true + rng.choice([1, 2, int(rng.integers(0, n_answers))], size=n_rows)) % n_answers
    pred = np.where(rng.random(n_rows) < 0.7, true, wrong)
    return answers, true, pred


def test_the_bootstrap_keeps_its_memory_flat_as_the_answers_grow():
    """Issue 46 #11: the bootstrap held a [resamples, c, c + 1] matrix (1.44 GB at 400 answers, ~8 GB at 1,000)."""
    import tracemalloc

    from pipeline import perclass

    answers, true, pred = many_answers(400, 3000)
    keep = np.bincount(true, minlength=400) > 0
    tracemalloc.start()
    try:
        got = bootstrap_intervals(true, pred, 400, keep, resamples=300, seed=3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20, f"bootstrap peaked at {peak / 2**20:.0f} MiB for 400 answers"
    # The open answers' interval of a mean: flat too (it held [1000, n] indices and values, 320 MB at 20,000 rows).
    scores = np.random.default_rng(1).random(20_000)
    tracemalloc.start()
    try:
        mean_ci = mean_interval(scores)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20, f"mean_interval peaked at {peak / 2**20:.0f} MiB for 20,000 rows"
    # The chunks change nothing: the same seed gives the same intervals from one chunk per resample.
    old, perclass.BOOTSTRAP_CELLS = perclass.BOOTSTRAP_CELLS, 1
    try:
        assert bootstrap_intervals(true, pred, 400, keep, resamples=300, seed=3) == got
        assert mean_interval(scores) == mean_ci
    finally:
        perclass.BOOTSTRAP_CELLS = old


def test_many_answers_get_a_ranked_chart_of_the_top_confusions(tmp_path):
    """Issue 46 #11: at 200 answers the full matrix took 31 s, weighed 1.9 MB and could not be read."""
    import time

    import matplotlib.pyplot as plt

    from pipeline.perclass import confusion_figure, top_confusions

    answers, true, pred = many_answers(200, 4000)
    rep = per_class_report([answers[k] for k in pred], [answers[k] for k in true], answers, resamples=50)
    start = time.perf_counter()
    png = plot_confusion(rep, tmp_path / "confusion.png")
    assert time.perf_counter() - start < 10
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size < 150_000
    pairs = top_confusions(rep)
    cm = np.array(rep["confusion"])
    np.fill_diagonal(cm, 0)
    assert [c for _, _, c, _ in pairs] == np.sort(cm.ravel())[::-1][: len(pairs)].tolist()  # the largest, ranked
    t, p, c, _ = pairs[0]
    assert rep["confusion"][answers.index(t)][answers.index(p)] == c and t != p
    fig = confusion_figure(rep)
    try:
        labels = [x.get_text() for x in fig.axes[0].get_yticklabels()]
        assert 0 < len(labels) <= 30 and labels[0] == f"{t} → {p}"
        assert min(x.get_fontsize() for x in fig.axes[0].get_yticklabels()) >= 8
        assert fig.get_size_inches()[1] < 12  # a page, not a poster
    finally:
        plt.close(fig)
    # A few answers keep the whole matrix, every cell labelled.
    small = per_class_report(*noisy(), ANSWERS, resamples=20)
    fig = confusion_figure(small)
    try:
        assert [x.get_text() for x in fig.axes[0].get_yticklabels()] == ANSWERS
    finally:
        plt.close(fig)


def test_predictions_outside_the_answer_set_get_their_column_and_bad_references_are_refused(tmp_path):
    rep = per_class_report(["cat", "lion", None, "dog"], ["cat", "dog", "dog", "dog"], ANSWERS)
    assert rep["confusion_columns"] == [*ANSWERS, "(other)"]
    assert rep["confusion"][1] == [0, 1, 0, 0, 2]  # dog: once right, twice outside the set
    png = plot_confusion(rep, tmp_path / "confusion.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(DataError, match=r"test answers outside data.answers: \['horse'\]"):
        per_class_report(["cat"], ["horse"], ANSWERS)


def test_open_answers_are_grouped_by_question_or_answer_length():
    rows = [{"question": "q", "answer": a} for a in ("seven", "a red bus", "the big old red bus")]
    rep = per_group_report(rows, {"exact_match": [1.0, 0.0, 1.0], "token_f1": [1.0, 0.5, 0.8]})
    assert rep["by"] == "answer_length" and rep["metrics"] == ["exact_match", "token_f1"]
    assert {g["group"]: (g["n"], g["token_f1"]) for g in rep["groups"]} == {
        "1 word": (1, 1.0), "2-3 words": (1, 0.5), "4+ words": (1, 0.8)}
    two = per_group_report([{"question": "colour?", "answer": "red"}, {"question": "count?", "answer": "2"},
                            {"question": "count?", "answer": "3"}], {"exact_match": [1.0, 0.0, 1.0]})
    assert two["by"] == "question" and {g["group"]: g["exact_match"] for g in two["groups"]} == {
        "colour?": 1.0, "count?": 0.5}


def test_the_learning_curve_starts_at_chance_with_integer_ticks_and_intervals():
    import matplotlib.pyplot as plt

    one = [{"round": 1, "labels": 30, "metric": "accuracy", "value": 0.6, "strategy": "margin",
            "ci95": [0.52, 0.68]}]
    fig = curve_figure(one, chance=0.1)
    try:
        ax = fig.axes[0]
        assert ax.get_ylim() == pytest.approx((0.08, 1.0))  # from chance (with room for its line), not 0.58-0.62
        lo, hi = ax.get_xlim()
        assert lo < 30 < hi and hi - lo >= 10  # a single point in a readable axis, not 28.5 … 31.5
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks)
        bars = ax.containers[0]  # the errorbar container: the interval is drawn
        segs = bars.lines[2][0].get_segments()
        assert np.allclose(segs[0], [[30, 0.52], [30, 0.68]])
    finally:
        plt.close(fig)
    two = one + [{"round": 2, "labels": 36, "metric": "accuracy", "value": 0.615, "strategy": "margin"}]
    low = [{**one[0], "value": 0.1, "ci95": [0.0, 0.25]}]
    fig = curve_figure(low, chance=0.1)  # an interval below chance stays on the axis
    try:
        assert fig.axes[0].get_ylim() == (0.0, 1.0)
    finally:
        plt.close(fig)
    fig = curve_figure(two)  # open answers: from 0
    try:
        assert fig.axes[0].get_ylim() == (0.0, 1.0)
    finally:
        plt.close(fig)


def test_the_summary_and_status_show_the_per_class_table(tmp_path):
    from flows.cli.cmd_rounds import per_class_output
    from pipeline.round_state import RoundState

    preds, refs = noisy()
    rep = per_class_report(preds, refs, ANSWERS)
    (tmp_path / "per_class.json").write_text(json.dumps(rep))
    plot_confusion(rep, tmp_path / "confusion.png")
    ev = load_eval_report(tmp_path)
    assert isinstance(ev, EvalReport) and ev.confusion_png == tmp_path / "confusion.png"
    state = RoundState(round=2, labeled=40, pool=100, strategy="margin", eval_dir=str(tmp_path))
    md = summary_markdown(state, [], evaluation=ev, confusion_uri="data:image/png;base64,AAAA")
    assert "## Per-class results" in md and "| fish | 0.000 | 0.000 | 0.000 | 0 |" in md
    assert "![confusion matrix](data:image/png;base64,AAAA)" in md
    assert f"macro-F1 **{rep['macro_f1']:.3f}**" in md
    table, line = per_class_output([state])
    assert table.row_count == 4 and "macro-F1" in line
    assert load_eval_report(tmp_path / "none") is None
    table, line = per_class_output([RoundState(round=0)])
    assert table is None and "no per-class evaluation yet" in line
