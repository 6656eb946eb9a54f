"""A key moves exactly when its stage's code (or version marker, or parameters) moved since an older revision.

The older revision (KEYS_SINCE) runs two rounds of a small project in its own checkout; then this code runs the same
round again. Since issue 24 a stage's version carries a digest of its module's code closure (pipeline/codeversion.py),
so "no key moved" became: the stages whose version differs between the two trees (each tree's own flows.stages.STAGES,
computed in a process of that tree) re-execute, each of them, and besides them only stages that consume their output
(CONSUMERS) may; every other stage comes from the cache. With no library change since KEYS_SINCE, nothing executes.
A change that moves parameters on purpose (a new config field in a keyed section) moves KEYS_SINCE to its own commit
and says so; a code change needs no move, the test expects its stages to rerun.
"""

import json
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
# The older revision whose project this code re-runs: until issue 24, the last commit whose cache keys this code had
# to reproduce; since, keys may move only as their stage's code moved. Move it only with a change that means to move
# parameters, and say which in its message. History: 4b66b90 (the tree before the round's decisions moved into
# pipeline/, issue 22: reproduced by the redesign, 12bf5ec); then issues 25 and 26 added model and train fields on
# purpose (model.end_token, model.train, model.liger, train.optimizer, train.activation_offload), moving every key
# those sections are in, at the merge 5197e7d. Issue 24 made every stage version code-aware, moving every key once:
# the reference is the first commit with those keys as they stand, e925e55 (on the cache-keys branch: merge it, do not
# squash it; 6c4b02a had them too, but with the key module in every closure). Issues 34 and 36 moved keys on purpose:
# select.candidates auto and its choice in the select stage's parameters, model.identity (the checkpoint's content and
# the library versions) in the train, evaluate, score and label-check keys, and Prefect keys ending in .json: the
# reference is the merge of both, e02b3c3. To
# move it: run this test at the new commit's tree, check the stages it re-executes are the ones meant, set the full
# hash here and add it to this history.
KEYS_SINCE = "e02b3c3941d0965851abfa6be7c399ae55986412"
VERSIONS = "import json, flows.round; from flows.stages import STAGES; print(json.dumps(STAGES))"
# stage -> the stages that read its output (directly): a stage whose output changed may rerun these, and only these.
CONSUMERS = {
    "ingest": {"preprocess"},
    "preprocess": {"quality", "augment", "embeddings", "train", "evaluate", "labelcheck", "relabel", "score_shard",
                   "select", "export"},
    "quality": {"score_shard", "select", "export"},
    "augment": {"train"},
    "embeddings": {"labelcheck", "select"},
    "train": {"evaluate", "labelcheck", "score_shard", "select", "export"},
    "evaluate": set(),
    "labelcheck": {"relabel", "select"},
    "relabel": set(),
    "score_shard": {"select"},
    "select": {"export"},
    "export": set(),
}


def downstream(stages: set[str]) -> set[str]:
    out, todo = set(stages), list(stages)
    while todo:
        for c in CONSUMERS[todo.pop()] - out:
            out.add(c)
            todo.append(c)
    return out


def stage_versions(code: Path, env: dict[str, str], cwd: Path) -> dict[str, str]:
    """Every stage's version as the tree in `code` derives it (its own pipeline/codeversion.py, in its own process;
    `cwd` holds no other tree: `python -c` imports from its working folder first)."""
    done = subprocess.run([sys.executable, "-c", VERSIONS], env={**env, "PYTHONPATH": str(code)}, cwd=cwd,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


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
    driver.round_with_code(code, config, api_url, *args,
                           artifacts=Path(yaml.safe_load(config.read_text())["paths"]["artifacts"]))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_project_of_the_older_revision_reruns_only_the_stages_whose_code_moved(tmp_path, tiny_models):
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
            env = driver.child_env(art, api_url)
            old_versions, new_versions = (stage_versions(c, env, tmp_path) for c in (old, ROOT))
            tamis(ROOT, config, api_url, "--no-simulate")  # this code, the same round again
            after = executions(art)
        assert set(CONSUMERS) == set(new_versions), "CONSUMERS must name every stage task (flows.stages.STAGES)"
        ran_before = {e["stage"] for e in before}
        moved = {s for s in ran_before if old_versions.get(s) != new_versions[s]}
        executed = {e["stage"] for e in after[len(before):]}
        assert moved <= executed, f"stages whose code moved since {KEYS_SINCE[:7]} but came from the cache: " \
                                  f"{sorted(moved - executed)}"
        assert executed <= downstream(moved), (
            f"stages executed again by this code although neither their code nor anything upstream moved since "
            f"{KEYS_SINCE[:7]} (moved: {sorted(moved)}): {sorted(executed - downstream(moved))}")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, capture_output=True)
