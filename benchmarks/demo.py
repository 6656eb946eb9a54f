"""The demo as the README quotes it: `tamis demo` in a fresh project folder, its rounds as round.json records them.

The README's demo figures come from this JSON, so they always name the commit that printed them.

    python benchmarks/demo.py --json-out benchmarks/results/demo.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._results import write_result  # noqa: E402

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DO_NOT_TRACK": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "NO_ALBUMENTATIONS_UPDATE": "1", "TOKENIZERS_PARALLELISM": "false"}
KEYS = ("round", "labeled", "metrics", "strategy", "selected", "stopped")


def run_demo(project: Path) -> tuple[list[dict], float]:
    """`tamis demo` with the embedded config in `project` (its relative paths land there); the rounds it wrote."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(OFFLINE, PYTHONPATH=str(ROOT), COLUMNS="200")
    t0 = time.monotonic()
    code = "import sys; from flows.cli import run; sys.argv = ['tamis', 'demo']; run()"
    done = subprocess.run([sys.executable, "-c", code], cwd=project, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"tamis demo failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    rounds = sorted((project / "artifacts" / "rounds").glob("[0-9][0-9][0-9]/round.json"))
    states = [json.loads(p.read_text()) for p in rounds]
    return [{k: s.get(k) for k in KEYS} for s in states], time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="tamis-demo-") as tmp:
        rounds, wall = run_demo(Path(tmp))
    accuracy = [r["metrics"]["accuracy"] for r in rounds if r.get("metrics")]
    write_result({"rounds": rounds, "accuracy": accuracy, "labels": [r["labeled"] for r in rounds if r.get("metrics")],
                  "demo_wall_s": round(wall, 1), "config": "configs/demo.yaml (embedded default)"},
                 args.json_out, config=(ROOT / "configs" / "demo.yaml").read_text(), started=started, reused_s=0)


if __name__ == "__main__":
    main()
