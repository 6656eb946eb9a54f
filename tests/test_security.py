"""Security checks: no unsafe deserialisation in the code, weights as safetensors, exports and imports confined to
their folders, servers on loopback."""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest
from test_bad_inputs import snapshot
from test_labels import _ann, _task

from pipeline.annotation.export import IMAGES_DIR, TASKS_FILE, ExportError, export_dir, export_selection
from pipeline.config import load_config, parse_config
from pipeline.errors import ConfigError
from pipeline.store import digest_file, read_jsonl, read_manifest

REPO = Path(__file__).resolve().parents[1]
DIGITS = [str(i) for i in range(10)]

# ------------------------------------------------------------------------------------------------ (a) static scan
# Calls that run code or unpickle whatever the file holds. Qualified names, after resolving import aliases.
FORBIDDEN = {
    "pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads", "cPickle.load",
    "cPickle.loads", "dill.load", "dill.loads", "joblib.load", "marshal.load", "marshal.loads", "shelve.open",
    "pandas.read_pickle", "torch.save", "yaml.load", "yaml.load_all", "yaml.full_load", "yaml.full_load_all",
    "yaml.unsafe_load", "yaml.unsafe_load_all", "eval", "exec", "builtins.eval", "builtins.exec",
}
# Calls that are safe only with a keyword set to a literal value.
NEEDS_KEYWORD = {"torch.load": ("weights_only", True), "numpy.load": ("allow_pickle", False)}
# Keywords that switch the safe behaviour off, whatever the call.
UNSAFE_KEYWORDS = {("weights_only", False), ("allow_pickle", True), ("safe_serialization", False)}


def _qualname(node: ast.expr, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def unsafe_calls(source: str, filename: str = "<src>") -> list[str]:
    """`file:line: call` for every unsafe deserialisation or code execution in `source` (parsed, not grepped)."""
    tree = ast.parse(source, filename)
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                            for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module:
            aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _qualname(node.func, aliases)
        kw = {k.arg: k.value.value for k in node.keywords if k.arg and isinstance(k.value, ast.Constant)}
        bad = name in FORBIDDEN
        if name in NEEDS_KEYWORD:
            key, value = NEEDS_KEYWORD[name]
            bad = bad or kw.get(key, object()) is not value
        bad = bad or any(kw.get(k, object()) is v for k, v in UNSAFE_KEYWORDS)
        if bad:
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)[:120]}")
    return found


def _sources() -> list[Path]:
    return sorted(p for d in ("pipeline", "flows") for p in (REPO / d).rglob("*.py"))


def test_scanner_finds_unsafe_calls_and_ignores_lookalikes():
    bad = """
import pickle, yaml, torch
import numpy as np
from pickle import loads as pl
from torch import load
pickle.load(f)
pl(b)
yaml.load(s, Loader=yaml.SafeLoader)
torch.load(p)
torch.load(p, weights_only=False)
load(p, map_location="cpu")
np.load(p)
np.load(p, allow_pickle=True)
eval("1 + 1")
exec(code)
model.save_pretrained(d, safe_serialization=False)
torch.save(state, p)
"""
    hits = unsafe_calls(bad)
    assert [int(h.split(":")[1]) for h in hits] == list(range(6, 18)), hits
    fine = """
import torch, yaml, json
import numpy as np
from safetensors.torch import load_file
model.eval()                      # a method, not the builtin
torch.load(p, weights_only=True)
np.load(p, allow_pickle=False)
yaml.safe_load(s)
json.loads(s)
load_file(p)
text = "pickle.load(f) eval(x)"   # strings and comments are not calls: pickle.load(f)
"""
    assert unsafe_calls(fine) == []


def test_library_and_flows_never_unpickle_or_execute_input():
    files = _sources()
    assert len(files) > 30  # the scan really covers the code base
    found = [hit for p in files for hit in unsafe_calls(p.read_text(encoding="utf-8"), str(p.relative_to(REPO)))]
    assert found == []


def test_config_yaml_tags_cannot_construct_objects(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "c.yaml"
    path.write_text(f"data: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match="not valid YAML: could not determine a constructor"):
        load_config(path)
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------ (b) weights
_PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy"}


def assert_no_pickles(folder: Path) -> list[str]:
    """Every file is a readable safetensors file or UTF-8 text (JSON, tokenizer, README): nothing opaque."""
    from safetensors import safe_open

    names = []
    for p in sorted(folder.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(folder).as_posix()
        names.append(rel)
        assert p.suffix not in _PICKLE_SUFFIXES, rel
        if p.suffix == ".safetensors":
            with safe_open(str(p), framework="pt") as f:
                assert list(f.keys()), rel
        else:
            head = p.read_bytes()
            assert not head.startswith((b"\x80", b"PK\x03\x04")), rel  # pickle protocol 2+ / torch's zip format
            head.decode("utf-8")
    return names


def test_models_adapters_and_checkpoints_are_safetensors(tiny_models, tmp_path):
    from test_model_train import digit_rows

    from pipeline.model.train import TrainSpec, train_adapter

    for family, folder in tiny_models.items():
        assert "model.safetensors" in assert_no_pickles(folder), family
    cfg = parse_config({"model": {"name_or_path": str(tiny_models["idefics3"]), "mode": "qlora"},
                        "train": {"batch_size": 1, "effective_batch_size": 1, "max_steps": 2, "checkpoint_every": 1,
                                  "gradient_checkpointing": False}})
    out = tmp_path / "train"
    seen: list[str] = []

    def look(step: int, total: int, loss: float) -> None:
        if step == 2:  # the step-1 checkpoint is on disk until training finishes
            seen.extend(assert_no_pickles(out / "checkpoints"))

    result = train_adapter(TrainSpec.of(cfg), digit_rows(2), out, progress=False, on_step=look)
    assert {"step-1/trainable.safetensors", "step-1/optimizer.safetensors", "step-1/rng.safetensors"} <= set(seen)
    assert result.finished and "adapter/adapter_model.safetensors" in assert_no_pickles(out)


# ------------------------------------------------------------------------------------------------ (c) exports
def _export_cfg(tmp_path: Path):
    return parse_config({"paths": {"artifacts": str(tmp_path / "artifacts")}, "data": {"answers": DIGITS}})


@pytest.mark.parametrize("bad", ["../evil", "a/b", "/etc/cron.d/x", "..", "a\\..\\b"])
def test_export_refuses_sample_ids_that_are_paths(tmp_path, make_vqa, bad):
    ds, _ = make_vqa(n=3)
    ds = ds.map(lambda r: {"sample_id": bad if r["sample_id"] == "s001" else r["sample_id"]}, keep_in_memory=True)
    cfg = _export_cfg(tmp_path)
    before = snapshot(tmp_path, tmp_path / "no-skip")
    sel = [{"sample_id": sid, "rank": k, "score": 1.0} for k, sid in enumerate(["s000", bad])]
    with pytest.raises(ExportError, match=f"selection row 1: sample_id {re.escape(repr(bad))} is not a safe file name"):
        export_selection(sel, ds, cfg.annotate, cfg.data.answers, cfg.artifacts, export_dir(cfg.artifacts, 1), round_index=1)
    assert snapshot(tmp_path, tmp_path / "no-skip") == before  # nothing written, inside artifacts or out


def test_export_replaces_planted_symlinks_instead_of_writing_through_them(tmp_path, make_vqa):
    ds, _ = make_vqa(n=4)
    cfg = _export_cfg(tmp_path)
    out = export_dir(cfg.artifacts, 1)
    out.mkdir(parents=True)
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "victim.csv").write_text("precious")
    (outside / "dir" / "keep.png").write_bytes(b"keep")
    (out / "annotate.csv").symlink_to(outside / "victim.csv")
    (out / TASKS_FILE).symlink_to(outside / "victim.csv")
    (out / IMAGES_DIR).symlink_to(outside / "dir")
    (out / "manifest.json").symlink_to(outside / "new.json")  # dangling: following it would create a file
    before = snapshot(outside, outside / "no-skip")

    export_selection([{"sample_id": f"s00{i}", "rank": i, "score": 1.0} for i in range(3)], ds, cfg.annotate, cfg.data.answers, cfg.artifacts, out,
                     round_index=1)
    assert snapshot(outside, outside / "no-skip") == before
    assert not [p for p in out.rglob("*") if p.is_symlink()]  # each link was replaced, none left behind
    assert sorted(p.name for p in (out / IMAGES_DIR).iterdir()) == ["s000.jpg", "s001.jpg", "s002.jpg"]  # legible: the originals
    read_manifest(out)  # and the export verifies


# ------------------------------------------------------------------------------------------------ (d) imports
def test_symlinked_inbox_file_is_read_but_nothing_is_written_outside_artifacts(tmp_path):
    """A label file may live anywhere (the inbox may link to it); tamis only reads it, and every output (ledger,
    rejection report) goes under artifacts/."""
    from pipeline.annotation.inbox import import_inbox

    cfg = parse_config({"paths": {"artifacts": "artifacts"}, "data": {"answers": DIGITS}}, root=tmp_path / "project")
    outside = tmp_path / "outside"
    outside.mkdir()
    label_file = outside / "export.json"
    label_file.write_text(json.dumps([_task("s000", _ann("3")), _task("s001", _ann("cat")), _task("zzz", _ann("1"))]))
    (outside / "dir.json").mkdir()  # a link to a folder is not a label file
    inbox = cfg.artifacts / "inbox"
    inbox.mkdir(parents=True)
    (inbox / "a.json").symlink_to(label_file)
    (inbox / "b.json").symlink_to(outside / "dir.json")
    before = snapshot(tmp_path, cfg.artifacts)

    [rep] = import_inbox(cfg.artifacts, index={"s000", "s001"}, answers=cfg.data.answers, round_index=1)
    assert (rep["accepted"], rep["rejected"]) == (1, 2), rep
    assert snapshot(tmp_path, cfg.artifacts) == before
    assert (inbox / "a.json").is_symlink() and digest_file(label_file) == digest_file(inbox / "a.json")
    [rejections] = list((cfg.artifacts / "rejections").iterdir())
    assert [r["sample_id"] for r in read_jsonl(rejections)] == ["s001", "zzz"]
    assert [e["sample_id"] for e in read_jsonl(cfg.artifacts / "labels.jsonl")] == ["s000"]


# ------------------------------------------------------------------------------------------------ (e) servers
LOOPBACK = ("127.0.0.1", "localhost")


def _binds_loopback(kw: ast.keyword) -> bool:
    """A bind-related keyword in code: only literal loopback values (a user-configured remote `address` is a
    client connection, not a bind)."""
    v = kw.value.value if isinstance(kw.value, ast.Constant) else None
    if kw.arg in ("host", "interface"):
        return v in LOOPBACK
    if kw.arg == "dashboard_address":
        return isinstance(v, str) and v.startswith(tuple(f"{h}:" for h in LOOPBACK))
    if kw.arg == "webserver":
        return v is False
    return True


def _prose(tree: ast.AST) -> set[int]:
    """ids of the string constants that are text for people, not values: docstrings and Field descriptions (the
    receiver's bind rule names the every-interface addresses it refuses)."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            out.add(id(body[0].value))
        if isinstance(node, ast.keyword) and node.arg == "description":
            out |= {id(c) for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
    return out


def test_code_never_binds_every_interface():
    for p in _sources():
        tree = ast.parse(p.read_text(encoding="utf-8"), str(p))
        prose = _prose(tree)
        for node in ast.walk(tree):
            where = f"{p.relative_to(REPO)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
                assert "0.0.0.0" not in node.value and node.value != "::", (where, node.value)
            if isinstance(node, ast.keyword):
                assert _binds_loopback(node), (where, ast.unparse(node))


def test_serve_and_prefect_settings_stay_on_loopback():
    from prefect.settings import get_current_settings

    from flows.settings import prefect_env

    assert not [k for k in prefect_env(Path("artifacts")) if "HOST" in k or k == "PREFECT_API_URL"]
    assert not [k for k in os.environ if k.startswith("PREFECT_") and k.endswith("HOST")]
    s = get_current_settings()
    assert s.server.api.host == "127.0.0.1"  # `prefect server start` without --host
    assert s.runner.server.host in ("localhost", "127.0.0.1") and not s.runner.server.enable
    tree = ast.parse((REPO / "flows" / "deploy.py").read_text(encoding="utf-8"))
    serves = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
              and n.func.attr == "serve"]
    assert len(serves) == 1 and {k.arg for k in serves[0].keywords} <= {"name", "cron", "parameters"}


def test_local_dask_cluster_listens_on_loopback_only():
    from distributed import LocalCluster

    from flows.select import make_task_runner

    runner = make_task_runner(parse_config({"select": {"runner": "dask"}}))
    # The cluster tamis starts, without its worker processes (they take the same `host`).
    with LocalCluster(**{**runner.cluster_kwargs, "n_workers": 0}) as cluster:
        sched = cluster.scheduler
        addrs = [listener.get_host_port()[0] for listener in sched.listeners]
        if getattr(sched, "http_server", None) is not None:
            addrs += [sock.getsockname()[0] for sock in sched.http_server._sockets.values()]
    assert addrs and set(addrs) == {"127.0.0.1"}, addrs


def _code_lines(markdown: str) -> list[str]:
    lines, inside = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif inside:
            lines.append(line.split("#", 1)[0].strip())
    return lines


def test_readme_server_commands_bind_loopback():
    # The server commands live in the docs pages the README links (docs/operations.md, docs/annotation.md).
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    lines = [ln for doc in docs for ln in _code_lines(doc.read_text(encoding="utf-8"))]
    prefect = [ln for ln in lines if ln.startswith("prefect server start")]
    label_studio = [ln for ln in lines if ln.startswith("label-studio")]
    assert prefect and label_studio
    assert all("--host" not in ln for ln in prefect), prefect  # Prefect's default host is 127.0.0.1
    # Label Studio listens on 0.0.0.0 unless told otherwise, and it serves the artifacts folder as local files.
    assert all("--internal-host 127.0.0.1" in ln for ln in label_studio), label_studio
    # `dask scheduler` / `dask worker` lines are the multi-machine set-up, where binding beyond loopback is the point.
    assert not [ln for ln in lines if "0.0.0.0" in ln and not ln.startswith("dask ")]


def test_prefect_results_are_json_never_pickles(tmp_path, prefect_harness):
    """Task results sit on storage the workers share (docs/scaling.md): a pickle there runs code in its reader. After a
    stage task and a flow ran, every result file under the results folder is a JSON record whose value is JSON."""
    from prefect import flow
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH

    from flows.stages import result_key, stage_task

    art = tmp_path / "artifacts"

    @stage_task("resultformat", "1")
    def body(artifacts: str, x: int) -> dict:
        return {"dir": None, "x": x, "digest": "ab" * 8}

    @flow
    def f() -> dict:
        return {"ref": body(artifacts=str(art), x=7)}

    assert f() == {"ref": {"dir": None, "x": 7, "digest": "ab" * 8}}
    results = Path(PREFECT_LOCAL_STORAGE_PATH.value())
    files = [p for p in results.rglob("*") if p.is_file()]
    own = results / result_key("resultformat", "1", {"artifacts": str(art), "x": 7})
    assert own in files and json.loads(own.read_bytes())["metadata"]["serializer"]["type"] == "json"
    for p in files:
        record = json.loads(p.read_bytes())  # a pickle is not JSON
        if "metadata" not in record:  # a bare JSON value (a failed run's exception, a flow's refs): JSON all the same
            continue
        assert record["metadata"]["serializer"]["type"] == "json", p
        assert not record["result"].startswith(("gAS", "gAR")), p  # base64 of a pickle's \x80 protocol header
