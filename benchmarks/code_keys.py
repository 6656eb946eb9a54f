"""What code-aware stage versions cost a tamis process: every stage's code digest, cold (empty parse cache) and warm.

Each measurement is a fresh Python process (the per-process state would hide the cost) that computes the code digest
of every stage module the round's tasks name (flows.stages.STAGES), the work importing the stage modules now does.

    python benchmarks/code_keys.py --repeat 5 --json-out benchmarks/results/code_keys.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import write_result  # noqa: E402

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from pipeline import codeversion as cv
t1 = time.perf_counter()
digests = [cv.code_digest(m) for m in json.loads(sys.argv[1])]
t2 = time.perf_counter()
print(json.dumps({"import_ms": 1000 * (t1 - t0), "digests_ms": 1000 * (t2 - t1), "digests": digests}))
"""


def stage_modules() -> list[str]:
    import flows.round  # noqa: F401 - defines every stage task
    from flows.stages import STAGES
    from pipeline.codeversion import version_module

    return sorted({version_module(v) for v in STAGES.values()})


def measure(modules: list[str], cache: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TAMIS_CODE_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(modules)], env=env, cwd=cache.parent,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    started = time.time()
    modules = stage_modules()
    cold, warm = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            cache = Path(tmp) / f"cache-{i}.json"
            first = measure(modules, cache)  # empty cache: every file parsed
            again = measure(modules, cache)  # the cache the first process wrote
            assert first["digests"] == again["digests"], "a warm process derived other digests"
            cold.append(first["digests_ms"])
            warm.append(again["digests_ms"])
    files = sum(1 for _ in (ROOT / "pipeline").rglob("*.py"))
    result = {
        "benchmark": "code_keys",
        "what": "code digests of every stage module in a fresh process (ms, median of --repeat runs)",
        "stage_modules": len(modules), "pipeline_files": files, "repeat": args.repeat,
        "cold_ms": round(statistics.median(cold), 1), "warm_ms": round(statistics.median(warm), 1),
        "warm_ms_all": [round(x, 1) for x in warm], "cold_ms_all": [round(x, 1) for x in cold],
    }
    write_result(result, args.json_out, config={"repeat": args.repeat}, started=started)


if __name__ == "__main__":
    main()
