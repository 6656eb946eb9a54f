"""`tamis round` with nothing new: the last round's state without starting a flow, and never when anything changed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from pipeline.annotation.simulate import simulated_file
from pipeline.config import load_config
from pipeline.round_state import completed_rounds
from pipeline.store import executions
from pipeline.unchanged import (
    INPUTS_FILE,
    code_digest,
    record_round_inputs,
    round_inputs,
    unchanged_round,
)
from tests.test_round_flow import write_project

TAMIS = Path(sys.executable).with_name("tamis")


def replay(cfg, **kw):
    """unchanged_round as `tamis round` calls it (flows/cli/cmd_rounds.py)."""
    return unchanged_round(cfg.rounds, cfg.annotate, cfg.artifacts, inputs=lambda: round_inputs(cfg), **kw)


def _recorded(art: Path) -> dict:
    return json.loads((art / "rounds" / INPUTS_FILE).read_text())


def test_an_unchanged_round_is_known_before_any_flow(tmp_path, tiny_models, prefect_harness, monkeypatch):
    from flows.round import labeling_round

    config = write_project(tmp_path, tiny_models, limit=40, rounds={"simulate_annotator": False})
    cfg = load_config(config)
    art = cfg.artifacts

    # Round 0 with the simulated annotator: it answers into the inbox, so it changed its own inputs.
    labeling_round(str(config), simulate=True)
    rec = _recorded(art)
    assert rec["round"] == 0 and rec["before"] != rec["after"]
    assert replay(cfg) is None

    # Round 1 imports those answers (the inbox file is consumed): again not a replay-only state.
    labeling_round(str(config))
    assert replay(cfg) is None
    # Its replay reads what it leaves: from now on `tamis round` knows it would only replay round 1.
    labeling_round(str(config))
    state = replay(cfg)
    assert state is not None and state == completed_rounds(art)[-1] and state.round == 1
    assert replay(cfg, simulate=True) is None  # answering would change the labels

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # no server at all: none is needed
    round_json = art / "rounds/001/round.json"
    stamp, runs = round_json.stat().st_mtime_ns, len(list(executions(art)))
    proc = subprocess.run([str(TAMIS), "round", "--config", str(config)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "round 1: nothing changed since it ran" in proc.stdout
    assert "Starting temporary server" not in proc.stdout + proc.stderr
    assert round_json.stat().st_mtime_ns == stamp and len(list(executions(art))) == runs  # no replay ran

    from prefect.settings import get_current_settings

    server = {**env, "PREFECT_API_URL": str(get_current_settings().api.url)}
    full = subprocess.run([str(TAMIS), "round", "--config", str(config), "--full"], capture_output=True, text=True,
                          env=server, timeout=300)
    assert full.returncode == 0, full.stdout + full.stderr
    assert "nothing changed" not in full.stdout
    assert round_json.stat().st_mtime_ns != stamp and len(list(executions(art))) == runs  # a replay: no stage body
    assert replay(cfg) is not None  # and the replay left it as it found it

    # Anything a round reads moves it back to the flow.
    dropped = simulated_file(art / "inbox", 9)  # a label file dropped in the inbox
    dropped.write_text("[]")
    assert replay(cfg) is None
    dropped.unlink()
    assert replay(cfg) is not None

    manifest = Path(cfg.data.sources[0].path)
    original = manifest.read_text()
    first = json.loads(original.splitlines()[0])
    shutil.copy(manifest.parent / first["image"], manifest.parent / "extra.png")
    manifest.write_text(original + json.dumps({**first, "id": "extra", "image": "extra.png"}) + "\n")
    assert replay(cfg) is None  # a new image in the sources
    manifest.write_text(original)
    assert replay(cfg) is not None  # the same rows again (a manifest counts by its content)

    # A round's end does not walk its sources again, yet an image that arrives while a round runs still sends the
    # next `tamis round` to the flow: the record holds the sources as the round started from them.
    import pipeline.data.ingest as ingest

    walks, walk = [], ingest.source_digest
    monkeypatch.setattr(ingest, "source_digest", lambda *a, **kw: walks.append(a) or walk(*a, **kw))
    before = round_inputs(cfg)
    manifest.write_text(original + json.dumps({**first, "id": "extra", "image": "extra.png"}) + "\n")
    record_round_inputs(cfg.artifacts, state, before, round_inputs(cfg, sources=before.sources))
    assert len(walks) == 1 and _recorded(art)["after"] == before.digest
    assert replay(cfg) is None
    manifest.write_text(original)
    assert replay(cfg) is not None and len(walks) == 3

    bigger = yaml.safe_load(config.read_text())
    bigger["select"]["batch_size"] = 7
    config.with_name("other.yaml").write_text(yaml.safe_dump(bigger))
    assert replay(load_config(config.with_name("other.yaml"))) is None  # another config

    shutil.rmtree(state.export_dir)  # an output the annotators need is gone: the flow makes it again
    assert replay(cfg) is None


def test_the_code_digest_moves_with_any_source_file(tmp_path):
    root = Path(__file__).resolve().parents[1]
    copy = tmp_path / "tree"
    for top in ("pipeline", "flows"):
        shutil.copytree(root / top, copy / top, ignore=shutil.ignore_patterns("__pycache__"))
    before = code_digest(copy)
    assert before == code_digest(root)
    (copy / "flows" / "round.py").write_text((copy / "flows" / "round.py").read_text() + "\n# an edit\n")
    assert code_digest(copy) != before
