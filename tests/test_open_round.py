"""Open answers end to end (data.answers: null): two labeling rounds with the tiny 4-bit model under a Prefect test
server: a cold start, simulated typed answers, round 1 trained on free text, evaluated by exact match / token F1,
the pool scored by generation and selected by generative uncertainty, exported as a Label Studio TextArea task."""

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline.annotation.ledger import Ledger, ledger_path
from pipeline.config import load_config
from pipeline.data.demo import OPEN_QUESTIONS, write_digits
from pipeline.scoring import concat_scores, load_scores
from pipeline.store import read_jsonl, read_manifest


def write_open_project(root, tiny_models, limit=48, **overrides):
    digits = write_digits(root / "digits", limit=limit, open_answers=True)
    model_dir = root / "model"
    shutil.copytree(tiny_models["idefics3"], model_dir)
    cfg = {
        "seed": 0,
        "paths": {"artifacts": str(root / "artifacts")},
        "data": {"sources": [{"kind": "jsonl", "path": str(digits / "manifest.jsonl")}], "answers": None,
                 "ground_truth": str(digits / "ground_truth.jsonl")},
        "preprocess": {"size": 32, "pad": "square"},
        "model": {"name_or_path": str(model_dir), "family": "idefics3", "mode": "qlora", "lora_dropout": 0.1,
                  "max_new_tokens": 4},
        "train": {"batch_size": 4, "effective_batch_size": 4, "max_steps": 2, "learning_rate": 0.002,
                  "checkpoint_every": 1},
        "select": {"batch_size": 6, "strategy": "token_entropy", "diversity": "cluster_margin", "shard_size": 16,
                   "mc_dropout_passes": 2, "score_batch_size": 8},
        "labelcheck": {"method": "heldout", "relabel_top_n": 3},
        "rounds": {"max_rounds": 5, "simulate_annotator": True},
    }
    for section, values in overrides.items():
        cfg.setdefault(section, {}).update(values)
    path = root / "tamis.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_open_answer_rounds_train_evaluate_score_select_and_export_text(tmp_path, tiny_models, prefect_harness):
    from flows.round import labeling_round

    config = write_open_project(tmp_path, tiny_models)
    cfg = load_config(config)
    art = cfg.artifacts
    truth = {json.loads(x)["sample_id"]: json.loads(x)["answer"] for x in open(cfg.data.ground_truth)}
    assert set(truth.values()) - {"even", "odd"}  # number words too, several tokens for the tiny tokenizer

    first = labeling_round(str(config))
    assert first["round"] == 0 and first["selected"] == 6 and first["strategy"].startswith("cold start")
    label_config = ET.fromstring((art / "rounds/000/export/label_config.xml").read_text())
    assert label_config.find("TextArea") is not None and label_config.find("Choices") is None
    inbox = json.loads((art / "inbox/simulated-round-000.json").read_text())
    typed = [t["annotations"][0]["result"][0] for t in inbox]
    assert {r["type"] for r in typed} == {"textarea"}
    assert all(r["value"]["text"][0] == truth[t["data"]["sample_id"]] for r, t in zip(typed, inbox, strict=True))

    second = labeling_round(str(config))  # answered by the simulated annotator once finished
    assert second["round"] == 1 and second["labeled"] == 6
    assert set(second["metrics"]) == {"exact_match", "token_f1", "edit_similarity"}
    assert all(0.0 <= v <= 1.0 for v in second["metrics"].values())
    labels = Ledger(ledger_path(art)).labels()
    assert {labels[t["data"]["sample_id"]] for t in inbox} <= set(truth.values())
    assert all(labels[t["data"]["sample_id"]] == truth[t["data"]["sample_id"]] for t in inbox)

    # Selection by generative uncertainty: the greedy answer's mean token entropy, read from the pool's shards.
    selection = read_jsonl(art / "rounds/001/selection/selection.jsonl")
    assert len(selection) == 6 and not {r["sample_id"] for r in selection} & set(labels)
    assert {r["strategy"] for r in selection} == {"token_entropy"}
    manifest = read_manifest(art / "rounds/001/selection")
    adapter = second["adapter"]["adapter_digest"]
    shards = sorted(p.parent for p in art.glob("scores/*/scores.npz") if read_manifest(p.parent).inputs["adapter"] == adapter)
    pool_scores = concat_scores([load_scores(d) for d in shards])
    assert pool_scores.answers is not None and pool_scores.token_entropy is not None
    assert pool_scores.mc_answers is not None and all(len(a) == 2 for a in pool_scores.mc_answers)
    at = {s: i for i, s in enumerate(pool_scores.sample_ids)}
    assert {r["sample_id"] for r in selection} <= set(at)
    for r in selection:
        i = at[r["sample_id"]]
        assert np.isclose(r["scores"]["token_entropy"], np.nanmean(pool_scores.token_entropy[i]), rtol=1e-5)
        assert r["prediction"] == pool_scores.answers[i]
    assert manifest.info["strategy"] == "token_entropy"

    # Round 1's export: TextArea tasks whose pre-annotation is the model's typed answer.
    tasks = json.loads((art / "rounds/001/export/label_studio_tasks.json").read_text())
    with_pred = [t for t in tasks if t["predictions"]]
    assert with_pred and all(t["predictions"][0]["result"][0]["type"] == "textarea" for t in with_pred)
    assert all(t["data"]["text"] in OPEN_QUESTIONS for t in tasks)

    # Round 2: the label check of open answers. Round 1's adapter answers the 6 labels that came in since (greedy +
    # MC dropout); 2 training steps make a weak model, so the check abstains, as the closed-set one does.
    third = labeling_round(str(config), simulate=False)
    assert third["round"] == 2 and third["labeled"] == 12
    check = third["labelcheck"]
    assert check["method"] == "heldout" and check["checked"] == 6 and check["abstained"] and check["issues"] == 0
    assert check["message"].startswith("label check: model not yet accurate enough to judge labels (OOS accuracy")
    assert "token F1 of its answers" in check["message"]
    verdict = json.loads((Path(check["dir"]) / "verdict.json").read_text())
    assert verdict["signals"]["knn"]["used"] is False and "open answers" in verdict["signals"]["knn"]["note"]
    assert third["relabel"] == 0
    assert "No label is judged or queued for re-labeling" in (art / "rounds/002/summary.md").read_text()


@pytest.fixture(scope="module")
def api_url(tmp_path_factory):
    from test_fault_injection import driver

    with driver.prefect_server(tmp_path_factory.mktemp("prefect-server-open")) as url:
        yield url


@pytest.mark.slow
def test_open_round_killed_in_training_and_in_scoring_resumes_with_the_same_selection(tmp_path, tiny_models,
                                                                                     api_url):
    """Round 1 of an open-answer project SIGKILLed mid-training and again mid-scoring (each in a fresh process):
    the resumed round selects exactly what an uninterrupted one does (same MC-dropout answers, same entropies)."""
    from test_fault_injection import driver

    model = tmp_path / "model"
    shutil.copytree(tiny_models["idefics3"], model)
    digits = write_digits(tmp_path / "digits", limit=60, open_answers=True)
    over = {"data": {"answers": None}, "model": {"lora_dropout": 0.1, "max_new_tokens": 4},
            "select": {"strategy": "answer_disagreement", "diversity": "cluster_margin", "mc_dropout_passes": 2,
                       "score_batch_size": 8, "shard_size": 8}}
    ref_cfg = driver.write_project(tmp_path / "reference", model_dir=model, digits_dir=digits, **over)
    cfg = driver.write_project(tmp_path / "faulted", model_dir=model, digits_dir=digits, **over)
    ref, art = tmp_path / "reference" / "artifacts", tmp_path / "faulted" / "artifacts"
    for r in (0, 1):
        run = driver.run_round(ref_cfg, api_url=api_url, simulate=None if r == 0 else False)
        assert run.state and run.state["round"] == r and not run.error, run.error
    run = driver.run_round(cfg, api_url=api_url)
    assert run.state["round"] == 0 and not run.error, run.error

    K = driver.Kill
    for kill in (K(path="train/*/checkpoints/step-2"), K(path="scores/*/manifest.json", nth=2)):
        killed = driver.run_round(cfg, api_url=api_url, kill=kill, simulate=False)
        assert killed.killed and not killed.error, killed.error
    written = {p: p.stat().st_mtime_ns for p in art.glob("scores/*/manifest.json")}
    done = driver.run_round(cfg, api_url=api_url, simulate=False)
    assert done.state and done.state["round"] == 1 and not done.error, done.error
    adapter = done.state["adapter"]["adapter_digest"]
    shards = [p for p in art.glob("scores/*/manifest.json") if read_manifest(p.parent).inputs["adapter"] == adapter]
    # Only the shards not finished before the kill are scored again (2 were). Counted by the outputs the re-run
    # wrote, not by its stage bodies: a shard killed right after its manifest, before Prefect recorded its result,
    # runs its body again, which finds the verified scores and reuses them.
    rescored = [p for p in shards if written.get(p) != p.stat().st_mtime_ns]
    assert 0 < len(rescored) <= len(shards) - 2 and len(rescored) <= done.stages.count("score_shard")
    assert "train" not in done.stages
    for rel in ("rounds/001/selection/selection.jsonl", "rounds/001/export/label_studio_tasks.json"):
        assert (art / rel).read_bytes() == (ref / rel).read_bytes(), f"{rel} differs from the uninterrupted run's"
    rows = read_jsonl(art / "rounds/001/selection/selection.jsonl")
    assert {r["strategy"] for r in rows} == {"answer_disagreement"} and len(rows) == 6
