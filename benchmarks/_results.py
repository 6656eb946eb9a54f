"""Where a benchmark's figures came from: every results JSON says its commit, tree, config, machine and time.

A figure without its commit cannot be checked against the code that made it, and a benchmark assembled from a
content cache can mix outputs of several code versions: `write_result` records both, so a reader can tell.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.store import atomic_write_json, digest_json  # noqa: E402


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def machine() -> dict[str, Any]:
    """The machine as a reader needs it to compare timings: cores, load when the run ended, platform."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cores": os.cpu_count(), "load_1m": load and round(load[0], 2), "platform": platform.platform(),
            "python": platform.python_version()}


def provenance(*, config: Any = None, started: float | None = None, reused_s: float | None = None,
               code_versions: list[str] | None = None) -> dict[str, Any]:
    """The keys every results JSON carries.

    `config`: what the benchmark ran with (its digest is recorded); `started`: `time.time()` at its start (wall time
    spent); `reused_s`: seconds of earlier work taken from a cache instead of recomputed; `code_versions`: the
    commits recorded by the cache entries it reused, so a result built from several code versions says so.
    """
    status = _git("status", "--porcelain", "--untracked-files=no")
    versions = sorted(set(code_versions or []))
    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "config_digest": None if config is None else digest_json(config),
        "machine": machine(),
        "wall_s": None if started is None else round(time.time() - started, 1),
        "reused_s": reused_s,
        "mixed_code_versions": len(versions) > 1,
        **({"code_versions": versions} if versions else {}),
    }


def write_result(result: dict[str, Any], json_out: str | os.PathLike[str] | None, **provenance_kwargs: Any) -> dict[str, Any]:
    """Add the provenance keys, print the JSON and write it atomically to `json_out` (when given)."""
    result = json.loads(json.dumps({**result, **provenance(**provenance_kwargs)}, default=str))
    print(json.dumps(result, indent=2))
    if json_out:
        atomic_write_json(json_out, result)
    return result
