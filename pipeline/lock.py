"""A project lock so that two labeling rounds never write the same artifacts at once.

The kernel keeps it: `fcntl.flock` on the open lock file, released when the holder closes it or dies, however it dies
(SIGKILL, OOM, a container stopped). Nothing is guessed from the file's content: an empty file (a holder between its
open and its write), a dead holder's pid, a pid reused after a restart (a container's PID 1) decide nothing. The file
only names the holder (host, pid, boot id, since when, what for) for the message of the one who has to wait.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from pipeline.errors import LockError

log = logging.getLogger(__name__)


def boot_id() -> str:
    """This machine's boot id (Linux): with the host, it tells a holder that predates a reboot from a live one."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ProjectLock:
    """An exclusive flock on `path`; the file is removed on release."""

    def __init__(self, path: str | os.PathLike[str], *, purpose: str = "labeling round"):
        self.path = Path(path)
        self.purpose = purpose
        self._fd: int | None = None

    @property
    def _held(self) -> bool:
        return self._fd is not None

    def _holder(self) -> dict[str, Any]:
        try:
            holder = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return holder if isinstance(holder, dict) else {}

    def _refusal(self) -> LockError:
        holder = self._holder()
        me_host, me_boot = socket.gethostname(), boot_id()
        pid = holder.get("pid")
        if not holder or (holder.get("host") == me_host and holder.get("boot_id") == me_boot
                          and isinstance(pid, int) and not _alive(pid)):
            # The file names nobody, or a process gone: the live holder took the lock and has not written its name.
            who = "a process that has not written its details yet"
        else:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
            boot = "" if holder.get("boot_id") in (None, "", me_boot) else f", boot {holder['boot_id'][:8]}"
            who = f"pid {pid} on {holder.get('host')}{boot}, since {since}"
        return LockError(
            f"Another {holder.get('purpose', 'round') if holder else 'round'} is running for this project ({who}; "
            f"lock {self.path}); wait for it to finish. The lock is released when that process ends, however it "
            "ends: there is nothing to delete."
        )

    def acquire(self) -> ProjectLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._refusal() from None
            except BaseException:
                os.close(fd)
                raise
            # A releasing holder unlinks the file before it closes: the inode we locked may no longer be the path's,
            # and a third process may be locking the new file. Only the lock on the path's current inode counts.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "boot_id": boot_id(), "since": time.time(),
              "purpose": self.purpose}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        with contextlib.suppress(OSError):
            os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            # Unlink while still holding it (see acquire), then let the kernel drop the lock.
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ProjectLock:
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()
