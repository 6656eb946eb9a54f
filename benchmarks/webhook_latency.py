"""Webhook latency (issue #38): the time from the last annotation of a batch in Label Studio to the next batch there.

    python benchmarks/webhook_latency.py --json-out benchmarks/results/webhook_latency.json

Runs tests/webhook_scenario.py's round trip --repeats times (3), each in a new project on one server: the pinned Label Studio (1.23.2, its own venv, as the live tests
start it, SSRF protection off for this server only), a digits project with the tiny 4-bit Idefics3 model whose round 0
batch of 6 is in the project, `tamis setup-webhook`, `tamis listen` in its own process (SIGKILLed and restarted half
way), annotations posted through the API. Records:
- `next_batch_s`: last annotation POST sent → the next round's 6 tasks listed by Label Studio's API (the webhook
  delivery, the trigger decision, the whole round in the listener's process: pull, import, retrain, label check,
  score, select, export, push);
- `annotation_post_s`: that last POST's own round trip (Label Studio delivers its webhooks synchronously inside it
  without Redis, so this bounds the receiver's answer: durable append included);
- the round's stage seconds are not split out: the round is the one `tamis round` runs (see benchmarks/resume.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the live tests' Label Studio server and the scenario
from benchmarks._results import write_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--repeats", type=int, default=3, help="round trips, each in a new project on the same server")
    args = ap.parse_args()
    started = time.time()

    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness
    from test_label_studio_live import LS_VERSION, TOKEN, TOKEN_ENV, ls_site_packages, start_server
    from webhook_scenario import LS_ENV, NEXT_BATCH_WITHIN_S, round_trip

    from pipeline.model.tiny import make_tiny_model

    runs = []
    with tempfile.TemporaryDirectory(prefix="tamis-webhook-bench-") as tmp:
        tmp = Path(tmp)
        models = {"idefics3": make_tiny_model("idefics3", tmp / "tiny" / "idefics3")}
        site = ls_site_packages()
        if site is not None:
            sys.path.append(str(site))  # label-studio-sdk from Label Studio's own venv, after this one's packages
        (tmp / "projects").mkdir()
        server = start_server(tmp / "ls", tmp / "projects", env=LS_ENV)  # the projects' common document root
        try:
            with prefect_test_harness(server_startup_timeout=180):
                for i in range(args.repeats):
                    root = tmp / "projects" / f"p{i}"
                    out = round_trip(server, root, models, token=TOKEN, token_env=TOKEN_ENV,
                                     prefect_api=PREFECT_API_URL.value(), extra_path=[p for p in sys.path if p],
                                     title=f"tamis webhook bench {i}", document_root=tmp / "projects")
                    runs.append({"next_batch_s": round(out["next_batch_s"], 1),
                                 "annotation_post_s": round(out["ack_s"], 3),
                                 "next_batch_tasks": out["rounds"][-1]["selected"],
                                 "rounds_started_by_webhooks": out["log"].count("starting the next round")})
        finally:
            server.stop()
    result = {
        "benchmark": "webhook_latency",
        "label_studio": LS_VERSION,
        "batch": out["batch"],
        "runs": runs,
        "next_batch_s_median": statistics.median(r["next_batch_s"] for r in runs),
        "annotation_post_s_median": statistics.median(r["annotation_post_s"] for r in runs),
        "bound_s": NEXT_BATCH_WITHIN_S,
        "receiver_restarts_per_run": 1,
        "model": "tiny random-weight Idefics3, 4-bit NF4 + LoRA, CPU fp32 (train.max_steps 2, labelcheck kfold 3)",
    }
    write_result(result, args.json_out, started=started)


if __name__ == "__main__":
    main()
