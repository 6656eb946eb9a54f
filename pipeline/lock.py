"""A project lock so that two labeling rounds never write the same artifacts at once."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from types import TracebackType

from pipeline.errors import LockError

log = logging.getLogger(__name__)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ProjectLock:
    """Exclusive lock file created with O_EXCL. A lock left by a dead process on this host is taken over."""

    def __init__(self, path: str | os.PathLike[str], *, purpose: str = "labeling round"):
        self.path = Path(path)
        self.purpose = purpose
        self._held = False

    def _holder(self) -> dict:
        try:
            return json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    def acquire(self) -> ProjectLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "purpose": self.purpose}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._holder()
                stale = holder.get("host") == me["host"] and isinstance(holder.get("pid"), int) and not _alive(holder["pid"])
                if stale or not holder:
                    log.warning("Taking over a stale lock %s left by %s", self.path, holder or "an unreadable file")
                    self.path.unlink(missing_ok=True)
                    continue
                since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
                raise LockError(
                    f"Another {holder.get('purpose', 'round')} is running for this project (pid {holder.get('pid')} on "
                    f"{holder.get('host')}, since {since}); wait for it to finish. If it died on another host, "
                    f"delete {self.path}."
                ) from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
                f.flush()
                os.fsync(f.fileno())
            self._held = True
            return self
        raise LockError(f"Could not take the lock {self.path}; delete it if no round is running")

    def release(self) -> None:
        if self._held:
            self.path.unlink(missing_ok=True)
            self._held = False

    def __enter__(self) -> ProjectLock:
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()
