"""benchmarks/_results.py: every results JSON says its commit, tree, config, machine and time, and which code versions
the cache entries it reused came from."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from benchmarks import _results
from pipeline.store import atomic_write_json, write_manifest

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def test_write_result_records_where_the_figures_came_from(tmp_path, capsys):
    out = tmp_path / "r.json"
    started = time.time() - 2.0
    res = _results.write_result({"figure": 1.5, "machine": {"torch_threads": 1}}, out, config={"n": 3},
                                started=started, reused_s=4.0, code_versions=["abc", "abc"])
    assert json.loads(out.read_text()) == res == json.loads(capsys.readouterr().out)
    assert res["commit"] == _git("rev-parse", "HEAD")
    assert res["dirty"] is bool(_git("status", "--porcelain", "--untracked-files=no"))
    assert res["config_digest"] == _results.provenance(config={"n": 3})["config_digest"] != \
        _results.provenance(config={"n": 4})["config_digest"]
    # The benchmark's own machine keys stay; the provenance adds cores and load.
    assert res["machine"]["torch_threads"] == 1 and res["machine"]["cores"] >= 1 and "load_1m" in res["machine"]
    assert res["wall_s"] >= 2.0 and res["reused_s"] == 4.0
    assert res["mixed_code_versions"] is False and res["code_versions"] == ["abc"]
    mixed = _results.provenance(code_versions=["abc", "def", "abc"])
    assert mixed["mixed_code_versions"] is True and mixed["code_versions"] == ["abc", "def"]


def test_code_version_is_the_commit_and_says_dirty():
    version = _results.code_version()
    assert version.removesuffix("+dirty") == _git("rev-parse", "HEAD")[:12]
    assert version.endswith("+dirty") is bool(_git("status", "--porcelain", "--untracked-files=no"))


def _stage(folder: Path, seconds: float | None) -> None:
    atomic_write_json(folder / "out.json", {"x": str(folder)})
    write_manifest(folder, stage="s", stage_version="1", inputs={}, config={}, outputs={"out": "out.json"},
                   info={} if seconds is None else {"seconds": seconds})


def test_cache_folder_counts_what_was_reused_and_which_code_made_it(tmp_path):
    _stage(tmp_path / "old", 7.0)  # cached before versions were recorded
    first = _results.CacheFolder(tmp_path)
    _stage(tmp_path / "a" / "x", 2.5)
    _stage(tmp_path / "b", None)
    done = first.finish()
    me = _results.code_version()
    assert (done["computed"], done["reused"], done["reused_s"]) == (2, 1, 7.0)
    assert sorted(done["code_versions"]) == sorted([me, me, "unrecorded"])
    # The next run reuses all three: the two made above carry this code version, the old one none.
    again = _results.CacheFolder(tmp_path).finish()
    assert (again["computed"], again["reused"], again["reused_s"]) == (0, 3, 9.5)
    assert sorted(again["code_versions"]) == sorted(done["code_versions"])
    assert _results.provenance(code_versions=again["code_versions"])["mixed_code_versions"] is True
    # A stage written again (a rewritten manifest) counts as computed by this run.
    _stage(tmp_path / "old", 1.0)
    last = _results.CacheFolder(tmp_path)
    _stage(tmp_path / "old", 1.0)
    assert last.finish()["computed"] == 1
