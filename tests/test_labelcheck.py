"""Label checks: confident-learning detection, issue table, relabel queue round-trip, agreement, out-of-sample probs."""

import io
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from pipeline.annotation.export import TASKS_FILE, export_dir, export_selection
from pipeline.annotation.labels import import_labels
from pipeline.annotation.ledger import Ledger, ledger_path, make_entry
from pipeline.annotation.simulate import sidecar_path, simulate_annotator
from pipeline.config import ProjectConfig, load_config
from pipeline.labelcheck import (
    CheckScoring,
    CheckSpec,
    HeldOut,
    Issue,
    KnnSpace,
    LabelCheckError,
    apply_temperature,
    calibrate_confident_joint,
    check_labels,
    class_thresholds,
    confident_joint,
    detect_label_issues,
    export_relabel,
    find_label_issues,
    fit_temperature,
    knn_label_probs,
    label_error_posterior,
    label_issue_table,
    label_report_markdown,
    labels_spent,
    noise_rate,
    out_of_sample_probs,
    prune_by_noise_rate,
    relabel_candidates,
    relabel_dir,
    stratified_folds,
    three_rater_accuracy,
    write_label_report,
)
from pipeline.labelcheck import annotator_agreement as agreement
from pipeline.store import read_jsonl, read_manifest

DIGITS = [str(d) for d in range(10)]


# ------------------------------------------------------------------------------------------- pure detection
def test_stratified_folds_are_balanced_seeded_and_spread_each_class():
    labels = [str(i % 4) for i in range(50)]
    f = stratified_folds(labels, 3, seed=0)
    assert sorted(np.bincount(f, minlength=3)) == [16, 17, 17]
    for c in "0123":
        counts = np.bincount(f[np.asarray(labels) == c], minlength=3)
        assert counts.max() - counts.min() <= 1
    np.testing.assert_array_equal(f, stratified_folds(labels, 3, seed=0))
    assert not np.array_equal(f, stratified_folds(labels, 3, seed=1))


def test_hand_made_errors_are_found_ranked_and_given_the_right_suggestion():
    answers = ["cat", "dog", "owl"]
    probs = np.array([
        [0.9, 0.05, 0.05],  # cat, right
        [0.8, 0.1, 0.1],    # cat, right
        [0.1, 0.85, 0.05],  # dog, right
        [0.2, 0.7, 0.1],    # dog, right
        [0.05, 0.05, 0.9],  # owl, right
        [0.1, 0.8, 0.1],    # given cat: looks like a dog (error)
        [0.04, 0.2, 0.76],  # given dog: an owl (error, milder)
        [0.45, 0.45, 0.1],  # given cat: ambiguous, below both thresholds
        [0.2, 0.2, 0.6],    # owl, unsure but no other class reaches its threshold
    ])
    given = ["cat", "cat", "dog", "dog", "owl", "cat", "dog", "cat", "owl"]
    ids = [f"x{i}" for i in range(9)]
    t = class_thresholds(probs, np.array([answers.index(g) for g in given]), 3)
    np.testing.assert_allclose(t, [np.mean([0.9, 0.8, 0.1, 0.45]), np.mean([0.85, 0.7, 0.2]), 0.75])
    issues = find_label_issues(probs, given, answers, sample_ids=ids)
    assert [i.sample_id for i in issues] == ["x5", "x6"]
    assert [i.suggested_label for i in issues] == ["dog", "owl"]
    assert issues[0].margin == pytest.approx(0.1 - 0.8) and issues[1].margin == pytest.approx(0.2 - 0.76)
    assert issues[0].given_label == "cat" and issues[0].threshold == pytest.approx(t[0])


def test_a_class_nobody_was_given_is_never_suggested():
    probs = np.array([[0.2, 0.8, 0.0], [0.9, 0.1, 0.0], [0.1, 0.1, 0.8]])
    issues = find_label_issues(probs, ["a", "a", "a"], ["a", "b", "c"])
    assert issues == []


def test_noisy_classifier_flipped_labels_rank_far_above_chance():
    """A synthetic classifier that is usually right: the flipped 10 % must dominate the top of the ranking."""
    rng = np.random.default_rng(0)
    n, c = 500, 10
    truth = rng.integers(0, c, n)
    logits = rng.normal(size=(n, c))
    logits[np.arange(n), truth] += 2.5
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    given = truth.copy()
    flipped = rng.choice(n, n // 10, replace=False)
    given[flipped] = (truth[flipped] + rng.integers(1, c, len(flipped))) % c
    issues = find_label_issues(probs, [str(g) for g in given], [str(j) for j in range(c)])
    top = {i.index for i in issues[: len(flipped)]}
    precision = len(top & set(flipped.tolist())) / len(flipped)
    assert precision > 0.5, precision  # chance is 0.1
    right = [i for i in issues if i.index in set(flipped.tolist())]
    assert np.mean([i.suggested_label == str(truth[i.index]) for i in right]) > 0.7


def test_bad_inputs_name_the_row_and_the_fix():
    p = np.full((2, 3), 1 / 3)
    with pytest.raises(LabelCheckError, match=r"shape \(2, 3\), expected \(3, 3\)"):
        find_label_issues(p, ["a", "b", "c"], ["a", "b", "c"])
    with pytest.raises(LabelCheckError, match="label 'z' of row 1"):
        find_label_issues(p, ["a", "z"], ["a", "b", "c"])
    q = p.copy()
    q[1, 0] = np.nan
    with pytest.raises(LabelCheckError, match="row 1 are NaN"):
        find_label_issues(q, ["a", "b"], ["a", "b", "c"])
    with pytest.raises(LabelCheckError, match="row 0 is not a probability distribution"):
        find_label_issues(p * 2, ["a", "b"], ["a", "b", "c"])


# ----------------------------------------------------------------------------- ledger: table, budget, agreement
def _entries():
    e1 = make_entry("s000", "3", annotator="ann", round_index=1, source_file="/in/r1.json", source_digest="d1")
    e2 = make_entry("s001", "5", annotator="bob,carl", round_index=1, source_file="/in/r1.json", source_digest="d1",
                    votes=[{"annotator": "bob", "label": "5"}, {"annotator": "carl", "label": "5"},
                           {"annotator": "ann", "label": "6"}])
    e3 = make_entry("s002", "1", annotator="ann,bob", round_index=2, source_file="/in/r2.json", source_digest="d2",
                    votes=[{"annotator": "ann", "label": "1"}, {"annotator": "bob", "label": "1"},
                           {"annotator": "carl", "label": "7"}])
    e4 = make_entry("s000", "8", annotator="carl", round_index=2, source_file="/in/relabel.json",
                    source_digest="d3", supersedes=e1)
    return [e1, e2, e3, e4]


def test_issue_table_names_annotators_and_source_file(tmp_path):
    ledger = Ledger(tmp_path / "labels.jsonl")
    ledger.append(_entries())
    issues = [Issue(0, "s001", "5", "6", 0.1, 0.55, -0.45, 0.6), Issue(3, "s000", "3", "1", 0.05, 0.9, -0.85, 0.5)]
    table = label_issue_table(issues, ledger)
    rows = {r["sample_id"]: r for r in table}
    assert set(rows) == {"s001", "s000"}
    assert rows["s001"]["annotators"] == ["ann", "bob", "carl"] and rows["s001"]["source_file"] == "/in/r1.json"
    assert rows["s001"]["suggested_label"] == "6"
    # The probabilities saw label 3; the ledger has since corrected s000 to 8: the table says so.
    assert rows["s000"]["origin"] == "correction" and rows["s000"]["ledger_label"] == "8"
    assert rows["s000"]["annotators"] == ["carl"]
    assert [r["sample_id"] for r in table] == ["s001", "s000"] and [r["rank"] for r in table] == [1, 2]
    seed = label_issue_table([Issue(0, "t0", "9", "0", 0.1, 0.8, -0.7, 0.5)], [])
    assert seed[0]["origin"] == "dataset" and seed[0]["annotators"] == []


def test_annotator_agreement_with_majority_and_model():
    a = agreement(_entries(), {"s001": "5", "s002": "7", "s000": "8"})
    assert a["ann"] == {"n": 2, "agree_majority": 0.5, "n_model": 3, "agree_model": 0.0}
    assert a["bob"] == {"n": 2, "agree_majority": 1.0, "n_model": 2, "agree_model": 0.5}
    assert a["carl"] == {"n": 2, "agree_majority": 0.5, "n_model": 3, "agree_model": 1.0}
    assert agreement(_entries(), {})["ann"]["agree_model"] is None


# ------------------------------------------------------------------------------ relabel queue round-trip
def test_relabel_export_then_import_records_corrections(tmp_path, make_vqa, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    from flows.cli.main import app

    ds, gt = make_vqa(n=12)
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(f"paths: {{artifacts: {tmp_path / 'art'}}}\ndata: {{answers: {DIGITS}}}\n")
    cfg = load_config(cfg_path)
    ledger = Ledger(ledger_path(cfg.artifacts))
    known = set(ds["sample_id"])
    # Round 0: everything is labeled by a noisy annotator (3 of 12 flipped).
    sel = [{"sample_id": s, "rank": i, "score": 1.0} for i, s in enumerate(sorted(known))]
    export_selection(sel, ds, cfg.annotate, cfg.data.answers, cfg.artifacts, export_dir(cfg.artifacts, 0), round_index=0)
    inbox0 = tmp_path / "inbox0"
    f0 = simulate_annotator(export_dir(cfg.artifacts, 0), gt, inbox0, round_index=0, noise=0.25, seed=1)
    import_labels(f0, known_ids=known, answers=DIGITS, ledger=ledger, round_index=0, rejections_dir=tmp_path / "rej")
    flips = {f["sample_id"]: f for f in json.loads(sidecar_path(f0).read_text())["flipped"]}
    assert len(flips) == 3
    assert labels_spent(12, cfg.artifacts, before_round=2) == 12

    # The detector's verdict (hand-made): the flipped samples, with their true label suggested, and one false alarm.
    labels = ledger.labels()
    ok = next(s for s in sorted(labels) if s not in flips)
    issues = [Issue(i, s, f["given"], f["true"], 0.05, 0.9, -0.85 + i / 100, 0.5) for i, (s, f) in enumerate(flips.items())]
    issues.append(Issue(9, ok, labels[ok], str((int(labels[ok]) + 1) % 10), 0.3, 0.4, -0.1, 0.5))
    ids = sorted(labels)
    probs = np.full((12, 10), 0.1)
    out = relabel_dir(cfg.artifacts, 1)
    m = export_relabel(issues, ds, out, annotate=cfg.annotate, answers=cfg.data.answers, artifacts=cfg.artifacts,
                       round_index=1)
    read_manifest(out)
    assert m.info["count"] == 4 and (out / "images").is_dir() and len(read_jsonl(out / "relabel.jsonl")) == 4
    tasks = json.loads((out / TASKS_FILE).read_text())
    t = next(t for t in tasks if t["data"]["sample_id"] in flips)
    preds = {p["model_version"]: p["result"][0]["value"]["choices"][0] for p in t["predictions"]}
    assert preds == {"current-label": flips[t["data"]["sample_id"]]["given"],
                     "suggested-label": flips[t["data"]["sample_id"]]["true"]}
    assert export_relabel([], ds, relabel_dir(cfg.artifacts, 2), annotate=cfg.annotate, answers=cfg.data.answers,
                          artifacts=cfg.artifacts, round_index=2) is None

    # An honest annotator answers the relabel set; the CLI import turns the fixes into correction entries.
    f1 = simulate_annotator(out, gt, tmp_path / "inbox1", round_index=1, noise=0.0)
    runner = CliRunner()
    res = runner.invoke(app, ["labels", "import", str(f1), "-c", str(cfg_path), "--round", "1"])
    assert res.exit_code == 0, res.output
    assert "3 labels appended (3 corrections), 1 unchanged" in res.output
    fixed = next(iter(flips))
    hist = ledger.history(fixed)
    assert [e["kind"] for e in hist] == ["label", "correction"] and hist[1]["supersedes"] == hist[0]["entry_id"]
    assert ledger.labels()[fixed] == flips[fixed]["true"]
    # Four re-label tasks went out in round 1: they count against the budget from round 2 on, changed or not.
    assert labels_spent(12, cfg.artifacts, before_round=1) == 12
    assert labels_spent(12, cfg.artifacts, before_round=2) == 16
    res = runner.invoke(app, ["labels", "history", fixed, "-c", str(cfg_path)])
    # Table cells wrap with the terminal width: the ledger behind the table holds the correction.
    assert res.exit_code == 0 and fixed in res.output
    assert [e["kind"] for e in ledger.history(fixed)][-1] == "correction"

    table = label_issue_table(issues, ledger)
    rep = write_label_report(tmp_path / "report", oos=_oos(ids, probs), table=table, agreement={}, answers=DIGITS)
    assert rep.info["issues"] == 4 and len(read_jsonl(tmp_path / "report" / "issues.jsonl")) == 4
    md = label_report_markdown(table, agreement(ledger.entries(), {}), method="kfold", checked=12)
    assert "4 likely label errors among 12" in md and "| simulated |" in md


def _oos(ids, probs):
    from pipeline.labelcheck import OOSResult

    return OOSResult(list(ids), np.asarray(probs, np.float32), np.zeros(len(ids), np.int64), "kfold")


# ---------------------------------------------------------------------- out-of-sample probs with the tiny model
def _rows(n):
    from PIL import Image

    rows = []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray((np.random.RandomState(i).rand(32, 32, 3) * 255).astype("uint8")).save(buf, "PNG")
        rows.append({"sample_id": f"r{i:02d}", "prepared": buf.getvalue(),
                     "question": "Which digit is shown in the image?", "answer": str(i % 3)})
    return rows


def _spec(cfg, held_out=None):
    """The CheckSpec out_of_sample_probs / check_labels read."""
    return CheckSpec.of(model=cfg.model, train=cfg.train, select=cfg.select, labelcheck=cfg.labelcheck,
                        answers=cfg.data.answers, seed=cfg.seed, held_out=held_out)


def _tiny_cfg(tmp_path, model_dir, **train):
    return ProjectConfig.model_validate({
        "paths": {"artifacts": str(tmp_path / "art")}, "data": {"answers": DIGITS},
        "model": {"name_or_path": str(model_dir), "family": "idefics3", "mode": "qlora"},
        "train": {"max_steps": 2, "batch_size": 4, "effective_batch_size": 4, "learning_rate": 3e-3,
                  "gradient_checkpointing": False, **train},
        "select": {"score_batch_size": 8},
    })


def test_kfold_probs_hold_every_sample_out_once_cache_and_agree_with_heldout(tmp_path, tiny_models):
    from pipeline.model.train import check_rows

    cfg = _tiny_cfg(tmp_path, tiny_models["idefics3"])
    rows = _rows(8)
    work = tmp_path / "lc"
    oos = out_of_sample_probs(rows[::-1], work, _spec(cfg), k=2)
    assert oos.method == "kfold" and oos.sample_ids == sorted(r["sample_id"] for r in rows)
    assert oos.probs.shape == (8, 10) and np.allclose(oos.probs.sum(1), 1, atol=1e-4)
    assert sorted(np.bincount(oos.folds)) == [4, 4] and not any(f["reused"] for f in oos.info["folds"])
    by_id = {r["sample_id"]: r for r in rows}
    for i in range(2):
        # No leakage: fold i's adapter trained on exactly the other folds' rows.
        train_ids = [s for s, f in zip(oos.sample_ids, oos.folds, strict=True) if f != i]
        assert read_manifest(work / f"fold-{i}").inputs["rows"] == check_rows([by_id[s] for s in train_ids])
    again = out_of_sample_probs(rows, work, _spec(cfg), k=2)
    assert all(f["reused"] for f in again.info["folds"])
    np.testing.assert_array_equal(again.probs, oos.probs)

    trained = [s for s, f in zip(oos.sample_ids, oos.folds, strict=True) if f != 0]
    held = out_of_sample_probs(rows, work, _spec(cfg, HeldOut(work / "fold-0" / "adapter", frozenset(trained))),
                               method="heldout")
    assert held.method == "heldout" and held.info["skipped_trained_on"] == 4
    fold0 = [j for j, f in enumerate(oos.folds) if f == 0]
    assert held.sample_ids == [oos.sample_ids[j] for j in fold0]
    np.testing.assert_allclose(held.probs, oos.probs[fold0], atol=1e-5)


def test_oos_refuses_what_it_cannot_check(tmp_path, tiny_models):
    cfg = _tiny_cfg(tmp_path, tiny_models["idefics3"])
    rows = _rows(4)
    with pytest.raises(LabelCheckError, match="4 labeled samples cannot make 5 folds"):
        out_of_sample_probs(rows, tmp_path, _spec(cfg), k=5)
    with pytest.raises(LabelCheckError, match="needs the round's adapter"):
        out_of_sample_probs(rows, tmp_path, _spec(cfg), method="heldout")
    bad = [dict(rows[0], answer="seven"), *rows[1:]]
    with pytest.raises(LabelCheckError, match=r"sample r00\): label 'seven' is not in data.answers"):
        out_of_sample_probs(bad, tmp_path, _spec(cfg))
    open_cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"answers": None})})
    with pytest.raises(LabelCheckError, match="closed answer set"):
        out_of_sample_probs(rows, tmp_path, _spec(open_cfg))


# ------------------------------------------------------------------ planted noise with the tiny model (slow)
@pytest.mark.slow
def test_planted_label_noise_is_found_far_above_chance(tmp_path):
    """10 % of the digits labels flipped by the simulated annotator; k-fold out-of-sample probabilities from the tiny
    4-bit model must rank the flips near the top (chance precision = 0.10)."""
    from datasets import Dataset

    from pipeline.config import PreprocessConfig
    from pipeline.data.demo import write_digits
    from pipeline.preprocess import encode_png, prepare_image

    src = write_digits(tmp_path / "digits", limit=150, test_fraction=0.0)
    gt = src / "ground_truth.jsonl"
    truth = {json.loads(line)["image"]: json.loads(line) for line in gt.open()}
    pre = PreprocessConfig(size=32, pad="square")
    ds = Dataset.from_list([
        {"sample_id": t["sample_id"], "question": "Which digit is shown in the image?", "image_path": str(src / img),
         "prepared": encode_png(prepare_image((src / img).read_bytes(), pre, size=32, max_pixels=1 << 26))}
        for img, t in truth.items()
    ])
    # Measured budget: about 80 % test accuracy on clean digits, 1 minute per fold on 2 busy cores.
    cfg = ProjectConfig.model_validate({
        "paths": {"artifacts": str(tmp_path / "art")}, "data": {"answers": DIGITS},
        "model": {"name_or_path": str(tmp_path / "tiny"), "family": "idefics3", "build_tiny_if_missing": True,
                  "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0},
        "train": {"max_steps": 300, "learning_rate": 3e-3, "batch_size": 16, "effective_batch_size": 16,
                  "gradient_checkpointing": False, "checkpoint_every": 1000},
        "labelcheck": {"kfold": 3},
        "select": {"score_batch_size": 64}, "annotate": {"formats": ["label_studio", "images"], "export_images": "prepared"},
    })
    export = export_dir(cfg.artifacts, 0)
    export_selection([{"sample_id": s, "rank": i, "score": 0.0} for i, s in enumerate(ds["sample_id"])], ds, cfg.annotate, cfg.data.answers, cfg.artifacts,
                     export, round_index=0)
    f = simulate_annotator(export, gt, tmp_path / "inbox", round_index=0, noise=0.1, seed=0)
    ledger = Ledger(ledger_path(cfg.artifacts))
    import_labels(f, known_ids=set(ds["sample_id"]), answers=DIGITS, ledger=ledger, round_index=0,
                  rejections_dir=tmp_path / "rej")
    flipped = {x["sample_id"] for x in json.loads(sidecar_path(f).read_text())["flipped"]}
    assert len(flipped) == 15
    labels = ledger.labels()
    rows = [{"sample_id": r["sample_id"], "prepared": r["prepared"], "question": r["question"],
             "answer": labels[r["sample_id"]]} for r in ds]
    oos = out_of_sample_probs(rows, tmp_path / "labelcheck", _spec(cfg))
    issues = find_label_issues(oos.probs, [labels[s] for s in oos.sample_ids], DIGITS, sample_ids=oos.sample_ids)
    top = {i.sample_id for i in issues[: len(flipped)]}
    precision = len(top & flipped) / len(flipped)
    print(f"precision@{len(flipped)} flipped = {precision:.2f} ({len(issues)} flagged)")
    assert precision >= 0.3, precision
    table = label_issue_table(issues, ledger)
    assert all(r["annotators"] == ["simulated"] and r["source_file"] == str(f) for r in table)


# ------------------------------------------------------------ calibrated, abstaining detection (issue 13)
def _softmax(z):
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _synthetic(n=400, c=10, strength=3.0, flip=0.1, seed=0):
    """(calibrated probs, true labels, given labels, flipped mask): labels drawn from the probabilities themselves,
    so the probabilities are calibrated against the truth by construction; then a share of labels flipped."""
    rng = np.random.default_rng(seed)
    probs = _softmax(rng.normal(size=(n, c)) * strength)
    truth = np.array([rng.choice(c, p=p) for p in probs])
    given = truth.copy()
    flipped = np.zeros(n, bool)
    flipped[rng.choice(n, int(round(flip * n)), replace=False)] = True
    given[flipped] = (truth[flipped] + rng.integers(1, c, flipped.sum())) % c
    return probs, truth, given, flipped


@pytest.mark.parametrize("true_t", [0.4, 1.0, 3.0])
def test_temperature_scaling_recovers_a_known_miscalibration(true_t):
    """Probabilities calibrated by construction, then distorted by softmax(log p / T0): the fitted T undoes T0 (an
    over-confident model, T0 < 1, gets T > 1 back), and the NLL of the labels drops to the calibrated one's."""
    probs, truth, _, _ = _synthetic(n=3000, flip=0.0, seed=1)
    distorted = apply_temperature(probs, true_t)
    t = fit_temperature(distorted, truth)
    assert t == pytest.approx(1 / true_t, rel=0.12)
    fixed = apply_temperature(distorted, t)
    nll = lambda p: -np.log(p[np.arange(len(truth)), truth]).mean()  # noqa: E731
    assert nll(fixed) <= nll(distorted) + 1e-9 and nll(fixed) == pytest.approx(nll(probs), abs=0.02)


def test_prune_by_noise_rate_reports_as_many_as_the_calibrated_joint_says():
    """Not every sample below its class threshold: the off-diagonal of the calibrated confident joint bounds the
    count, per (given, suggested) cell, largest margin first; at least one sample of every class is kept."""
    probs, _, given, flipped = _synthetic(n=300, strength=3.0, flip=0.1, seed=2)
    joint = confident_joint(probs, given, 10)
    cal = calibrate_confident_joint(joint, given)
    np.testing.assert_allclose(cal.sum(1), np.bincount(given, minlength=10))
    flagged = prune_by_noise_rate(probs, given, cal)
    bound = sum(int(round(cal[i, j])) for i in range(10) for j in range(10) if i != j)
    assert 0 < flagged.sum() <= bound
    assert flagged[flipped].mean() > 0.6 and flipped[flagged].mean() > 0.3  # chance is 0.1
    # More noise, a larger estimate, more reported.
    probs2, _, given2, _ = _synthetic(n=300, strength=3.0, flip=0.25, seed=2)
    cal2 = calibrate_confident_joint(confident_joint(probs2, given2, 10), given2)
    assert noise_rate(cal2) > noise_rate(cal) and prune_by_noise_rate(probs2, given2, cal2).sum() > flagged.sum()
    assert noise_rate(cal) == pytest.approx((cal.sum() - np.trace(cal)) / 300)
    # Hand-made: a joint that says 1 cat was really a dog picks exactly the most dog-like cat.
    p = np.array([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.2, 0.8], [0.1, 0.9]])
    g = np.array([0, 0, 0, 1, 1])
    assert prune_by_noise_rate(p, g, np.array([[2.0, 1.0], [0.0, 2.0]])).tolist() == [False, False, True, False, False]
    # Never the whole class: the cell asks for 3 of 3 cats, one is kept.
    assert prune_by_noise_rate(p, g, np.array([[0.0, 3.0], [0.0, 2.0]])).sum() == 2


def test_weak_model_abstains_says_why_and_queues_nothing(tmp_path):
    """A model at 60 % out-of-sample accuracy cannot tell its own mistakes from wrong labels: no issues, the reason
    with the accuracy and the floor, nothing for the re-label queue, and the report says so."""
    rng = np.random.default_rng(3)
    n = 60
    truth = np.arange(n) % 10
    pred = np.where(rng.random(n) < 0.6, truth, (truth + rng.integers(1, 10, n)) % 10)
    probs = np.full((n, 10), 0.02)
    probs[np.arange(n), pred] = 0.82
    ids = [f"s{i:03d}" for i in range(n)]
    det = detect_label_issues(probs, [str(t) for t in truth], DIGITS, sample_ids=ids, min_oos_accuracy=0.75)
    acc = (pred == truth).mean()
    assert det.issues == [] and det.abstained is not None
    assert f"model not yet accurate enough to judge labels (OOS accuracy {acc:.2f}" in det.abstained
    assert "labelcheck.min_oos_accuracy 0.75" in det.abstained
    assert det.summary().startswith("label check: model not yet accurate enough")
    assert relabel_candidates(det.issues, min_confidence=0.0, top_n=10) == []
    # Lower the floor and the same model judges, with the model as the only signal.
    judged = detect_label_issues(probs, [str(t) for t in truth], DIGITS, sample_ids=ids, min_oos_accuracy=0.5)
    assert judged.abstained is None and judged.signals["model"]["used"] and not judged.signals["knn"]["used"]
    # The round's report: the abstain message, no table; the verdict file carries it for `tamis labels issues`.
    rep = write_label_report(tmp_path / "r", oos=_oos(ids, probs), table=[], agreement={}, answers=DIGITS,
                             verdict=det.info())
    assert rep.info["abstained"] is True and rep.info["issues"] == 0
    verdict = json.loads((tmp_path / "r" / "verdict.json").read_text())
    md = label_report_markdown([], {}, method="heldout", checked=n, verdict=verdict)
    assert f"label check: model not yet accurate enough to judge labels (OOS accuracy {acc:.2f}" in md
    assert "No label is judged or queued for re-labeling" in md and "| rank |" not in md


def _clustered(n_per=30, c=5, flip=0.1, seed=4):
    """Embeddings in c well-separated clusters (one per true class) and labels with a share flipped."""
    rng = np.random.default_rng(seed)
    truth = np.repeat(np.arange(c), n_per)
    centers = rng.normal(size=(c, 16)) * 4
    emb = centers[truth] + rng.normal(size=(len(truth), 16))
    given = truth.copy()
    flipped = np.zeros(len(truth), bool)
    flipped[rng.choice(len(truth), int(round(flip * len(truth))), replace=False)] = True
    given[flipped] = (truth[flipped] + rng.integers(1, c, flipped.sum())) % c
    return emb, truth, given, flipped


def test_knn_signal_finds_planted_flips_on_its_own_terms():
    """kNN label consistency: a flipped label's neighbours carry the true one, leave-one-out (the sample's own label
    never votes); groups keep neighbours within a group."""
    emb, truth, given, flipped = _clustered()
    p = knn_label_probs(emb, given, 5, k=5)
    assert p.shape == (150, 5) and np.allclose(p.sum(1), 1)
    assert (p.argmax(1)[flipped] == truth[flipped]).mean() > 0.9
    assert (p.argmax(1)[~flipped] == given[~flipped]).mean() > 0.95
    # Leave-one-out: a lone sample of its class in its own corner gets nothing from itself.
    lone = np.vstack([emb, emb[:1] + 1e-3])
    q = knn_label_probs(lone, np.append(given, 4), 5, k=1)
    assert q[-1].argmax() == given[0]
    # Groups: with each sample alone in its group nobody has neighbours, and the distribution stays flat.
    flat = knn_label_probs(emb[:4], given[:4], 5, k=3, groups=np.arange(4))
    np.testing.assert_allclose(flat, 0.2)


def test_knn_and_model_combine_and_say_which_signal_flagged():
    """A middling model (75 % accurate, its errors confident) and the kNN signal: together they find the planted
    flips with few false alarms, where the model alone reports more of its own mistakes; every issue names its
    signal(s), and the expected false alarms are in the right range."""
    emb, truth, given, flipped = _clustered(n_per=40, c=5, flip=0.1, seed=5)
    rng = np.random.default_rng(6)
    n, c = len(truth), 5
    pred = np.where(rng.random(n) < 0.8, truth, (truth + rng.integers(1, c, n)) % c)
    probs = np.full((n, c), 0.03)
    probs[np.arange(n), pred] = 0.88
    ids = [f"s{i:03d}" for i in range(n)]
    labels = [str(g) for g in given]
    answers = [str(j) for j in range(c)]
    space = KnnSpace(ids, emb, labels, source="test embeddings")
    both = detect_label_issues(probs, labels, answers, sample_ids=ids, knn=space, min_oos_accuracy=0.6)
    alone = detect_label_issues(probs, labels, answers, sample_ids=ids, min_oos_accuracy=0.6)
    flips = {ids[i] for i in np.flatnonzero(flipped)}

    def precision_recall(det):
        found = {i.sample_id for i in det.issues}
        return len(found & flips) / max(len(found), 1), len(found & flips) / len(flips)

    p_both, r_both = precision_recall(both)
    p_alone, _ = precision_recall(alone)
    # The misses are flips the model itself gets wrong (it names a third class): the signals then disagree.
    assert both.signals["knn"]["used"] and p_both >= 0.9 and r_both >= 0.6, (p_both, r_both)
    assert p_both > p_alone
    assert all(set(i.signals) <= {"model", "knn"} and i.signals for i in both.issues)
    assert any("knn" in i.signals for i in both.issues)
    assert all(i.confidence >= 0.3 for i in both.issues)  # the report bar (REPORT_CONFIDENCE)
    false_alarms = len({i.sample_id for i in both.issues} - flips)
    assert abs(both.expected_false_alarms - false_alarms) <= 2
    # The three-rater estimate sees through the noise: the model's accuracy against the truth, not the labels.
    assert both.signals["model"]["estimated_accuracy"] > both.signals["model"]["accuracy"]
    # A kNN space that lacks a checked sample is named.
    with pytest.raises(LabelCheckError, match="sample s000 has no kNN embedding"):
        detect_label_issues(probs, labels, answers, sample_ids=ids,
                            knn=KnnSpace(ids[1:], emb[1:], labels[1:]), min_oos_accuracy=0.6)


def test_label_error_posterior_needs_more_evidence_when_labels_are_rarely_wrong():
    p = np.array([0.001, 0.01, 0.1])
    rare, common = label_error_posterior(p, 0.02, 10), label_error_posterior(p, 0.2, 10)
    assert (np.diff(rare) < 0).all() and (common >= rare).all()
    assert rare[0] > 0.5 and rare[2] < 0.05
    assert label_error_posterior(p, 0.0, 10).max() == 0.0
    assert three_rater_accuracy(0.7, 0.75, 0.85) == pytest.approx(np.sqrt(0.7 * 0.85 / 0.75))
    assert three_rater_accuracy(0.9, 0.3, 0.2) == 0.9  # never below the measured agreement


def test_relabel_queue_takes_only_confident_issues_capped_by_top_n():
    issues = [Issue(i, f"s{i}", "1", "2", 0.01, 0.9, -0.89, 0.5, conf, ("model",))
              for i, conf in enumerate([0.99, 0.95, 0.91, 0.6, 0.3])]
    assert [i.sample_id for i in relabel_candidates(issues, min_confidence=0.9, top_n=10)] == ["s0", "s1", "s2"]
    assert [i.sample_id for i in relabel_candidates(issues, min_confidence=0.9, top_n=2)] == ["s0", "s1"]
    assert [i.sample_id for i in relabel_candidates(issues, min_confidence=0.9, top_n=10, skip={"s1"})] == ["s0", "s2"]
    assert relabel_candidates(issues, min_confidence=0.999, top_n=10) == []
    assert len(relabel_candidates(issues, min_confidence=0.0, top_n=10)) == 5


def test_knn_space_comes_from_the_selection_embeddings_or_the_check_s_own_scoring():
    """select.embeddings not `model`: every labeled sample is a neighbour, in the selection space; `model`: the
    check's own scoring embeddings, neighbours within each fold; knn_k 0 or no embeddings: skipped, and why."""
    from pipeline.labelcheck import OOSResult, knn_space

    rows = [{"sample_id": f"s{i}", "answer": str(i % 3)} for i in range(6)]
    ids = [r["sample_id"] for r in rows]
    emb = np.eye(6, dtype=np.float32)
    oos = OOSResult(ids[:4], np.full((4, 10), 0.1, np.float32), np.array([0, 0, 1, 1]), "kfold",
                    embeddings=np.ones((4, 3), np.float32))
    pool = ProjectConfig.model_validate({"select": {"embeddings": "pixels"}, "data": {"answers": DIGITS}})
    space, note = knn_space(rows, oos, (ids[::-1] + ["other"], np.vstack([emb[::-1], np.zeros((1, 6))])),
                            scoring=CheckScoring.of(pool.select), labelcheck=pool.labelcheck)
    assert note is None and space.sample_ids == ids and space.labels == [r["answer"] for r in rows]
    np.testing.assert_array_equal(space.embeddings, emb)
    assert "pixels" in space.source and space.groups is None
    space, note = knn_space(rows, oos, None, scoring=CheckScoring.of(pool.select), labelcheck=pool.labelcheck)
    assert space is None and "'pixels' but its embeddings were not passed" in note
    model = ProjectConfig.model_validate({"data": {"answers": DIGITS}})
    space, note = knn_space(rows, oos, None, scoring=CheckScoring.of(model.select), labelcheck=model.labelcheck)
    assert note is None and space.sample_ids == ids[:4] and space.groups.tolist() == [0, 0, 1, 1]
    off = model.model_copy(update={"labelcheck": model.labelcheck.model_copy(update={"knn_k": 0})})
    assert knn_space(rows, oos, None, scoring=CheckScoring.of(off.select), labelcheck=off.labelcheck) == (None, "labelcheck.knn_k is 0")
    bare = OOSResult(ids[:4], oos.probs, oos.folds, "kfold")
    assert knn_space(rows, bare, None, scoring=CheckScoring.of(model.select), labelcheck=model.labelcheck)[0] is None


def test_check_labels_writes_the_verdict_with_both_signals(tmp_path, tiny_models):
    """The round's entry point: k-fold probabilities in their own folder, the kNN signal in the selection space
    passed in, verdict.json and the manifest saying whether it judged and why; a 2-step model abstains."""
    rows = _rows(8)
    cfg = _tiny_cfg(tmp_path, tiny_models["idefics3"]).model_copy(update={
        "select": ProjectConfig.model_validate({"select": {"embeddings": "pixels", "score_batch_size": 8}}).select})
    ids = [r["sample_id"] for r in rows]
    emb = np.random.default_rng(0).normal(size=(len(ids), 4)).astype(np.float32)
    m = check_labels(rows, tmp_path / "report", [], _spec(cfg), oos_dir=tmp_path / "probs",
                     selection_embeddings=(ids, emb))
    assert (tmp_path / "probs" / "fold-0" / "oos").is_dir() and not (tmp_path / "report" / "oos").exists()
    verdict = json.loads((tmp_path / "report" / "verdict.json").read_text())
    assert verdict["abstained"] and "model not yet accurate enough" in verdict["abstain_reason"]
    assert verdict["signals"]["knn"]["source"] == "the select.embeddings space (pixels)"
    assert verdict["signals"]["knn"]["neighbours_from"] == 8
    assert m.info["abstained"] is True and m.info["issues"] == 0 and m.info["message"].startswith("label check:")
    assert read_jsonl(tmp_path / "report" / "issues.jsonl") == []


def test_a_chance_level_model_abstains_even_beside_a_good_knn_signal():
    """The model always takes part: at chance it cannot vouch for the kNN signal (the three-rater estimates need
    three informative raters), so the check abstains rather than let a garbage estimate wave the kNN through."""
    emb, _, given, _ = _clustered(n_per=20, c=5, flip=0.0, seed=7)
    rng = np.random.default_rng(8)
    probs = _softmax(rng.normal(size=(len(given), 5)) * 3)
    ids = [f"s{i:03d}" for i in range(len(given))]
    labels = [str(g) for g in given]
    det = detect_label_issues(probs, labels, [str(j) for j in range(5)], sample_ids=ids,
                              knn=KnnSpace(ids, emb, labels), min_oos_accuracy=0.75)
    assert det.issues == [] and "right more often than wrong" in det.abstained
    assert not det.signals["knn"]["used"] and not det.signals["model"]["used"]


def test_the_summarys_likely_label_errors_name_the_image_file_first():
    """Issue 47: a person reads the label-quality table by the file names they know; the sample ID comes second."""
    from pipeline.labelcheck.report import issue_files

    rows = [{"sample_id": "s0", "image_path": "photos/tiles/F_017.jpg"}, {"sample_id": "s1"}]
    issues = [Issue(1, "s0", "E", "F", 0.1, 0.8, -0.7, 0.9), Issue(2, "s1", "A", "B", 0.2, 0.7, -0.5, 0.8)]
    table = label_issue_table(issues, [], files=issue_files(rows))
    assert [r["file"] for r in table] == ["F_017.jpg", "s1"]  # without an image_path: its ID
    md = label_report_markdown(table, {}, method="kfold", checked=12)
    row = next(line for line in md.splitlines() if line.startswith("| 1 |"))
    assert row.split(" | ")[1:3] == ["F\\_017.jpg", "s0"]
