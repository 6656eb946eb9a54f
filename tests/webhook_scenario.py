"""The webhook round trip against a real Label Studio, shared by tests/test_webhooks_live.py (which asserts on what
it returns) and benchmarks/webhook_latency.py (which records its times).

A project pushes round 0's batch; `tamis setup-webhook` registers the webhook; `tamis listen` runs as a user runs it
(its own process); annotations are posted through Label Studio's API for the whole batch, with a correction, stale
and duplicate deliveries replayed, and the receiver SIGKILLed and restarted in the middle; the next round must start
by itself, import exactly those labels and push the next batch to the same project.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from pipeline.store import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
SECRET = "tamis-webhook-live-secret-0123456789"
SECRET_ENV = "TAMIS_TEST_WEBHOOK_SECRET"
# Label Studio refuses webhooks to local addresses by default (core/utils/io.py: SSRF_PROTECTION_ENABLED = True);
# the test server, and only it, delivers to the receiver on 127.0.0.1.
LS_ENV = {"SSRF_PROTECTION_ENABLED": "false"}
NEXT_BATCH_WITHIN_S = 600  # the stated bound: last annotation → next batch in Label Studio, on this 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def project_tasks(server: Any, pid: int) -> list[dict]:
    tasks = server.api("GET", f"/api/tasks?project={pid}&page_size=1000&fields=all")
    return sorted(tasks["tasks"] if isinstance(tasks, dict) else tasks, key=lambda t: t["id"])


def annotate(server: Any, task: dict, choice: str) -> dict:
    return server.api("POST", f"/api/tasks/{task['id']}/annotations/", {"result": [
        {"from_name": "answer", "to_name": "image", "type": "choices", "value": {"choices": [choice]}}],
        "was_cancelled": False, "lead_time": 4.0})


def _deliver(url: str, body: dict, secret: str | None) -> int:
    headers = {"Content-Type": "application/json", **({"X-Tamis-Secret": secret} if secret else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


class Receiver:
    """`tamis listen` in its own process, as a user starts it."""

    def __init__(self, root: Path, config: Path, env: dict[str, str], health: str):
        self.root, self.config, self.env, self.health = root, config, env, health
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 180) -> None:
        self.starts += 1
        log = (self.root / f"listen-{self.starts}.log").open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "listen", "--config", str(self.config)],
                                     cwd=self.root, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_tail()
            try:
                with urllib.request.urlopen(self.health, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"tamis listen did not answer within {timeout:.0f} s: {self.log_tail()}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(60)

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.root.glob("listen-*.log")))

    def log_tail(self) -> str:
        return self.log()[-6000:]


def _wait(what: str, check: Any, timeout: float, receiver: Receiver, every: float = 0.25) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if check():
            return time.monotonic() - t0
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:.0f} s\n{receiver.log_tail()}")


def write_webhook_project(root: Path, tiny_models: Any, server_url: str, token_env: str, port: int,
                          title: str = "tamis webhook test", document_root: Path | None = None) -> Path:
    from test_round_flow import write_project

    config = write_project(root, tiny_models)
    data = yaml.safe_load(config.read_text())
    data["rounds"].update(simulate_annotator=False, trigger={"batch_complete": True, "port": port,
                                                             "secret_env": SECRET_ENV})
    data["annotate"] = {"label_studio": {"url": server_url, "project": title, "token_env": token_env},
                        **({"document_root": str(document_root)} if document_root else {})}
    config.write_text(yaml.safe_dump(data))
    return config


def _round0_and_webhook(server: Any, root: Path, tiny_models: Any, token: str, token_env: str,
                        env: dict[str, str], title: str, document_root: Path | None) -> dict[str, Any]:
    """Round 0 pushes its batch; `tamis setup-webhook` registers the webhook as a user runs it."""
    from flows.round import labeling_round
    from pipeline.config import load_config

    config = write_webhook_project(root, tiny_models, server.url, token_env, free_port(), title,
                                   document_root)
    os.environ[token_env] = token
    first = labeling_round(str(config))
    pid = first["label_studio"]["project"]
    batch = project_tasks(server, pid)
    assert len(batch) == first["selected"] == first["label_studio"]["pushed"], first
    setup = subprocess.run([sys.executable, "-m", "flows.cli", "setup-webhook", "--config", str(config)], cwd=root,
                           env=env, capture_output=True, text=True, timeout=300)
    assert setup.returncode == 0, setup.stderr[-3000:]
    return {"config": config, "cfg": load_config(config), "first": first, "project": pid, "batch_tasks": batch,
            "hooks": server.api("GET", f"/api/webhooks/?project={pid}"), "setup": setup.stdout}


def _first_half_restart_correction(server: Any, scene: dict[str, Any], receiver: Receiver, url: str,
                                   events: Any) -> dict[str, str]:
    """Half the batch annotated; the receiver SIGKILLed and restarted; one annotation corrected in Label Studio;
    Label Studio's first (now stale) body for it replayed twice. Returns the labels so far (sample → answer)."""
    batch, truth, half = scene["batch_tasks"], {}, len(scene["batch_tasks"]) // 2
    for i, t in enumerate(batch[:half]):
        annotate(server, t, truth.setdefault(t["data"]["sample_id"], str(i)))
    _wait("the first half's events", lambda: events() == half, 30, receiver)
    ann = server.api("GET", f"/api/tasks/{batch[0]['id']}/annotations/")[0]
    stale = {"action": "ANNOTATION_CREATED", "annotation": ann, "task": batch[0], "project": {"id": scene["project"]}}

    receiver.kill()  # SIGKILL in the middle; a restart must lose nothing and count nothing twice
    receiver.start()
    server.api("PATCH", f"/api/annotations/{ann['id']}/", {"result": [
        {"from_name": "answer", "to_name": "image", "type": "choices", "value": {"choices": ["9"]}}]})
    truth[batch[0]["data"]["sample_id"]] = "9"  # corrected in Label Studio before the batch was done
    _wait("the correction's event", lambda: events() == half + 1, 30, receiver)
    scene["replays"] = [_deliver(url, stale, SECRET) for _ in range(2)]  # out of order and duplicated
    scene["events_before_last"] = events()
    return truth


def round_trip(server: Any, root: Path, tiny_models: Any, *, token: str, token_env: str, prefect_api: str,
               extra_path: list[str], title: str = "tamis webhook test", document_root: Path | None = None
               ) -> dict[str, Any]:
    """Run the scenario in a new Label Studio project `title` (`document_root`: the server's, when it is not the
    project's artifacts folder); returns what the test checks and the benchmark records."""
    from pipeline.round_state import completed_rounds

    env = {**os.environ, token_env: token, SECRET_ENV: SECRET, "PREFECT_API_URL": prefect_api,
           "PYTHONPATH": os.pathsep.join([str(ROOT), *extra_path]), "COLUMNS": "240"}
    out = _round0_and_webhook(server, root, tiny_models, token, token_env, env, title, document_root)
    cfg, pid, batch = out["cfg"], out["project"], out["batch_tasks"]
    out.update(batch=len(batch), url=(url := cfg.rounds.trigger.url))
    receiver = Receiver(root, out["config"], env, url.replace("/label-studio", "/health"))
    receiver.start()
    try:
        out["refused"] = [_deliver(url, {"action": "ANNOTATION_CREATED"}, None),
                          _deliver(url, {"action": "ANNOTATION_CREATED"}, "wrong-" + SECRET)]
        queue = cfg.artifacts / "webhooks" / "events.jsonl"
        truth = _first_half_restart_correction(
            server, out, receiver, url, lambda: len(read_jsonl(queue)))  # committed events (the log frames batches)
        for i, t in enumerate(batch[len(batch) // 2:-1], start=len(batch) // 2):
            annotate(server, t, truth.setdefault(t["data"]["sample_id"], str(i)))
        t_last = time.monotonic()
        annotate(server, batch[-1], truth.setdefault(batch[-1]["data"]["sample_id"], "7"))
        out["ack_s"] = time.monotonic() - t_last  # the annotation POST includes Label Studio's synchronous delivery

        def next_batch() -> bool:
            new = sum(t["data"].get("tamis_set") == "001/export" for t in project_tasks(server, pid))
            return new == out["first"]["selected"]

        waited = _wait("the next batch in Label Studio", next_batch, NEXT_BATCH_WITHIN_S, receiver, every=0.5)
        out["next_batch_s"] = out["ack_s"] + waited
        _wait("round 1's state", lambda: len(completed_rounds(cfg.artifacts)) == 2, 120, receiver)
        time.sleep(3)  # had the trigger fired twice, a second round would start now
        out.update(rounds=completed_rounds(cfg.artifacts), truth=truth,
                   log=" ".join(receiver.log().split()))  # log lines as one line each, however wrapped
    finally:
        receiver.kill(signal.SIGTERM)  # as a service manager stops it (a background runner has SIGINT ignored)
    return out
