"""Fault injection: SIGKILL at every stage of a round, a full disk, torn files; nothing lost, nothing half-read.

Fast (default run): real SIGKILLs of small writer processes, a real full disk (a 256 KiB tmpfs when this user may
mount one) or a patched one, readers facing temp leftovers, a torn Prefect result file.
Slow: a whole labeling round (ingest → … → export, then label import → training → … → export) run in subprocesses
that are SIGKILLed at one point after another, each re-run resuming; the outcome must equal an uninterrupted run's.
"""

from __future__ import annotations

import csv
import errno
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from benchmarks import _round_driver as driver
from pipeline.annotation.inbox import inbox_files
from pipeline.annotation.ledger import Ledger, make_entry
from pipeline.errors import ArtifactError
from pipeline.round_state import completed_rounds
from pipeline.store import (
    MANIFEST_NAME,
    append_jsonl,
    atomic_dir,
    atomic_write_json,
    executions,
    read_jsonl,
    read_manifest,
)

ROOT = Path(__file__).resolve().parents[1]

SEED = int(os.environ.get("TAMIS_FAULT_SEED", "7"))  # the random kill delays; printed on failure


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def verify_all_manifests(artifacts: Path) -> list[Path]:
    """Every manifest.json under artifacts verifies (a manifest is written last, so one that exists is whole)."""
    found = sorted(artifacts.rglob(MANIFEST_NAME))
    for m in found:
        if not any(driver.is_temp_name(part) for part in m.relative_to(artifacts).parts):
            read_manifest(m.parent)
    return found


# ---------------------------------------------------------------------------------- SIGKILL of small writers
def _start_writer(code: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline().strip() == b"ready", proc.stderr.read().decode()
    return proc


WRITER = """
import sys
from pipeline.store import atomic_write_json
print("ready", flush=True)
i = 0
while True:
    i += 1
    atomic_write_json(sys.argv[1], {"i": i, "pad": "x" * 300_000})
"""


@pytest.mark.parametrize("trial", range(3))
def test_sigkill_mid_atomic_writes_leaves_the_old_or_the_new_file(tmp_path, trial):
    target = tmp_path / "artifact.json"
    atomic_write_json(target, {"i": 0, "pad": "x" * 300_000})
    proc = _start_writer(WRITER, str(target))
    time.sleep(random.Random(SEED + trial).uniform(0.05, 0.6))
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    data = json.loads(target.read_text())  # never torn
    assert data["i"] >= 0 and len(data["pad"]) == 300_000
    names = [p.name for p in tmp_path.iterdir()]
    assert set(names) - {"artifact.json"} <= {n for n in names if driver.is_temp_name(n)}, names
    atomic_write_json(target, {"i": -1})  # a leftover temp file does not get in the next writer's way
    assert json.loads(target.read_text()) == {"i": -1}


LEDGER_WRITER = """
import sys
from pipeline.annotation.ledger import Ledger, make_entry
ledger = Ledger(sys.argv[1])
print("ready", flush=True)
b = 0
while True:
    ledger.append([make_entry(f"s{b}-{k}", str(k % 10), annotator="a", round_index=0, source_file="f",
                              source_digest=f"d{b}", now=1.0) for k in range(25)])
    b += 1
"""


def test_sigkill_mid_ledger_appends_keeps_whole_batches_and_later_appends_readable(tmp_path):
    path = tmp_path / "labels.jsonl"
    proc = _start_writer(LEDGER_WRITER, str(path))
    time.sleep(random.Random(SEED).uniform(0.2, 0.8))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    ledger = Ledger(path)
    entries = ledger.entries()
    batches = Counter(e["source_digest"] for e in entries)
    assert entries and set(batches.values()) == {25}, batches  # whole batches: no label of a batch lost
    assert len({e["sample_id"] for e in entries}) == len(entries)  # and none twice
    ledger.append([make_entry("late", "3", annotator="a", round_index=1, source_file="g", source_digest="g")])
    assert ledger.labels()["late"] == "3" and len(ledger.entries()) == len(entries) + 1


# ------------------------------------------------------------------------------------------ temp leftovers
def test_readers_never_pick_up_temp_leftovers_of_killed_writes(tmp_path):
    from pipeline.model.train import _checkpoints

    art = tmp_path / "artifacts"
    inbox = art / "inbox"
    inbox.mkdir(parents=True)
    (inbox / "round-000.json").write_text("[]")
    (inbox / ".round-001.json.k2j3.tmp").write_text('[{"data": {"sam')  # a label file being written when killed
    assert [p.name for p in inbox_files(inbox)] == ["round-000.json"]

    ck = art / "train" / "k" / "checkpoints"
    (ck / "step-2").mkdir(parents=True)
    (ck / "step-2" / "state.json").write_text("{}")
    (ck / ".step-4.x1y2.tmp").mkdir()  # killed inside atomic_dir: complete or not, it never counts
    (ck / ".step-4.x1y2.tmp" / "state.json").write_text("{}")
    (ck / "step-6").mkdir()  # a folder without state.json is not a checkpoint either
    assert [s for s, _ in _checkpoints(ck.parent)] == [2]

    rounds = art / "rounds"
    (rounds / "000").mkdir(parents=True)
    (rounds / "000" / "round.json").write_text(json.dumps({"round": 0}))
    (rounds / "001").mkdir()
    (rounds / "001" / ".round.json.ab12.tmp").write_text('{"round": 1, "lab')
    assert [s.round for s in completed_rounds(art)] == [0]

    log = art / "executions.jsonl"
    append_jsonl(log, [{"stage": "a"}])
    with log.open("ab") as f:
        f.write(b'{"stage": "b", "ke')  # torn by a kill mid-append
    append_jsonl(log, [{"stage": "c"}])
    assert [e["stage"] for e in read_jsonl(log)] == ["a", "c"]
    assert sorted(p.name for p in driver.temp_leftovers(art)) == [".round-001.json.k2j3.tmp", ".round.json.ab12.tmp",
                                                                  ".step-4.x1y2.tmp"]


# ----------------------------------------------------------------------------------------------- disk full
class Disk:
    """A folder whose filesystem can be made (nearly) full: a real tmpfs, or patched writes where none mounts."""

    def __init__(self, root: Path, kind: str, monkeypatch: pytest.MonkeyPatch):
        self.root, self.kind, self.mp = root, kind, monkeypatch

    def fill(self, leave: int = 8192) -> None:
        if self.kind == "tmpfs":
            free = shutil.disk_usage(self.root).free
            (self.root / "filler").write_bytes(b"\0" * max(0, free - leave))
            return
        budget = {"left": leave}

        def take(n: int) -> int:
            k = min(n, budget["left"])
            budget["left"] -= k
            return k

        def under_root(fd: int) -> bool:
            try:
                return Path(os.readlink(f"/proc/self/fd/{fd}")).is_relative_to(self.root)
            except OSError:
                return False

        real_write, real_fdopen = os.write, os.fdopen

        def write(fd: int, data: bytes) -> int:
            if not under_root(fd):
                return real_write(fd, data)
            k = take(len(data))
            if k == 0:
                raise OSError(errno.ENOSPC, "No space left on device (patched)")
            return real_write(fd, bytes(data[:k]))  # a short write, as on a nearly full disk

        class Full(io.RawIOBase):
            def __init__(self, f):
                self.f = f

            def write(self, data):
                k = take(len(data))
                self.f.write(bytes(data[:k]))
                if k < len(data):
                    raise OSError(errno.ENOSPC, "No space left on device (patched)")
                return k

            def writable(self):
                return True

            def fileno(self):
                return self.f.fileno()

            def close(self):
                self.f.close()
                super().close()

        def fdopen(fd: int, *a, **k):
            f = real_fdopen(fd, *a, **k)
            return Full(f) if under_root(fd) else f

        self.mp.setattr(os, "write", write)
        self.mp.setattr(os, "fdopen", fdopen)

    def write_file(self, path: Path, data: bytes) -> None:
        """How another library (save_to_disk, save_pretrained) writes into a folder: plain open + write."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)


def _tmpfs_mountable() -> bool:
    """Whether this process may mount a tmpfs (root with CAP_SYS_ADMIN): probed once, at collection."""
    mount, umount = shutil.which("mount"), shutil.which("umount")
    if os.geteuid() != 0 or not mount or not umount:
        return False
    with tempfile.TemporaryDirectory() as probe:
        if subprocess.run([mount, "-t", "tmpfs", "-o", "size=64k", "tmpfs", probe], capture_output=True).returncode:
            return False
        subprocess.run([umount, "-l", probe], capture_output=True)
    return True


@pytest.fixture(params=[
    pytest.param("tmpfs", marks=pytest.mark.skipif(
        not _tmpfs_mountable(), reason="cannot mount a tmpfs here (needs root); the patched variant covers a full disk")),
    pytest.param("patched", marks=pytest.mark.skipif(
        not Path("/proc/self/fd").is_dir(), reason="the patched full disk tells files apart through /proc/self/fd")),
])
def disk(request, tmp_path, monkeypatch):
    root = tmp_path / "fs"
    root.mkdir()
    if request.param == "patched":
        yield Disk(root, "patched", monkeypatch)
        return
    subprocess.run([shutil.which("mount"), "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(root)], check=True,
                   capture_output=True)
    try:
        yield Disk(root, "tmpfs", monkeypatch)
    finally:
        monkeypatch.undo()
        subprocess.run([shutil.which("umount") or "umount", "-l", str(root)], capture_output=True)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_disk_full_on_an_artifact_write_is_a_clear_error_and_keeps_the_previous_file(disk):
    stage = disk.root / "stage"
    atomic_write_json(stage / "selection.json", {"rows": list(range(10))})
    before = (stage / "selection.json").read_bytes()
    disk.fill()
    with pytest.raises(ArtifactError) as exc:
        atomic_write_json(stage / "selection.json", {"rows": list(range(40_000))})
    msg = str(exc.value)
    assert str(stage / "selection.json") in msg and "disk full" in msg and "bytes" in msg and "Free some space" in msg
    assert (stage / "selection.json").read_bytes() == before
    assert sorted(p.name for p in stage.iterdir()) == ["selection.json"]  # no temp file left behind


def test_disk_full_inside_a_folder_write_keeps_the_previous_folder(disk):
    target = disk.root / "dataset"
    with atomic_dir(target) as tmp:
        (tmp / "data-00000.arrow").write_bytes(b"old" * 100)
        (tmp / "state.json").write_text("{}")
    before = _snapshot(target)
    disk.fill()
    with pytest.raises(ArtifactError, match=r"dataset: disk full while writing a folder"), atomic_dir(target) as tmp:
        (tmp / "state.json").write_text('{"new": true}')
        disk.write_file(tmp / "data-00000.arrow", b"n" * 200_000)
    assert _snapshot(target) == before
    assert sorted(p.name for p in disk.root.iterdir()) == ["dataset"] + (["filler"] if disk.kind == "tmpfs" else [])


def test_disk_full_on_a_ledger_append_appends_nothing(disk):
    ledger = Ledger(disk.root / "labels.jsonl")
    ledger.append([make_entry("s0", "1", annotator="a", round_index=0, source_file="f0", source_digest="d0")])
    before = ledger.path.read_bytes()
    disk.fill(leave=4096)
    batch = [make_entry(f"s{i}", str(i % 10), annotator="a" * 200, round_index=1, source_file="f1",
                        source_digest="d1") for i in range(1, 120)]
    with pytest.raises(ArtifactError, match=r"labels\.jsonl: disk full while writing 119 lines"):
        ledger.append(batch)
    # Nothing of the batch: a part would mark the file "imported" (its digest) with most of its labels missing.
    assert ledger.path.read_bytes() == before and "d1" not in ledger.imported_digests()
    (disk.root / "filler").unlink(missing_ok=True)
    disk.mp.undo()
    ledger.append(batch)  # once there is room again, the import goes through whole
    assert len(ledger.labels()) == 120


# ------------------------------------------------------------------ label imports SIGKILLed mid ledger write
OPEN_ANSWER = "José's café: a naïve photo of a dog on a crêpe stand, 東京 ☕ — "  # most bytes multi-byte UTF-8
# What a round runs to import its inbox (flows/round.py: under the project lock, import_inbox over the pool's index).
ROUND_IMPORT = """
import sys
from pathlib import Path
import datasets
from pipeline.annotation.inbox import import_inbox
from pipeline.annotation.matching import SampleIndex
from pipeline.lock import ProjectLock
art, ds = Path(sys.argv[1]), sys.argv[2]
with ProjectLock(art / "round.lock"):
    for rep in import_inbox(art, index=SampleIndex.from_dataset(datasets.load_from_disk(ds)), answers=None,
                            round_index=1):
        assert "error" not in rep, rep
"""


def _open_answer_labels(folder: Path, n: int, chars: int) -> tuple[Path, Path, dict[str, str]]:
    """A saved dataset of n samples and a CSV of long non-ASCII open answers for all of them (~n * chars * 1.3 B)."""
    import datasets

    labels = {f"s{i:05d}": f"{(OPEN_ANSWER * (chars // len(OPEN_ANSWER) + 1))[:chars - i % 97]} {i}"
              for i in range(n)}
    datasets.Dataset.from_dict({"sample_id": list(labels)}).save_to_disk(str(folder / "dataset"))
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerows([("sample_id", "label"), *labels.items()])
    (folder / "labels.csv").write_text(buf.getvalue(), encoding="utf-8")
    return folder / "dataset", folder / "labels.csv", labels


def _kill_once_growing(proc: subprocess.Popen, path: Path, base: int, delay: float) -> int | None:
    """SIGKILL `proc` `delay` s after `path` grows past `base` bytes (inside the ledger's write); the size then, or
    None when the process ended first."""
    while proc.poll() is None:
        try:
            grown = path.stat().st_size > base
        except FileNotFoundError:
            grown = False
        if grown:
            time.sleep(delay)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return path.stat().st_size
        time.sleep(0.0002)
    return None


@pytest.mark.slow
def test_label_imports_sigkilled_in_their_ledger_write_land_every_label_exactly_once(tmp_path):
    """The issue's reproduction, 20 times (TAMIS_KILL_TRIALS): `tamis labels import` (even trials) and a round's
    inbox import (odd ones) of a 5 MB open-answer CSV SIGKILLed while the ledger grows, then run again. Right after
    the kill the file's labels are all in the ledger or none; after the restart, each exactly once. Old code (store,
    ledger, label_files and lock at 7cbc5a8): 14 of 20 trials lose labels, 13 keeping 504 to 1,015 of the 1,346 (the
    file counts as imported, the rest never land) and one leaving a ledger no reader can decode."""
    from pipeline.annotation.ledger import ledger_path

    rng, n, trials = random.Random(SEED), 1346, int(os.environ.get("TAMIS_KILL_TRIALS", "20"))
    dataset, labels_csv, labels = _open_answer_labels(tmp_path, n, 3200)
    assert labels_csv.stat().st_size > 5e6
    config = tmp_path / "c.yaml"
    tamis = [str(Path(sys.executable).parent / "tamis"), "labels", "import", str(labels_csv), "-c", str(config),
             "--dataset", str(dataset)]
    earlier = make_entry("earlier", "an answer imported before", annotator="a", round_index=0, source_file="e.csv",
                         source_digest="e")
    landed, cut_aside, lost = 0, 0, []
    for trial in range(trials):
        art = tmp_path / f"trial-{trial}" / "artifacts"
        config.write_text(f"paths: {{artifacts: {art}}}\n")
        ledger = Ledger(ledger_path(art))
        ledger.append([earlier])
        base = ledger.path.stat().st_size
        if trial % 2:
            (art / "inbox").mkdir()
            shutil.copy(labels_csv, art / "inbox" / "labels.csv")
            cmd = [sys.executable, "-c", ROUND_IMPORT, str(art), str(dataset)]
        else:
            cmd = tamis
        where = f"trial {trial} ({'round import' if trial % 2 else 'tamis labels import'}, seed {SEED})"
        proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
        size = _kill_once_growing(proc, ledger.path, base, rng.uniform(0, 0.004))
        landed += size is not None
        try:
            killed = len(ledger.entries()) - 1  # all of the file's labels or none
        except ValueError as exc:  # old code: a torn UTF-8 line (the answers' é) made the whole ledger unreadable
            lost.append(f"{where}: killed at {size} bytes, the ledger cannot be read: {type(exc).__name__}: {exc}")
            continue
        again = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, f"{where}: the restart failed: {again.stderr[-3000:]}"
        entries = ledger.entries()
        once = Counter(e["sample_id"] for e in entries) == Counter({"earlier": 1, **dict.fromkeys(labels, 1)})
        if killed not in (0, n) or not once or {e["sample_id"]: e["label"] for e in entries[1:]} != labels:
            lost.append(f"{where}: killed at {size} bytes with {killed} of the {n} labels in the ledger; after the "
                        f"restart {len(set(e['sample_id'] for e in entries[1:]) & set(labels))} of them, in "
                        f"{len(entries) - 1} entries")
        cut_aside += any(art.glob("labels.jsonl.cut-*"))  # the kill cut the batch: its restart set the cut aside
        shutil.rmtree(art.parent)
    print(f"kills inside the import: {landed}/{trials}, inside its ledger write (a cut tail set aside): {cut_aside}")
    assert not lost, "\n".join(lost)
    assert landed >= 0.75 * trials and cut_aside >= 0.25 * trials, (landed, cut_aside)


# ------------------------------------------------------------------------------------ torn Prefect results
def test_a_torn_prefect_result_file_is_a_cache_miss_not_a_crash(tmp_path, prefect_harness):
    """Prefect writes task results in place (not atomically); a kill mid-write must not break the next run."""
    from prefect import flow
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH

    from flows.stages import result_key, stage_task

    art = tmp_path / "artifacts"

    @stage_task("faulttest", "1")
    def body(artifacts: str, x: int) -> dict:
        return {"x": x}

    @flow
    def f() -> dict:
        return body(artifacts=str(art), x=3)

    assert f() == {"x": 3} and len(executions(art)) == 1
    assert f() == {"x": 3} and len(executions(art)) == 1  # cached
    result = Path(PREFECT_LOCAL_STORAGE_PATH.value()) / result_key("faulttest", "1", {"artifacts": str(art), "x": 3})
    data = result.read_bytes()
    result.write_bytes(data[: len(data) // 2])  # as a SIGKILL in Prefect's write would leave it
    assert f() == {"x": 3} and len(executions(art)) == 2  # the body ran again instead of reading half a result
    assert f() == {"x": 3} and len(executions(art)) == 2


# ---------------------------------------------------------------------------------- whole rounds, SIGKILLed
@pytest.fixture(scope="module")
def api_url(tmp_path_factory):
    with driver.prefect_server(tmp_path_factory.mktemp("prefect-server")) as url:
        yield url


def _completed_keys(artifacts: Path) -> set[str]:
    """Stage cache keys whose result Prefect has persisted (the storage file name is the key)."""
    store = artifacts / "prefect" / "results"
    return {p.name for p in store.iterdir()} if store.is_dir() else set()


def _manifest_times(artifacts: Path) -> dict[Path, int]:
    return {m: m.stat().st_mtime_ns for m in artifacts.rglob(MANIFEST_NAME)}


def _rewritten(before: dict[Path, int], artifacts: Path) -> list[str]:
    """Heavy stage outputs written again (selection and export are cheap, re-done whole and byte-identical)."""
    return sorted(m.relative_to(artifacts).as_posix() for m, t in _manifest_times(artifacts).items()
                  if m in before and before[m] != t and m.relative_to(artifacts).parts[0] != "rounds")


def _stage_folders(artifacts: Path) -> Counter:
    """Stage folders by kind (their names hold digests of paths, which differ between projects)."""
    rels = [m.parent.relative_to(artifacts) for m in verify_all_manifests(artifacts)]
    return Counter(r.as_posix() if r.parts[0] == "rounds" else r.parts[0] for r in rels)


def _contents(artifacts: Path, pattern: str) -> list[bytes]:
    """The files matching a glob, sorted, with the project's own artifacts path taken out; an .npz by its arrays
    (np.savez stamps each member with the time it was written), a .jsonl by its rows less their ledger entry ids."""
    import numpy as np

    def content(p: Path) -> bytes:
        if p.suffix == ".jsonl":  # a ledger entry's id digests its import time, which no two projects share
            rows = [{k: v for k, v in json.loads(line).items() if k != "entry_id"}
                    for line in p.read_text().splitlines() if line.strip()]
            return json.dumps(rows, sort_keys=True).replace(str(artifacts), "<artifacts>").encode()
        if p.suffix == ".npz":
            with np.load(p, allow_pickle=False) as z:
                return repr([(k, z[k].dtype.str, z[k].shape, z[k].tobytes()) for k in sorted(z.files)]).encode()
        return p.read_bytes().replace(str(artifacts).encode(), b"<artifacts>")

    return sorted(content(p) for p in artifacts.glob(pattern) if not any(driver.is_temp_name(s) for s in p.parts))


def _resumed_from(run) -> list[str]:
    return [line.split("resuming training from ", 1)[1] for line in run.log.read_text(errors="replace").splitlines()
            if "resuming training from " in line]


@pytest.mark.slow
def test_round_killed_at_every_stage_resumes_to_the_uninterrupted_result(tmp_path, tiny_models, api_url):
    from pipeline.annotation.ledger import ledger_path
    from pipeline.data.demo import write_digits

    rng = random.Random(SEED)
    model = tmp_path / "model"
    shutil.copytree(tiny_models["idefics3"], model)
    digits = write_digits(tmp_path / "digits", limit=60)
    # Both projects read the same model and data folders, so every digest (adapter included) can match. The round
    # runs every stage that writes: a pixels embeddings stage (selection and the kNN signal), a 2-fold label check
    # and its relabel export; 2 of round 0's 6 answers are wrong, and an oracle stands in for an accurate model in
    # the check (its fold adapters still train and score), which then sends the wrong labels back (the relabel).
    stages = {"select": {"embeddings": {"source": "pixels", "pca_dim": 8}}, "rounds": {"simulate_noise": 0.34},
              "labelcheck": {"kfold": 2, "relabel_top_n": 2, "min_oos_accuracy": 0.5, "min_confidence": 0.4}}
    ref_cfg = driver.write_project(tmp_path / "reference", model_dir=model, digits_dir=digits, **stages)
    cfg = driver.write_project(tmp_path / "faulted", model_dir=model, digits_dir=digits, **stages)
    ref, art = tmp_path / "reference" / "artifacts", tmp_path / "faulted" / "artifacts"
    oracle = digits / "ground_truth.jsonl"

    # Round 1 leaves the inbox alone (no simulated answers), so that running it again below is a re-run.
    for r in (0, 1):
        run = driver.run_round(ref_cfg, api_url=api_url, simulate=None if r == 0 else False, labelcheck_oracle=oracle)
        assert run.state and run.state["round"] == r and not run.error, run.error
    assert run.state["relabel"] >= 1 and not run.state["labelcheck"]["abstained"], run.state  # a relabel export
    assert len(list(ref.glob("embeddings/*/manifest.json"))) == 1
    assert len(list(ref.glob("labelcheck/oos/*/fold-1/oos/manifest.json"))) == 1

    K = driver.Kill
    plan = [  # (round being run, where to kill it)
        # Inside ingest, inside preprocess (its dataset written but not in place) and inside the embeddings stage
        # (embeddings.npy in place, ids.json not, no manifest): a random delay after a stage starts can land after it
        # on a quiet machine (preprocess to the first score shard takes 0.8 s), and the next kill would find no
        # stage left to be killed in.
        (0, K(on_replace="ingest/*/dataset")),
        (0, K(on_replace="prepare/*/dataset")),
        (0, K(on_replace="embeddings/*/ids.json")),  # round 0 scores nothing: a cold start in the pixels space
        (0, K(on_replace="rounds/000/round.json")),  # exported, the round's state not yet written
        (0, None),
        (1, K(on_open="inbox/simulated-round-000.json", nth=2)),  # the importer has read the file once
        (1, K(path="train/*/checkpoints/step-2")),  # between checkpoints
        (1, K(on_replace="train/*/checkpoints/.step-4.*/state.json")),  # during one: half a checkpoint folder
        (1, K(on_replace="train/*/adapter")),  # the adapter written, not yet in place; no manifest
        # Inside the label check: fold 0 trained and scored, fold 1's adapter not yet in place; then its report
        # half written (issues, probabilities and agreement in place, not the verdict nor the manifest).
        (1, K(on_replace="labelcheck/oos/*/fold-1/adapter")),
        (1, K(on_replace="labelcheck/*/verdict.json")),
        (1, K(path="scores/*/manifest.json", delay=driver.random_delay(rng, 0.3))),
        (1, K(on_replace="rounds/001/export/label_studio_tasks.json")),
        (1, K(on_replace="rounds/001/relabel/relabel.jsonl")),  # the relabel tasks written, not its table
        (1, None),
    ]
    runs = []
    for r, kill in plan:
        done_before, outputs_before = _completed_keys(art), _manifest_times(art)
        run = driver.run_round(cfg, api_url=api_url, kill=kill, simulate=None if r == 0 else False,
                               labelcheck_oracle=oracle)
        runs.append(run)
        where = f"run {len(runs) - 1} (round {r}, kill {run.kill}, seed {SEED}); log {run.log}"
        assert not run.error, f"{where} failed:\n{run.error}"
        assert run.killed == (kill is not None), where
        assert not run.temp_reads, f"{where} read leftovers of killed writes: {run.temp_reads}"
        # No stage body re-runs once its result is recorded: a re-run only does the interrupted work.
        redone = [e["stage"] for e in run.executed if e["key"] in done_before]
        assert not redone, f"{where} re-ran finished stages {redone}"
        # A body whose result Prefect never recorded (killed just after its manifest) reuses its verified outputs.
        assert not _rewritten(outputs_before, art), f"{where} rewrote finished outputs {_rewritten(outputs_before, art)}"
        verify_all_manifests(art)  # whenever a manifest exists, its outputs verify, killed or not
        if kill is None:
            assert run.state["round"] == r, where

    # Training resumed from its last whole checkpoint each time, never from the half-written one; so did the label
    # check's fold 1, killed with its adapter written (its checkpoints at steps 2 and 4 whole).
    ck = next(p for p in art.glob("train/*") if p.is_dir()) / "checkpoints"  # beside it: the model file index
    fold_ck = next(art.glob("labelcheck/oos/*/fold-1")) / "checkpoints"
    at = next(i for i, (_, k) in enumerate(plan) if k and ".step-4" in (k.on_replace or ""))  # killed mid-checkpoint
    assert [_resumed_from(run) for run in runs[at:at + 4]] == [[f"{ck / 'step-2'} (step 2 of 6)"]] * 2 + [
        [f"{ck / 'step-4'} (step 4 of 6)"], [f"{fold_ck / 'step-4'} (step 4 of 6)"]]
    assert [s.round for s in completed_rounds(art)] == [0, 1]
    assert not (art / "round.lock").exists()
    assert _stage_folders(art) == _stage_folders(ref)  # the same stage outputs as the uninterrupted run, all whole

    for rel in ("rounds/000/selection/selection.jsonl", "rounds/001/selection/selection.jsonl",
                "rounds/000/export/label_studio_tasks.json", "rounds/001/export/label_studio_tasks.json",
                "rounds/001/relabel/label_studio_tasks.json", "rounds/001/relabel/relabel.jsonl"):
        assert (art / rel).read_bytes() == (ref / rel).read_bytes(), f"{rel} differs from the uninterrupted run's"
    # Stage folders named by digests of paths: compared by content. The report's issues name the inbox file.
    for pattern, n in (("embeddings/*/embeddings.npy", 1), ("embeddings/*/ids.json", 1),
                       ("labelcheck/*/verdict.json", 1), ("labelcheck/*/agreement.json", 1),
                       ("labelcheck/*/issues.jsonl", 1), ("labelcheck/*/oos_probs.npz", 1),
                       ("labelcheck/oos/*/fold-*/oos/*.npz", 2)):
        found = _contents(art, pattern)
        assert len(found) == n and found == _contents(ref, pattern), f"{pattern} differs from the uninterrupted run's"
    assert _contents(art, "labelcheck/*/issues.jsonl") != [b"[]"]  # the check judged: it has issues to compare
    assert [{k: v for k, v in m.items() if k != "time"} for m in read_jsonl(art / "metrics.jsonl")] == [
        {k: v for k, v in m.items() if k != "time"} for m in read_jsonl(ref / "metrics.jsonl")]
    adapter = {p: read_manifest(p.parent).outputs["adapter"].digest for p in (*art.glob("train/*/adapter"),
                                                                             *ref.glob("train/*/adapter"))}
    assert len(set(adapter.values())) == 1, adapter  # exact resume: the same adapter bytes

    def ledger_rows(a):
        return [(e["sample_id"], e["label"], e["kind"], e["source_digest"]) for e in Ledger(ledger_path(a)).entries()]

    assert ledger_rows(art) == ledger_rows(ref) and len(ledger_rows(art)) == 6  # each accepted label once
    # Finished training keeps no checkpoint (the round's adapter nor the label check's folds).
    assert not list(art.glob("train/*/checkpoints")) and not list(art.glob("labelcheck/oos/*/fold-*/checkpoints"))
    leftovers = driver.temp_leftovers(art)
    assert all(driver.is_temp_name(p.name) for p in leftovers)
    assert not set(inbox_files(art / "inbox")) & set(leftovers)

    # A full disk when the finished round re-writes its state: a clear error, the previous state intact.
    state_file = art / "rounds" / "001" / "round.json"
    before = state_file.read_bytes()
    full = driver.run_round(cfg, api_url=api_url, simulate=False, disk_full="rounds/001/.round.json.*.tmp",
                            labelcheck_oracle=oracle)
    assert full.error and "ArtifactError" in full.error and f"{state_file}: disk full" in full.error, full.error
    assert state_file.read_bytes() == before and not full.executed  # nothing redone on the way there
    again = driver.run_round(cfg, api_url=api_url, simulate=False, labelcheck_oracle=oracle)
    assert again.state["round"] == 1 and not again.executed and not again.error

    # Prefect's cache gone (a new PREFECT_HOME): the bodies run, find their verified outputs and redo nothing heavy.
    shutil.rmtree(art / "prefect" / "results")
    outputs_before = _manifest_times(art)
    fresh = driver.run_round(cfg, api_url=api_url, simulate=False, labelcheck_oracle=oracle)
    assert fresh.state["round"] == 1 and not fresh.error and "train" in fresh.stages
    assert "score_shard" not in fresh.stages  # every shard verifies on disk: the scoring subflow is not even started
    assert not _rewritten(outputs_before, art), _rewritten(outputs_before, art)
    assert (art / "rounds/001/selection/selection.jsonl").read_bytes() == (
        ref / "rounds/001/selection/selection.jsonl").read_bytes()
