import json
import subprocess
import sys

import pytest

from pipeline.errors import LockError
from pipeline.lock import ProjectLock


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
    import socket

    path.write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(), "since": 0}))
    with ProjectLock(path) as lock:
        assert lock._held
