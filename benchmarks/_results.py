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

from pipeline.store import MANIFEST_NAME as MANIFEST  # noqa: E402
from pipeline.store import atomic_write_json, digest_json  # noqa: E402


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


# What benchmarks write into the checkout: their own results, not code. A benchmark that writes its PNG before its
# JSON (label_efficiency.py) would otherwise find the tree it ran from "moved" by its own output.
_OUTPUTS = "benchmarks/results"


def _checkout() -> tuple[str | None, str | None]:
    """(HEAD, `git status` of tracked files other than the benchmarks' results) now."""
    return _git("rev-parse", "HEAD"), _git("status", "--porcelain", "--untracked-files=no", "--", ".",
                                           f":(exclude){_OUTPUTS}")


# The checkout as the benchmark found it when it started (benchmarks import this module first): a long run during
# which someone commits must record the code it ran, not the HEAD it ended at.
_AT_START = _checkout()


def code_version() -> str:
    """The commit this code runs at, "+dirty" when tracked files differ from it ("unknown" outside a git checkout):
    what a benchmark records beside each cache entry it makes, so a result read from a cache can say which code
    versions it mixes. The checkout as the benchmark started (a commit made while it runs is not the code it runs)."""
    commit, status = _AT_START
    if not commit:
        return "unknown"
    return commit[:12] + ("+dirty" if status else "")


def cpu_seconds(who: int | None = None) -> float:
    """CPU seconds (user + system) of this process and the children it waited on; `who`: resource.RUSAGE_CHILDREN
    alone. On a machine shared with other work, wall time moves with the load and this much less."""
    import resource

    kinds = (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) if who is None else (who,)
    return round(sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, kinds)), 2)


def peak_rss_mb() -> float:
    """This process's peak resident set (MB) since it started: VmHWM, the high-water mark of its own address space.
    Not ru_maxrss: Linux carries that across fork and exec, so a child started by a benchmark that had held 4.4 GB
    reported 4.4 GB whatever it used itself (the 100k rounds of the first pool_scale.py --part all,flow run)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB on Linux


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
    commit, status = _AT_START
    now, status_now = _checkout()
    versions = sorted(set(code_versions or []))
    return {
        "commit": commit,
        "dirty": None if status is None else bool(status),
        # The checkout moved while it ran (a commit, or tracked files edited): the code it ran is the start's only if
        # those changes left it alone; the reader can compare.
        **({"checkout_moved": {"head": now, "dirty": bool(status_now)}} if (now, status_now) != (commit, status) else {}),
        "config_digest": None if config is None else digest_json(config),
        "machine": machine(),
        "wall_s": None if started is None else round(time.time() - started, 1),
        "reused_s": reused_s,
        "mixed_code_versions": len(versions) > 1,
        **({"code_versions": versions} if versions else {}),
    }


def _read_json(path: Path) -> dict[str, Any]:
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


class CacheFolder:
    """What a benchmark took from a folder of cached stage outputs (library manifests) instead of computing it, and
    which code versions made those outputs.

    Open it before the work (it notes the manifests already there), call `finish()` after: a manifest that was
    there and was not rewritten counts as reused, with the seconds its manifest recorded when it has them; every
    manifest written by this run gets a record of this code version (in `.made_by/`, beside the outputs, never
    inside them), which a later run reads back. Outputs from before these records read "unrecorded".
    """

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self.before = self._scan()

    def _scan(self) -> dict[Path, int]:
        if not self.root.is_dir():
            return {}
        return {m.parent: m.stat().st_mtime_ns for m in self.root.rglob(MANIFEST)
                if ".made_by" not in m.parts}

    def _record(self, folder: Path) -> Path:
        return self.root / ".made_by" / f"{digest_json(str(folder.relative_to(self.root)))[:16]}.json"

    def finish(self) -> dict[str, Any]:
        """{"reused_s", "code_versions", "reused", "computed"}: the keywords of `provenance` plus the counts."""
        after = self._scan()
        version = code_version()
        reused_s, versions, reused = 0.0, [], 0
        for folder, mtime in after.items():
            if self.before.get(folder) != mtime:
                atomic_write_json(self._record(folder), {"code_version": version, "folder": str(folder.name)})
                versions.append(version)
                continue
            reused += 1
            info = _read_json(folder / MANIFEST).get("info")
            seconds = info.get("seconds") if isinstance(info, dict) else None
            reused_s += float(seconds) if isinstance(seconds, (int, float)) else 0.0
            versions.append(_read_json(self._record(folder)).get("code_version") or "unrecorded")
        return {"reused_s": round(reused_s, 1), "code_versions": versions, "reused": reused,
                "computed": len(after) - reused}


def write_result(result: dict[str, Any], json_out: str | os.PathLike[str] | None, *, cache: CacheFolder | None = None,
                 **provenance_kwargs: Any) -> dict[str, Any]:
    """Add the provenance keys, print the JSON and write it atomically to `json_out` (when given). A `machine` dict
    the benchmark recorded itself (threads, load at the start) is kept, with the provenance's keys added to it.
    With `cache` (opened before the work), what the run reused from that folder goes into `reused_s` and the code
    versions, and its counts into `cache_entries`."""
    if cache is not None:
        c = cache.finish()
        result = {**result, "cache_entries": {"reused": c["reused"], "computed": c["computed"]}}
        provenance_kwargs["reused_s"] = round((provenance_kwargs.get("reused_s") or 0.0) + c["reused_s"], 1)
        provenance_kwargs["code_versions"] = [*(provenance_kwargs.get("code_versions") or []), *c["code_versions"]]
    prov = provenance(**provenance_kwargs)
    if isinstance(result.get("machine"), dict):
        prov["machine"] = {**result["machine"], **prov["machine"]}
    result = json.loads(json.dumps({**result, **prov}, default=str))
    print(json.dumps(result, indent=2))
    if json_out:
        atomic_write_json(json_out, result)
    return result
