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


def _mapped_kb(path) -> int:
    """Resident kB of this process's memory maps of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps", encoding="utf-8"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line: range perms offset dev inode [path]
            inside = len(head) >= 6 and head[5] == str(path)
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_a_saved_dataset_s_id_column_is_read_without_mapping_its_images(tmp_path):
    import datasets
    import numpy as np

    from pipeline.store import arrow_column, save_dataset

    rng = np.random.default_rng(0)
    n = 20_000
    feats = datasets.Features({"sample_id": datasets.Value("string"), "image": datasets.Value("binary"),
                               "split": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"sample_id": [f"s{i:07d}" for i in range(n)],
                                     "image": [rng.bytes(3000) for _ in range(n)], "split": ["pool"] * n},
                                    features=feats)
    with atomic_dir(tmp_path / "dataset") as tmp:
        save_dataset(ds, tmp)
    saved = datasets.load_from_disk(str(tmp_path / "dataset"))
    (file,) = (tmp_path / "dataset").glob("*.arrow")
    ids = arrow_column(saved, "sample_id")
    assert len(ids) == n and ids[n - 1].as_py() == f"s{n - 1:07d}"
    # `datasets` writes binary columns 100 rows a batch: opening such a file and reading its IDs mapped 12.9 MB of
    # its 61 MB here (a header and the ID pages of every 300 KB batch, plus what the kernel maps around each fault);
    # in batches of ~32 MB, 0.4 MB.
    assert _mapped_kb(file) < 0.05 * file.stat().st_size / 1024
    assert saved.features == feats and saved.data.table.equals(ds.data.table)  # the same rows, schema and order


def test_atomic_dir_swaps_in_over_a_folder_another_process_put_there_meanwhile(tmp_path, monkeypatch):
    # Two processes building the same content-keyed folder: the other one's rename lands between this one's check
    # that the target is free and its own rename (it failed with ENOTEMPTY before).
    target = tmp_path / "dataset"
    real_replace, raced = os.replace, []

    def other_process_first(src, dst):
        if os.fspath(dst) == os.fspath(target) and not raced:
            raced.append(dst)
            target.mkdir()
            (target / "w.bin").write_bytes(b"theirs")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", other_process_first)
    with atomic_dir(target) as tmp:
        (tmp / "w.bin").write_bytes(b"ours")
    assert (target / "w.bin").read_bytes() == b"ours"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset"]  # the other folder and our temp name are gone
