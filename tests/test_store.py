import json
import os

import pytest

from pipeline.errors import ArtifactError
from pipeline.store import (
    append_jsonl,
    atomic_dir,
    atomic_write_bytes,
    atomic_write_json,
    digest_bytes,
    digest_dir,
    digest_file,
    digest_json,
    find_valid_manifest,
    read_jsonl,
    read_manifest,
    stage_key,
    write_manifest,
)


def test_digests_are_content_based(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"hello")
    b.write_bytes(b"hello")
    assert digest_file(a) == digest_file(b) == digest_bytes(b"hello")
    assert digest_json({"x": 1, "y": [1, 2]}) == digest_json({"y": [1, 2], "x": 1})
    assert digest_json({"x": 1}) != digest_json({"x": 2})
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    for d in (d1, d2):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "f").write_text("1")
    assert digest_dir(d1) == digest_dir(d2)
    (d2 / "sub" / "f").write_text("2")
    assert digest_dir(d1) != digest_dir(d2)


def test_atomic_write_interrupted_before_rename_keeps_old_file(tmp_path, monkeypatch):
    target = tmp_path / "out.json"
    atomic_write_json(target, {"v": 1})

    def crash(*_a, **_k):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        atomic_write_json(target, {"v": 2})
    monkeypatch.undo()
    assert json.loads(target.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temp file left behind


def test_atomic_dir_swaps_whole_folder_or_nothing(tmp_path):
    target = tmp_path / "model"
    with atomic_dir(target) as tmp:
        (tmp / "w.bin").write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "w.bin").write_bytes(b"new-partial")
            raise RuntimeError("killed mid-save")
    assert (target / "w.bin").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_manifest_verifies_outputs(tmp_path):
    atomic_write_bytes(tmp_path / "data.bin", b"payload")
    m = write_manifest(tmp_path, stage="s", stage_version="1", inputs={"src": "abc"}, config={"k": 1},
                       outputs={"data": "data.bin"})
    assert m.key == stage_key("s", "1", {"src": "abc"}, {"k": 1})
    assert read_manifest(tmp_path).outputs["data"].digest == digest_bytes(b"payload")
    assert json.loads((tmp_path / "config.json").read_text()) == {"k": 1}
    assert find_valid_manifest(tmp_path, m.key) is not None
    assert find_valid_manifest(tmp_path, "other-key") is None
    (tmp_path / "data.bin").write_bytes(b"tampered")
    with pytest.raises(ArtifactError, match="corrupt"):
        read_manifest(tmp_path)
    assert find_valid_manifest(tmp_path, m.key) is None
    (tmp_path / "data.bin").unlink()
    with pytest.raises(ArtifactError, match="missing"):
        read_manifest(tmp_path)


def test_append_only_log_survives_torn_line(tmp_path):
    log = tmp_path / "ledger.jsonl"
    append_jsonl(log, [{"a": 1}])
    with open(log, "ab") as f:
        f.write(b'{"a": 2, "tor')  # a crash mid-append
    append_jsonl(log, [{"a": 3}])
    assert read_jsonl(log) == [{"a": 1}, {"a": 3}]


def test_verification_hashes_an_output_again_only_when_its_stat_changed(tmp_path, monkeypatch):
    import pipeline.store as store

    hashed: list[str] = []
    real = store.digest_file
    monkeypatch.setattr(store, "digest_file", lambda p: hashed.append(os.path.basename(p)) or real(p))
    past = 1_700_000_000
    (tmp_path / "dataset").mkdir()
    for name, data in (("data.bin", b"payload"), ("dataset/a.arrow", b"rows-a"), ("dataset/b.json", b"{}")):
        (tmp_path / name).write_bytes(data)
        os.utime(tmp_path / name, (past, past))
    write_manifest(tmp_path, stage="s", stage_version="1", inputs={}, config={},
                   outputs={"data": "data.bin", "dataset": "dataset"})
    hashed.clear()
    read_manifest(tmp_path)
    assert sorted(hashed) == ["a.arrow", "b.json", "data.bin"]  # the first verification reads every file
    hashed.clear()
    read_manifest(tmp_path)
    assert hashed == []  # unchanged stats: trusted
    # Same size, other bytes, an mtime of its own: hashed again and refused.
    (tmp_path / "dataset" / "a.arrow").write_bytes(b"rows-X")
    os.utime(tmp_path / "dataset" / "a.arrow", (past + 5, past + 5))
    with pytest.raises(ArtifactError, match="corrupt"):
        read_manifest(tmp_path)
    assert hashed == ["a.arrow"]
    (tmp_path / "dataset" / "a.arrow").write_bytes(b"rows-a")  # restored, just written: racy, so never trusted yet
    hashed.clear()
    read_manifest(tmp_path)
    read_manifest(tmp_path)
    assert hashed == ["a.arrow", "a.arrow"]
