"""The label check before the model is accurate: while the model abstains, the labeled images' neighbours judge
alone (pipeline.labelcheck.knn, step 6), so a planted wrong label is found in the first labeled round."""

from __future__ import annotations

import json

import numpy as np

from benchmarks.label_check_knn import LETTERS, chance_probs, letter_rows
from pipeline.config import ProjectConfig
from pipeline.labelcheck import (
    CheckScoring,
    CheckSpec,
    check_labels,
    check_report_markdown,
    detect_label_issues,
)
from pipeline.labelcheck.check import neighbour_space


def _planted(n=160, seed=3):
    """Letter tiles, 20 per letter; one F labeled E (the planted error)."""
    rows = [dict(r, question="Which letter?") for r in letter_rows(n, seed)]
    bad = next(r for r in rows if r["answer"] == "F")
    bad["answer"] = "E"
    return rows, bad["sample_id"]


def test_neighbours_judge_while_a_chance_level_model_abstains():
    rows, bad = _planted()
    cfg = ProjectConfig.model_validate({"data": {"answers": LETTERS}})
    ids, labels = [r["sample_id"] for r in rows], [r["answer"] for r in rows]
    space = neighbour_space(rows, None, scoring=CheckScoring.of(cfg.select), labelcheck=cfg.labelcheck)
    det = detect_label_issues(chance_probs(len(rows), 8, 0), labels, LETTERS, sample_ids=ids, neighbours=space)
    assert det.abstained is None and det.signals["neighbours"]["used"] and not det.signals["model"]["used"]
    assert det.signals["neighbours"]["accuracy"] >= cfg.labelcheck.min_oos_accuracy
    flagged = {i.sample_id: i for i in det.issues}
    assert bad in flagged and flagged[bad].suggested_label == "F" and flagged[bad].signals == ("neighbours",)
    assert len(flagged) <= 6  # a few false alarms at most among 159 correct labels
    # Without a model-independent space the check still abstains (the model cannot judge, and says why).
    alone = detect_label_issues(chance_probs(len(rows), 8, 0), labels, LETTERS, sample_ids=ids)
    assert alone.issues == [] and "not yet accurate enough" in alone.abstained


def test_too_few_labels_for_the_neighbours_abstain_and_say_why():
    rows, _ = _planted(n=24)
    cfg = ProjectConfig.model_validate({"data": {"answers": LETTERS}})
    space = neighbour_space(rows, None, scoring=CheckScoring.of(cfg.select), labelcheck=cfg.labelcheck)
    det = detect_label_issues(chance_probs(len(rows), 8, 0), [r["answer"] for r in rows], LETTERS,
                              sample_ids=[r["sample_id"] for r in rows], neighbours=space)
    assert det.issues == [] and det.abstained and "neighbours alone too weak" in det.signals["neighbours"]["note"]


def test_first_labeled_round_check_flags_the_planted_f_labeled_e(tmp_path, tiny_models):
    """check_labels as the first trained round runs it (k-fold adapters of the tiny random-weight model, which is at
    chance; select.embeddings: model): the F labeled E is in issues.jsonl, judged by the neighbours."""
    rows, bad = _planted()
    cfg = ProjectConfig.model_validate({
        "paths": {"artifacts": str(tmp_path / "art")}, "data": {"answers": LETTERS},
        "model": {"name_or_path": str(tiny_models["idefics3"]), "family": "idefics3", "mode": "lora"},
        "train": {"max_steps": 1, "batch_size": 8, "effective_batch_size": 8, "gradient_checkpointing": False},
        "select": {"score_batch_size": 32}, "labelcheck": {"kfold": 2}})
    spec = CheckSpec.of(model=cfg.model, train=cfg.train, select=cfg.select, labelcheck=cfg.labelcheck,
                        answers=LETTERS, seed=0)
    m = check_labels(rows, tmp_path / "report", [], spec, oos_dir=tmp_path / "probs")
    verdict = json.loads((tmp_path / "report" / "verdict.json").read_text())
    assert not verdict["abstained"] and verdict["signals"]["neighbours"]["used"], verdict
    issues = [json.loads(line) for line in (tmp_path / "report" / "issues.jsonl").read_text().splitlines()]
    hit = next(i for i in issues if i["sample_id"] == bad)
    assert hit["given_label"] == "E" and hit["suggested_label"] == "F"
    assert m.info["issues"] == len(issues) and np.isfinite(verdict["signals"]["neighbours"]["accuracy"])
    # The round summary's section says who judged, and why the model did not.
    md = check_report_markdown({"dir": str(tmp_path / "report"), "method": "kfold", "checked": len(rows)})
    assert "judged by their neighbours: the model cannot judge labels yet" in md
    assert "Neighbours alone (5 nearest labeled neighbours in the labeled images' gradient histograms (HOG)" in md
