"""Where the model comes from (pipeline.model.resolve), decided in seconds before any heavy stage: a local folder, a
tiny stand-in to build, the HF cache, or the hub; offline or unreachable, one error naming the fixes. No test here
touches the network: "unreachable" is HF_HUB_OFFLINE or an endpoint on 127.0.0.1 that refuses."""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pipeline.errors import ModelError
from pipeline.model.resolve import resolve_model

TAMIS = Path(sys.executable).parent / "tamis"
HUB_ID = "HuggingFaceTB/SmolVLM-256M-Instruct"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on exit: connecting to it is refused


def _fake_cache(cache: Path, repo: str, model: Path) -> Path:
    """The HF cache layout snapshot_download(local_files_only=True) reads: refs/main → snapshots/<commit>/files."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    commit = "0" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    shutil.copytree(model, folder / "snapshots" / commit)
    return folder / "snapshots" / commit


def test_local_folders_and_tiny_stand_ins(tiny_models, tmp_path):
    found = resolve_model(str(tiny_models["idefics3"]))
    assert found.where == "folder" and found.path == str(tiny_models["idefics3"])
    with pytest.raises(ModelError, match="model folder does not exist; build a tiny stand-in with `tamis make-tiny"):
        resolve_model(str(tmp_path / "nothing"), family="idefics3")
    tiny = resolve_model(str(tmp_path / "nothing"), family="idefics3", build_tiny_if_missing=True)
    assert tiny.where == "tiny" and "model.build_tiny_if_missing" in tiny.note
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_a_cached_hub_model_works_offline_and_says_so(tiny_models, tmp_path, monkeypatch):
    from huggingface_hub import constants

    snapshot = _fake_cache(tmp_path / "hub", HUB_ID, tiny_models["idefics3"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    found = resolve_model(HUB_ID)
    assert found.where == "cache" and Path(found.path) == snapshot.resolve()
    assert "from the HF cache snapshot" in found.note and "works offline" in found.note


def test_offline_and_not_cached_fails_at_once_naming_the_fixes(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelError) as err:
        resolve_model(HUB_ID, family="idefics3")
    msg = str(err.value)
    assert "HF_HUB_OFFLINE is set" in msg and f"hf download {HUB_ID}" in msg
    assert "model.name_or_path" in msg and "tamis make-tiny-model --family idefics3" in msg
    assert "model.build_tiny_if_missing" in msg


def test_an_unreachable_hub_fails_within_seconds_without_retries(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    t = time.perf_counter()
    with pytest.raises(ModelError, match=r"did not answer within 5 s \(.*\); either download it"):
        resolve_model(HUB_ID)
    assert time.perf_counter() - t < 10


def test_cli_check_model_takes_a_hub_id_from_the_cache(tiny_models, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from flows.cli.main import app

    _fake_cache(tmp_path / "hub", "org/tiny-vlm", tiny_models["idefics3"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    config = tmp_path / "tamis.yaml"
    config.write_text("model: {name_or_path: org/tiny-vlm}\npreprocess: {size: 32}\n")
    res = CliRunner().invoke(app, ["check-model", "-c", str(config)])
    assert res.exit_code == 0, res.output
    assert "from the HF cache snapshot" in res.output and "prompt / answer" in res.output
    missing = CliRunner().invoke(app, ["check-model", "org/not-cached"])
    assert isinstance(missing.exception, ModelError) and "hf download org/not-cached" in str(missing.exception)


def test_cli_round_with_an_unreachable_hub_model_stops_before_any_stage(tmp_path):
    """`tamis round` as a user runs it, with a hub ID and no network: exit 2 within 30 s, one message naming the
    local-folder and tiny-model fixes, and no stage (not even ingest or preprocessing) has run."""
    images = tmp_path / "images"
    images.mkdir()
    from PIL import Image
    from skimage import data

    Image.fromarray(data.astronaut()[:64, :64]).save(images / "astronaut.png")
    config = tmp_path / "tamis.yaml"
    config.write_text(yaml.safe_dump({"paths": {"artifacts": str(tmp_path / "art")},
                                      "data": {"sources": [{"kind": "folder", "path": str(images)}]},
                                      "model": {"name_or_path": HUB_ID}}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"),
           "PREFECT_HOME": str(tmp_path / "prefect")}
    t = time.perf_counter()
    proc = subprocess.run([str(TAMIS), "round", "-c", str(config)], capture_output=True, text=True, env=env,
                          timeout=120, cwd=tmp_path)
    took = time.perf_counter() - t
    err = " ".join(proc.stderr.split())  # the console wraps at its width
    assert proc.returncode == 2, proc.stdout + err
    assert took < 30, took
    assert f"hf download {HUB_ID}" in err and "tamis make-tiny-model" in err and "Traceback" not in err
    assert err.count("error:") == 1
    assert not (tmp_path / "art" / "executions.jsonl").exists() and not (tmp_path / "art" / "prepare").exists()
