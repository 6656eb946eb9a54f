"""A model still at chance after several trained rounds is said so, with the numbers and what to try, by
`tamis status`, the round's summary.md and report.html, and the model card (pipeline/chance.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import yaml

from pipeline.chance import chance_check
from pipeline.config import load_config
from pipeline.config.sections import ModelConfig, TrainConfig
from pipeline.round_state import RoundState

LETTERS = list("ABCDEFGH")  # 8 answers: chance is 0.125


def _rows(values, *, ci_half=0.09, labels_per_round=24):
    """metrics.jsonl rows: one accuracy per trained round (rounds 0…, seed labels), with a 95 % interval of
    ±ci_half."""
    return [{"round": r, "labels": labels_per_round * (r + 1), "metric": "accuracy", "value": v, "strategy": "margin",
             "ci95": [max(0.0, v - ci_half), min(1.0, v + ci_half)]} for r, v in enumerate(values)]


def test_three_rounds_at_chance_on_eight_answers_warn_with_numbers_and_what_to_try():
    check = chance_check(_rows([0.16, 0.18, 0.17]), LETTERS, train=TrainConfig(), model=ModelConfig())
    w = check.warning
    assert w is not None and check.chance == 0.125
    assert "accuracy 0.170 (95 % CI 0.080–0.260)" in w and "after 3 trained rounds (round 2, 72 labels" in w
    assert "0.160, 0.180, 0.170" in w and "8 answers (0.125)" in w
    # Concrete: the labels per answer and how many more, the config fields and the values to try.
    assert "72 labels over 8 answers is 9.0 per answer" in w and "about 88 more" in w
    assert "train.epochs: 1 → 3" in w and "model.name_or_path" in w and "tamis labels issues" in w


def test_no_warning_above_chance_after_one_round_or_for_open_answers():
    cfgs = {"train": TrainConfig(max_steps=40), "model": ModelConfig(name_or_path="HuggingFaceTB/SmolVLM-256M")}
    above = chance_check(_rows([0.30, 0.45], ci_half=0.05), LETTERS, **cfgs)
    assert above.warning is None and "above chance" in above.reason
    one = chance_check(_rows([0.15]), LETTERS, **cfgs)
    assert one.warning is None and "waits for 2" in one.reason
    open_answers = chance_check(_rows([0.15, 0.15]), None, **cfgs)
    assert open_answers.warning is None and "open answers" in open_answers.reason
    # A later round climbing out of chance clears it; the check of an earlier round (the card's) still sees it.
    rows = _rows([0.15, 0.16, 0.50], ci_half=0.05)
    assert chance_check(rows, LETTERS, **cfgs).warning is None
    assert "train.max_steps: 40 → 120" in chance_check(rows, LETTERS, **cfgs, up_to_round=1).warning


def _project(tmp_path):
    art = tmp_path / "artifacts"
    art.mkdir()
    for r in (0, 1):  # two finished rounds: the next is round 2
        (art / "rounds" / f"{r:03d}").mkdir(parents=True)
        (art / "rounds" / f"{r:03d}" / "round.json").write_text(json.dumps(
            {"round": r, "labeled": 24 * (r + 1), "labeled_digest": f"d{r}", "strategy": "margin"}))
    (art / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows([0.16, 0.18, 0.17])))
    config = tmp_path / "tamis.yaml"
    config.write_text(yaml.safe_dump({"paths": {"artifacts": str(art)}, "data": {"answers": LETTERS}}))
    return config, art


def test_tamis_status_prints_the_warning(tmp_path):
    config, _ = _project(tmp_path)
    env = {**os.environ, "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "flows.cli", "status", "-c", str(config)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "WARNING The model is still at chance: accuracy 0.170" in " ".join(out.stdout.split())
    js = subprocess.run([sys.executable, "-m", "flows.cli", "status", "-c", str(config), "--json"],
                        capture_output=True, text=True, env=env, timeout=300)
    assert json.loads(js.stdout)["at_chance"].startswith("The model is still at chance")


def test_the_round_records_it_and_summary_report_and_card_show_it(tmp_path):
    from pipeline.chance import card_lines
    from pipeline.report import summary_markdown
    from pipeline.round.plan import Eligible, plan_round
    from pipeline.round.stop import close_round
    from pipeline.round_state import RoundState
    from pipeline.roundreport.build import build_report
    from pipeline.roundreport.sources import ReportSources

    config, art = _project(tmp_path)
    cfg = load_config(config)
    plan = plan_round(art, {f"s{i:03d}": LETTERS[i % 8] for i in range(72)})
    state = plan.state([], annotation_time=None, strategy="margin", quality_flags=None)
    close_round(cfg, plan, state, Eligible([f"p{i:03d}" for i in range(100)], set(), set()), agreed={})
    assert state.at_chance and state.at_chance.startswith("The model is still at chance")
    assert RoundState.from_json(json.loads(json.dumps(state.to_json()))).at_chance == state.at_chance
    md = summary_markdown(state, [])
    assert md.splitlines()[2] == f"**{state.at_chance}**"  # right under the title
    plan.dir.mkdir(parents=True, exist_ok=True)
    sources = ReportSources(round=plan.index, round_dir=str(plan.dir), artifacts=str(art), answers=LETTERS, seed=0)
    html = build_report(sources, state, None).html.read_text()
    assert 'id="at-chance"' in html and "still at chance: accuracy 0.170" in html
    assert card_lines(state.at_chance)[-1] == state.at_chance


def test_the_model_card_carries_the_warning(tmp_path, tiny_models):
    from pipeline.export_model import Provenance, load_processor, model_card

    model = ModelConfig(name_or_path=str(tiny_models["idefics3"]))
    warning = chance_check(_rows([0.16, 0.18, 0.17]), LETTERS, train=TrainConfig(), model=model).warning
    state = RoundState(round=2, metrics={"accuracy": 0.17}, at_chance=warning)
    card = model_card(Provenance(2, state, None, [], tmp_path), model_cfg=model, loaded=load_processor(model),
                      adapter_config={}, rounds_done=3, consensus="majority", question="Which letter?",
                      answers=LETTERS, evaluation=None, base="tiny", preprocess_note="", merged_dtype=None)
    assert f"## Warning: at chance\n\n{warning}\n" in card
    assert card.index("## Warning: at chance") < card.index("## Test metrics")
