"""The memory and time of one walk over a project's sources (issue #23): what every round does at its start
(`round_inputs`, whose sources' digest keys ingest; until 618a17c also at its end).

Each checkout given (this one, and `--against` another, e.g. a worktree of an older commit) walks the sources of
`--config` twice in a fresh process, through the project's file index (a stat per image, nothing read), and reports
the process's peak RSS (VmHWM) and its RSS after each walk, the seconds, and the sources' digest (equal digests: the
same key). Use a project whose file index is already built (a first round ran), e.g. the 10⁶-image pool that
`pool_scale.py --part flow --flow-pools 1000000` leaves in its --work-dir.

    python benchmarks/walk_memory.py --config /tmp/tamis-pool-scale/flow/pool-1000000/tamis.yaml \\
        --against /path/to/older-worktree --json-out benchmarks/results/walk_memory.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import write_result  # noqa: E402

_CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
def mem():
    status = Path("/proc/self/status").read_text().splitlines()
    return {k: int(l.split()[1]) // 1024 for l in status for k in ("VmHWM", "VmRSS") if l.startswith(k + ":")}
from pipeline.config import load_config
from pipeline.data.ingest import source_digest
cfg = load_config(sys.argv[2])
out = {"start": mem(), "walks": []}
for _ in range(2):
    t = time.perf_counter()
    key = source_digest(cfg.data, cfg.artifacts)
    out["walks"].append({"s": round(time.perf_counter() - t, 1), **mem(), "sources_digest": key})
print(json.dumps(out))
"""


def _commit(root: Path) -> str | None:
    proc = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return proc.stdout.strip() or None


def walk(root: Path, config: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(root), str(config)], capture_output=True, text=True,
                          check=False)
    if proc.returncode:
        raise SystemExit(f"walk_memory: the walk in {root} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"commit": _commit(root), "peak_rss_mb": out["walks"][-1]["VmHWM"], **out}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, required=True, help="a project whose file index is built")
    ap.add_argument("--against", type=Path, default=None, help="another checkout to walk the same sources with")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)
    started = time.time()
    result: dict[str, Any] = {"config": str(args.config), "this": walk(ROOT, args.config)}
    if args.against is not None:
        result["against"] = walk(args.against.resolve(), args.config)
        a, b = result["this"], result["against"]
        result["same_key"] = a["walks"][0]["sources_digest"] == b["walks"][0]["sources_digest"]
        result["peak_rss_mb_saved"] = b["peak_rss_mb"] - a["peak_rss_mb"]
        result["walk_s"] = {"this": a["walks"][0]["s"], "against": b["walks"][0]["s"]}
    return write_result(result, args.json_out, started=started, reused_s=0.0,
                        config={"config": str(args.config), "against": result.get("against", {}).get("commit")})


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
