"""The listing check (data.verify: listing): an unchanged source is learned from its folders' mtimes, without a
stat per image; what it sees, what only the stat sweep sees, and what only verify: content sees."""

import io
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.config import parse_config
from pipeline.data.ingest import source_digest
from pipeline.data.listing import LISTING_NAME

PAST = time.time() - 3600  # older than the racy window, for files and folders alike


def png(i: int) -> bytes:
    pixels = np.random.default_rng(i).integers(0, 256, (12, 12), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def age(root: Path) -> None:
    """Every file and folder under `root` (and root) dated an hour back, as a pool that was not just written."""
    for p in [*root.rglob("*"), root]:
        os.utime(p, (PAST, PAST))


def make_pool(root: Path, n: int = 24, folders: int = 3) -> Path:
    for i in range(n):
        p = root / f"class{i % folders}" / f"{i:04d}.png"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(png(i))
    age(root)
    return root


def cfg_for(tmp_path: Path, verify: str = "listing", sources=None, **data):
    sources = sources or [{"kind": "folder", "path": str(tmp_path / "pool")}]
    return parse_config({"data": {"sources": sources, "verify": verify, **data},
                         "paths": {"artifacts": str(tmp_path / "art")}}).data


class Calls:
    """os.stat / os.lstat / os.scandir, counted by path, each still the real function."""

    def __init__(self, monkeypatch):
        self.paths: list[str] = []
        self.scandirs: list[str] = []
        for name in ("stat", "lstat", "scandir"):
            monkeypatch.setattr(os, name, self._counting(getattr(os, name), self.scandirs if name == "scandir"
                                                         else self.paths))

    @staticmethod
    def _counting(real, calls: list[str]):
        def call(path=".", *args, **kwargs):
            calls.append(os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path))
            return real(path, *args, **kwargs)
        return call

    def of(self, suffix: str) -> list[str]:
        return [p for p in self.paths if p.endswith(suffix)]


def test_a_no_op_run_stats_the_folders_not_the_files(tmp_path, monkeypatch, caplog):
    make_pool(tmp_path / "pool", n=60, folders=3)
    data = cfg_for(tmp_path)
    key = source_digest(data, tmp_path / "art")  # the first run walks (a stat per file) and records the listing
    assert (tmp_path / "art" / "ingest" / LISTING_NAME).is_file()

    calls = Calls(monkeypatch)
    with caplog.at_level(logging.INFO, logger="pipeline.data.ingest"):
        assert source_digest(data, tmp_path / "art") == key
    assert calls.of(".png") == [] and calls.scandirs == []  # no image looked up, no folder listed
    pool = str((tmp_path / "pool").resolve())
    assert sorted({p for p in calls.paths if p.startswith(pool + os.sep)}) == [f"{pool}/class{i}" for i in range(3)]
    assert len(calls.paths) < 30  # those, the root, the source path resolved, the artifacts' files: none per image
    assert "1 of 1 source(s) answered by their folder listing" in caplog.text

    calls.paths.clear()
    assert source_digest(cfg_for(tmp_path, "stat"), tmp_path / "art") == key
    assert len(calls.of(".png")) == 60  # the stat sweep: one lookup per file


def _add(pool: Path) -> None:
    (pool / "class0" / "new.png").write_bytes(png(1000))


def _remove(pool: Path) -> None:
    (pool / "class1" / "0004.png").unlink()


def _rename(pool: Path) -> None:
    os.rename(pool / "class2" / "0005.png", pool / "class2" / "renamed.png")


def _move_between_folders(pool: Path) -> None:
    os.rename(pool / "class2" / "0005.png", pool / "class0" / "0005.png")


def _rewrite_in_place(pool: Path) -> None:
    (pool / "class0" / "0003.png").write_bytes(png(2000))  # open, truncate, write: the folder's mtime stays


def _rewrite_with_old_timestamp(pool: Path) -> None:
    """The same size, other bytes, and the old mtime put back (touch -d): the file's stat says nothing changed
    but its ctime."""
    p = pool / "class0" / "0003.png"
    data = bytearray(p.read_bytes())
    data[-20] ^= 0xFF
    p.write_bytes(bytes(data))
    os.utime(p, (PAST, PAST))


def _sidecar_added(pool: Path) -> None:
    (pool / "class1" / "0004.txt").write_text("Which texture is this?")  # the question of 0004.png from now on


# change → (seen by the listing check, seen by the stat sweep); verify: content sees every one.
CHANGES = {
    "sidecar_added": (_sidecar_added, True, True),
    "add": (_add, True, True),
    "remove": (_remove, True, True),
    "rename": (_rename, True, True),
    "move_between_folders": (_move_between_folders, True, True),
    "rewrite_in_place": (_rewrite_in_place, False, True),
    "rewrite_with_old_timestamp": (_rewrite_with_old_timestamp, False, False),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_which_check_sees_which_change(tmp_path, change):
    mutate, by_listing, by_stat = CHANGES[change]
    pool = make_pool(tmp_path / "pool")
    art = tmp_path / "art"
    before = source_digest(cfg_for(tmp_path), art)
    source_digest(cfg_for(tmp_path), art)  # a no-op answered by the listing: nothing moved yet

    mutate(pool)
    truth = source_digest(cfg_for(tmp_path))  # no artifacts: every file read
    assert truth != before
    assert source_digest(cfg_for(tmp_path), art) == (truth if by_listing else before)
    assert source_digest(cfg_for(tmp_path, "stat"), art) == (truth if by_stat else before)
    assert source_digest(cfg_for(tmp_path, "content"), art) == truth
    # After the content run recorded the file's digest, every mode agrees again.
    assert source_digest(cfg_for(tmp_path, "stat"), art) == truth


def test_every_sweep_every_th_run_looks_up_every_file(tmp_path):
    pool = make_pool(tmp_path / "pool")
    art = tmp_path / "art"
    data = cfg_for(tmp_path, sweep_every=2)
    before = source_digest(data, art)
    _rewrite_in_place(pool)
    truth = source_digest(cfg_for(tmp_path))
    assert [source_digest(data, art) for _ in range(3)] == [before, before, truth]  # runs 1, 2 listed; run 3 swept
    listing = json.loads((art / "ingest" / LISTING_NAME).read_text())
    assert listing["runs_since_sweep"] == 0


def test_a_manifest_edited_with_its_old_timestamp_put_back_is_seen_by_the_listing(tmp_path):
    pool = make_pool(tmp_path / "pool")
    manifest = tmp_path / "pool" / "m.jsonl"
    rows = [{"image": str(p.relative_to(pool)), "answer": p.parent.name} for p in sorted(pool.rglob("*.png"))]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    age(pool)
    sources = [{"kind": "jsonl", "path": str(manifest)}]
    art = tmp_path / "art"
    before = source_digest(cfg_for(tmp_path, sources=sources), art)
    manifest.write_text("".join(json.dumps({**r, "answer": "x" + r["answer"][1:]}) + "\n" for r in rows))
    os.utime(manifest, (PAST, PAST))  # same size, old mtime: its ctime still moved
    after = source_digest(cfg_for(tmp_path, sources=sources), art)
    assert after != before and after == source_digest(cfg_for(tmp_path, sources=sources))
    # A manifest's images are watched by their folders: one added beside them and listed is seen too.
    (pool / "class1" / "new.png").write_bytes(png(3000))
    with manifest.open("a") as f:
        f.write(json.dumps({"image": "class1/new.png"}) + "\n")
    assert source_digest(cfg_for(tmp_path, sources=sources), art) == source_digest(cfg_for(tmp_path, sources=sources))


def test_a_recently_changed_folder_is_walked_again_until_its_mtime_is_safely_past(tmp_path, monkeypatch):
    pool = make_pool(tmp_path / "pool")
    _add(pool)  # class0's mtime is now: a listing recorded now could miss a change within the same tick
    art = tmp_path / "art"
    source_digest(cfg_for(tmp_path), art)
    assert json.loads((art / "ingest" / LISTING_NAME).read_text())["sources"] == {}
    calls = Calls(monkeypatch)
    source_digest(cfg_for(tmp_path), art)
    assert len(set(calls.of(".png"))) == 25  # walked again: every file looked up


def test_a_damaged_listing_costs_a_walk_not_a_wrong_key(tmp_path):
    make_pool(tmp_path / "pool")
    art = tmp_path / "art"
    key = source_digest(cfg_for(tmp_path), art)
    (art / "ingest" / LISTING_NAME).write_text("{not json")
    assert source_digest(cfg_for(tmp_path), art) == key
    assert json.loads((art / "ingest" / LISTING_NAME).read_text())["sources"] != {}


def test_the_listing_key_follows_the_source_config(tmp_path):
    """A listing answers only for the config it was recorded under: another question is another set of rows."""
    make_pool(tmp_path / "pool")
    art = tmp_path / "art"
    a = source_digest(cfg_for(tmp_path), art)
    b = source_digest(cfg_for(tmp_path, question="What is it?"), art)
    assert a != b and b == source_digest(cfg_for(tmp_path, question="What is it?"))


def test_a_saved_dataset_is_watched_by_its_own_files(tmp_path):
    from datasets import Dataset

    path = tmp_path / "saved"
    Dataset.from_dict({"image": [png(i) for i in range(6)]}).save_to_disk(str(path))
    age(path)
    sources = [{"kind": "hf", "path": str(path)}]
    art = tmp_path / "art"
    before = source_digest(cfg_for(tmp_path, sources=sources), art)
    assert source_digest(cfg_for(tmp_path, sources=sources), art) == before
    assert json.loads((art / "ingest" / LISTING_NAME).read_text())["runs_since_sweep"] == 1  # answered by it
    Dataset.from_dict({"image": [png(i) for i in range(7)]}).save_to_disk(str(tmp_path / "saved2"))
    for f in (tmp_path / "saved2").iterdir():  # saved again in place, file by file
        (path / f.name).write_bytes(f.read_bytes())
    after = source_digest(cfg_for(tmp_path, sources=sources), art)
    assert after != before and after == source_digest(cfg_for(tmp_path, sources=sources))


def test_tamis_ingest_with_nothing_new_is_answered_by_the_folders(tmp_path):
    """`tamis ingest` as a user types it, on an ingest already on disk (built by the library, as the flow's stage
    would): "nothing changed", learned from the folders' listing (the run is counted as one answered by it)."""
    import subprocess
    import sys

    import yaml

    from pipeline.data.ingest import ingest_params, ingest_stage

    make_pool(tmp_path / "pool", n=12)
    config = tmp_path / "tamis.yaml"
    config.write_text(yaml.safe_dump({"paths": {"artifacts": str(tmp_path / "art")},
                                      "data": {"sources": [{"kind": "folder", "path": str(tmp_path / "pool")}]}}))
    data = cfg_for(tmp_path)
    ingest_stage(ingest_params(data, tmp_path / "art", source_digest(data, tmp_path / "art")))
    tamis = Path(sys.executable).parent / "tamis"
    for runs in (1, 2):
        proc = subprocess.run([str(tamis), "ingest", "--config", str(config)], capture_output=True, text=True,
                              timeout=300, check=False, env={**os.environ, "COLUMNS": "200"})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "nothing changed since the last ingest" in proc.stdout
        assert json.loads((tmp_path / "art" / "ingest" / LISTING_NAME).read_text())["runs_since_sweep"] == runs
