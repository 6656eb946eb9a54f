"""A box project's per-class AP (box_per_class.json, written by the evaluate stage) read by `tamis status
--per-class` (run as a user runs it), its `--json`, the round summary and the model card's metrics section."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pipeline.boxes.box import Box
from pipeline.boxes.evaluation import box_map
from pipeline.boxes.scenes import SHAPES, make_scenes, write_scenes

TAMIS = Path(sys.executable).parent / "tamis"


def _evaluation(eval_dir: Path) -> dict:
    """An evaluation folder as pipeline.evaluate writes it for boxes: a model that finds every disc and square
    (shifted a little) and no triangle; one class has no labeled test box at all."""
    from pipeline.evaluate import BOX_PER_CLASS_FILE

    scenes = make_scenes(12, seed=5)
    truth = {s.name: [b for b in s.boxes if b.label != "triangle"] for s in scenes}
    predicted = {n: [Box(b.label, b.x + 0.05 * b.w, b.y, b.w, b.h, 0.9) for b in bs] for n, bs in truth.items()}
    result = box_map(truth, predicted, SHAPES, resamples=50)
    eval_dir.mkdir(parents=True)
    (eval_dir / BOX_PER_CLASS_FILE).write_text(json.dumps(result.pop("per_class")))
    (eval_dir / "metrics.json").write_text(json.dumps(result))
    return result


def _box_project(tmp_path: Path, tiny_models) -> tuple[Path, Path]:
    from pipeline.boxes.readers import BoxSet
    from pipeline.boxes.writers import write_coco
    from pipeline.model.hardware import Hardware
    from pipeline.project_init import init_project

    write_scenes(tmp_path / "pool", make_scenes(10, seed=1))
    test = write_scenes(tmp_path / "test", make_scenes(4, seed=2))
    write_coco(tmp_path / "test" / "test.json", BoxSet(labels=SHAPES, images=test.images, sizes=test.sizes))
    config = tmp_path / "project" / "tamis.yaml"
    init_project(tmp_path / "pool", test=tmp_path / "test" / "test.json", model=str(tiny_models["idefics3"]),
                 out=config, hw=Hardware("cpu", [], 2, 8 << 30, 6 << 30))
    return config, tmp_path / "project" / "artifacts"


def test_status_per_class_shows_a_box_projects_ap_per_class(tmp_path, tiny_models):
    from pipeline.round_state import RoundState, round_dir

    config, art = _box_project(tmp_path, tiny_models)
    eval_dir = art / "eval" / "r1"
    result = _evaluation(eval_dir)
    state = RoundState(round=1, labeled=8, metrics={"map50": result["map50"], "map": result["map"]},
                       strategy="token_entropy", eval_dir=str(eval_dir))
    round_dir(art, 1).mkdir(parents=True)
    (round_dir(art, 1) / "round.json").write_text(json.dumps(state.to_json()))
    env = {**os.environ, "COLUMNS": "200"}
    res = subprocess.run([str(TAMIS), "status", "-c", str(config), "--per-class"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "per-class AP (round 1)" in res.stdout and "no per-class evaluation yet" not in res.stdout
    per_class = json.loads((eval_dir / "box_per_class.json").read_text())
    rows = {line.split("│")[1].strip(): line for line in res.stdout.splitlines() if line.count("│") >= 6}
    for r in per_class:
        assert r["label"] in rows, res.stdout
        if r["ap50"] is None:  # triangle: no labeled test box, no AP (as in COCO)
            assert "—" in rows[r["label"]] and r["support"] == 0
        else:
            assert f"{r['ap50']:.3f}" in rows[r["label"]] and f"{r['ap']:.3f}" in rows[r["label"]]
    js = subprocess.run([str(TAMIS), "status", "-c", str(config), "--per-class", "--json"], capture_output=True,
                        text=True, env=env, timeout=300)
    assert js.returncode == 0, js.stderr
    assert json.loads(js.stdout)["per_class"] == per_class


def test_the_summary_and_the_model_card_show_ap_per_class(tmp_path):
    from pipeline.export_model.card import metrics_markdown
    from pipeline.perclass import load_eval_report
    from pipeline.report import evaluation_markdown

    result = _evaluation(tmp_path / "eval")
    ev = load_eval_report(tmp_path / "eval")
    assert ev is not None and [r["label"] for r in ev.per_box_class] == list(SHAPES)
    card = "\n".join(metrics_markdown({"map50": result["map50"], "map": result["map"]}, ev))
    lo, hi = result["map50_ci95"]
    assert f"map50 = {result['map50']:.4f} (95% CI {lo:.3f}–{hi:.3f})" in card
    assert "| class | AP@0.5 | 95% CI | AP@[.5:.95] | 95% CI | labeled boxes |" in card
    assert "| triangle | — | — | — | — | 0 |" in card
    summary = "\n".join(evaluation_markdown(ev))
    assert "## Per-class results" in summary and "| disc |" in summary
