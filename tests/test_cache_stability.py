"""No cache key moved: a project built by an older revision of tamis re-runs unchanged with this code.

The older revision (KEYS_SINCE) runs two rounds of a small project in its own checkout; then this code runs the same
round again. Every stage must come from the cache: nothing is appended to artifacts/executions.jsonl. A change that
moves keys on purpose (a new stage version, a new config field) moves KEYS_SINCE to its own commit and says so.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from benchmarks import _round_driver as driver
from pipeline.data.demo import write_digits
from pipeline.store import executions

ROOT = Path(__file__).resolve().parents[1]
# The last commit whose cache keys this code must reproduce. Move it only with a change that means to recompute
# stages, and say which in its message. History: 4b66b90 (the tree before the round's decisions moved into
# pipeline/, issue 22: reproduced by the redesign, 12bf5ec); then issues 25 and 26 added model and train fields on
# purpose (model.end_token, model.train, model.liger, train.optimizer, train.activation_offload), moving every key
# those sections are in, at the merge 5197e7d.
KEYS_SINCE = "5197e7d5249045e4343005ea86e58887e84fcfc5"
CLI = "import sys; from flows.cli import run; sys.argv = ['tamis', *sys.argv[1:]]; run()"


def old_checkout(dest: Path) -> Path:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        if os.environ.get("CI"):
            pytest.fail("the cache-key check needs this repository's git history (a full clone)")
        pytest.skip("needs a git checkout with history")
    have = subprocess.run(["git", "cat-file", "-e", f"{KEYS_SINCE}^{{commit}}"], cwd=ROOT, capture_output=True)
    if have.returncode != 0:
        msg = f"commit {KEYS_SINCE[:12]} is not in this clone (a shallow clone?); fetch the full history"
        pytest.fail(msg) if os.environ.get("CI") else pytest.skip(msg)
    subprocess.run(["git", "worktree", "add", "--detach", str(dest), KEYS_SINCE], cwd=ROOT, check=True,
                   capture_output=True)
    return dest


def tamis(code: Path, config: Path, api_url: str, *args: str) -> None:
    art = yaml.safe_load(config.read_text())["paths"]["artifacts"]
    env = {**driver.child_env(Path(art), api_url), "PYTHONPATH": str(code)}
    where = subprocess.run([sys.executable, "-c", "import pipeline, flows; print(pipeline.__file__, flows.__file__)"],
                           cwd=config.parent, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert all(Path(w).is_relative_to(code) for w in where), f"the code in {code} is not what runs: {where}"
    done = subprocess.run([sys.executable, "-c", CLI, "round", "--config", str(config), *args], cwd=config.parent,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"tamis round with the code in {code} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_project_of_the_older_revision_reruns_without_executing_a_stage(tmp_path, tiny_models):
    old = old_checkout(tmp_path / "old")
    try:
        digits = write_digits(tmp_path / "digits", limit=60)
        shutil.copytree(tiny_models["idefics3"], tmp_path / "model")
        config = tmp_path / "tamis.yaml"
        config.write_text(yaml.safe_dump({
            "seed": 0,
            "paths": {"artifacts": str(tmp_path / "artifacts")},
            "data": {"sources": [{"kind": "jsonl", "path": str(digits / "manifest.jsonl")}],
                     "answers": [str(d) for d in range(10)], "question": "Which digit is shown in the image?",
                     "ground_truth": str(digits / "ground_truth.jsonl")},
            "preprocess": {"size": 32, "pad": "square"},
            "model": {"name_or_path": str(tmp_path / "model"), "family": "idefics3", "mode": "qlora"},
            "train": {"batch_size": 4, "effective_batch_size": 4, "max_steps": 2, "checkpoint_every": 1,
                      "init": "warm"},
            # pixels: the selection-embeddings stage runs too; relabel: so does the re-label export.
            "select": {"batch_size": 8, "strategy": "margin", "diversity": "cluster_margin", "shard_size": 16,
                       "embeddings": {"source": "pixels"}, "cold_start": "typiclust"},
            "labelcheck": {"method": "kfold", "kfold": 2, "relabel_top_n": 4},
            "rounds": {"max_rounds": 5, "simulate_annotator": True},
        }))
        with driver.prefect_server(tmp_path / "prefect-server") as api_url:
            tamis(old, config, api_url)  # round 0: the cold start, answered by the simulated annotator
            tamis(old, config, api_url, "--no-simulate")  # round 1: every stage of a trained round
            art = tmp_path / "artifacts"
            stages = {e["stage"] for e in executions(art)}
            assert {"ingest", "preprocess", "quality", "embeddings", "train", "evaluate", "labelcheck",
                    "score_shard", "select", "export", "relabel"} <= stages, stages
            before = executions(art)
            tamis(ROOT, config, api_url, "--no-simulate")  # this code, the same round again
            after = executions(art)
        assert after == before, f"stages executed again by this code: {[e['stage'] for e in after[len(before):]]}"
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, capture_output=True)
