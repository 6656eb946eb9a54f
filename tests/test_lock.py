import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.errors import LockError
from pipeline.lock import ProjectLock, boot_id

ROOT = Path(__file__).resolve().parents[1]


def test_second_holder_refused_with_clear_message(tmp_path):
    path = tmp_path / "round.lock"
    with ProjectLock(path):
        with pytest.raises(LockError, match="Another labeling round is running"):
            ProjectLock(path).acquire()
    assert not path.exists()
    with ProjectLock(path):  # free again after release
        assert path.exists()


def test_stale_lock_of_dead_process_is_taken_over(tmp_path):
    path = tmp_path / "round.lock"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path.write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(), "since": 0}))
    with ProjectLock(path) as lock:
        assert lock._held


# --------------------------------------------------------------------------------- the kernel keeps the lock
def _holder_process(code: str, *args) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == b"ready", proc.stderr.read().decode()
    return proc


FLOCK_ONLY = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)  # a holder between taking the lock and writing its name: the file is empty
print("ready", flush=True)
time.sleep(60)
"""

HOLDER = """
import sys, time
from pipeline.lock import ProjectLock
lock = ProjectLock(sys.argv[1]).acquire()
print("ready", flush=True)
time.sleep(60)
"""


def test_an_empty_lock_file_is_not_free_while_its_holder_lives(tmp_path):
    """The issue's race: a second round arriving between the first's create and its write got the lock too."""
    path = tmp_path / "round.lock"
    proc = _holder_process(FLOCK_ONLY, path)
    try:
        assert path.read_bytes() == b""
        with pytest.raises(LockError, match="has not written its details yet"):
            ProjectLock(path).acquire()
        assert path.exists()  # not "taken over" (unlinked) either
    finally:
        proc.kill()
        proc.wait()
    with ProjectLock(path) as lock:  # its holder gone, the lock is free
        assert lock._held and json.loads(path.read_text())["pid"] == os.getpid()


def test_a_sigkilled_holder_releases_the_lock_and_its_details_name_it(tmp_path):
    path = tmp_path / "round.lock"
    proc = _holder_process(HOLDER, path)
    try:
        with pytest.raises(LockError) as exc:
            ProjectLock(path).acquire()
        assert f"pid {proc.pid} on {socket.gethostname()}" in str(exc.value)
        assert "Another labeling round is running" in str(exc.value) and str(path) in str(exc.value)
        assert json.loads(path.read_text())["boot_id"] == boot_id() != ""
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert path.exists()  # the dead holder's file is still there: it does not matter
    with ProjectLock(path) as lock:
        assert lock._held


def test_a_reused_pid_does_not_block_the_project(tmp_path):
    """A container restarted as PID 1: the old lock file names a pid that is alive again, but nobody holds it."""
    path = tmp_path / "round.lock"
    path.write_text(json.dumps({"pid": 1, "host": socket.gethostname(), "boot_id": boot_id(), "since": 0}))
    with ProjectLock(path) as lock:
        assert lock._held


RACER = """
import os, sys, time
from pipeline.errors import LockError
from pipeline.lock import ProjectLock
path, log, until = sys.argv[1], sys.argv[2], float(sys.argv[3])
fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
print("ready", flush=True)
got = 0
while time.time() < until:
    try:
        lock = ProjectLock(path).acquire()
    except LockError:
        continue
    os.write(fd, f"+{os.getpid()}\\n".encode())
    time.sleep(0.002)
    os.write(fd, f"-{os.getpid()}\\n".encode())
    lock.release()
    got += 1
print(got, flush=True)
"""


def test_racing_processes_never_hold_the_lock_together(tmp_path):
    path, log = tmp_path / "round.lock", tmp_path / "holders.log"
    until = time.time() + 3
    procs = [_holder_process(RACER, path, log, until) for _ in range(4)]
    counts = [int(p.communicate(timeout=60)[0].split()[-1]) for p in procs]
    lines = log.read_text().split()
    # Every entry is followed by the same process's exit: never two holders at once.
    assert all(a[0] == "+" and b == "-" + a[1:] for a, b in zip(lines[::2], lines[1::2], strict=True)), lines[:20]
    assert len(lines) == 2 * sum(counts) and sum(c > 0 for c in counts) >= 2, counts
    assert not path.exists()

