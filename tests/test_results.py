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


def test_a_commit_during_a_run_leaves_the_commit_it_started_at_and_says_the_checkout_moved(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                              capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    (repo / "code.py").write_text("x = 1\n")
    results = repo / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "figure.json").write_text("{}\n")
    git("add", "code.py", "benchmarks")
    git("commit", "-qm", "first")
    first = git("rev-parse", "HEAD")
    monkeypatch.setattr(_results, "ROOT", repo)
    monkeypatch.setattr(_results, "_AT_START", _results._checkout())  # what importing the module does
    assert _results.provenance()["commit"] == first and "checkout_moved" not in _results.provenance()
    (results / "figure.json").write_text('{"figure": 1}\n')  # the benchmark's own output, written before its JSON
    assert "checkout_moved" not in _results.provenance() and _results.code_version() == first[:12]
    (repo / "code.py").write_text("x = 2\n")  # edited while the benchmark runs
    assert _results.provenance()["checkout_moved"] == {"head": first, "dirty": True}
    assert _results.code_version() == first[:12]  # what a cache entry made now records: the code that runs
    git("commit", "-qam", "second")
    moved = _results.provenance()
    assert moved["commit"] == first and moved["dirty"] is False
    assert moved["checkout_moved"] == {"head": git("rev-parse", "HEAD"), "dirty": False} != {"head": first}


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
