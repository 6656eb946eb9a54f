"""`tamis listen` resuming a deployed round that waits for its labels, end to end: a real `prefect server` and a
process worker (as tests/test_deployment.py starts them), a real Label Studio 1.23.2 (as
tests/test_label_studio_live.py runs it; under CI=true a server that cannot start fails the test), and `tamis
setup-webhook` then `tamis listen` run as a user runs them.

The deployed run (rounds.wait_for_labels; its config_path relative to the project folder, as prefect.yaml's schedule
gives it, while the listener runs in another folder) pushes round 0's batch to Label Studio and suspends; the batch is
annotated through Label Studio's API, as annotators would; Label Studio's webhook reaches the listener, which resumes
that same run (not a fresh round of its own); the worker runs it: it pulls the annotations into the ledger, trains,
pushes the next batch and completes.
"""

from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_deployment import _stop, _tail, _wait_for, copy_project_code, deploy_run_and_start_worker
from test_deployment import prefect_server as _prefect_server  # noqa: F401 (registers the fixture)
from test_label_studio_live import TOKEN, TOKEN_ENV, ls_site_packages, start_server
from test_label_studio_live import label_studio_sdk as _sdk_fixture  # noqa: F401 (registers the fixture)
from test_round_flow import write_project
from webhook_scenario import LS_ENV, SECRET, SECRET_ENV, Receiver, annotate, free_port, project_tasks

pytestmark = pytest.mark.slow

SHAPES = ("circle", "square", "triangle")
QUESTION = "Which shape is drawn in the image?"


def write_shapes(out: Path, per_shape: int = 8, test_per_shape: int = 2) -> dict:
    """Filled shapes in random colours, sizes and places (PNG), their manifest.jsonl (the test rows answered) and
    ground_truth.jsonl → the config's data section."""
    from PIL import Image, ImageDraw

    from pipeline.schema import sample_id_for
    from pipeline.store import atomic_write_jsonl

    rng = np.random.default_rng(7)
    (out / "images").mkdir(parents=True)
    manifest, truth = [], []
    for shape in SHAPES:
        for i in range(per_shape):
            im = Image.new("RGB", (48, 48), tuple(int(c) for c in rng.integers(0, 90, 3)))
            x, y, r = (int(v) for v in (*rng.integers(14, 34, 2), rng.integers(8, 13)))
            box, fill = [x - r, y - r, x + r, y + r], tuple(int(c) for c in rng.integers(140, 256, 3))
            draw = ImageDraw.Draw(im)
            if shape == "circle":
                draw.ellipse(box, fill=fill)
            elif shape == "square":
                draw.rectangle(box, fill=fill)
            else:
                draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=fill)
            buf = io.BytesIO()
            im.save(buf, format="PNG")
            rel = f"images/{shape}-{i}.png"
            (out / rel).write_bytes(buf.getvalue())
            row = {"image": rel, "question": QUESTION, "split": "test" if i < test_per_shape else "pool"}
            manifest.append({**row, "answer": shape} if i < test_per_shape else row)
            truth.append({"sample_id": sample_id_for(buf.getvalue(), QUESTION), "image": rel, "answer": shape})
    atomic_write_jsonl(out / "manifest.jsonl", manifest)
    atomic_write_jsonl(out / "ground_truth.jsonl", truth)
    return {"sources": [{"kind": "jsonl", "path": str(out / "manifest.jsonl")}], "answers": list(SHAPES),
            "question": QUESTION, "ground_truth": str(out / "ground_truth.jsonl")}


@pytest.fixture(scope="module")
def resume_label_studio(tmp_path_factory):
    """Label Studio serving the project's artifacts folder, delivering webhooks to 127.0.0.1 → (server, project)."""
    project = tmp_path_factory.mktemp("listen-resume") / "project"
    (project / "artifacts").mkdir(parents=True)
    server = start_server(tmp_path_factory.mktemp("ls-resume-server"), project / "artifacts", env=LS_ENV)
    yield server, project
    server.stop()


@pytest.mark.usefixtures("_sdk_fixture")
def test_the_listener_resumes_the_deployed_round_waiting_for_labels_and_its_worker_runs_it(
        resume_label_studio, _prefect_server, tiny_models, tmp_path):  # noqa: F811 (the fixture)
    import yaml
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, LogFilter, LogFilterFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from pipeline.annotation.ledger import Ledger, ledger_path
    from pipeline.round_state import completed_rounds
    from pipeline.store import read_jsonl

    server, project = resume_label_studio
    api, env = _prefect_server
    copy_project_code(project)
    data = write_shapes(project / "data")
    port = free_port()
    config = write_project(project, tiny_models, data=data, select={"batch_size": 4},
                           rounds={"simulate_annotator": False, "wait_for_labels": True, "wait_timeout_s": 3600,
                                   "trigger": {"batch_complete": True, "port": port, "secret_env": SECRET_ENV}})
    cfg = yaml.safe_load(config.read_text())
    cfg["annotate"] = {"label_studio": {"url": server.url, "project": "tamis listen resume", "token_env": TOKEN_ENV}}
    config.write_text(yaml.safe_dump(cfg))
    art = project / "artifacts"
    site = ls_site_packages()  # the SDK, after this environment's own packages (as the label_studio_sdk fixture)
    env = {**env, "PWD": str(project), TOKEN_ENV: TOKEN, SECRET_ENV: SECRET, "COLUMNS": "240",
           "PREFECT_WORKER_QUERY_SECONDS": "2",  # the worker looks for the resumed run every 2 s, not 10
           "PYTHONPATH": os.pathsep.join([str(project), *(p for p in sys.path if p), *([str(site)] if site else [])])}

    worker_log = tmp_path / "worker.log"
    # config_path relative to the project folder, as prefect.yaml's scheduled runs carry it; the listener runs in
    # another folder (tmp_path), as a service does, with the config's full path.
    run_id, worker = deploy_run_and_start_worker(env, project, config.name, worker_log)
    receiver = Receiver(tmp_path, config, env, f"http://127.0.0.1:{port}/health")
    try:
        with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            run = _wait_for(client, run_id, lambda r: r.state.is_paused(), "suspended", worker, worker_log)
            assert run.state.name == "Suspended" and run.name == "round-000"
            [first] = completed_rounds(art)
            pid = first.label_studio["project"]
            batch = project_tasks(server, pid)
            assert len(batch) == first.selected == first.label_studio["pushed"] == 4, first.label_studio

            setup = _cli_tamis(["setup-webhook", "--config", str(config)], env, project)
            assert f"on Label Studio project {pid}" in setup, setup
            receiver.start()

            truth = {t["sample_id"]: t["answer"] for t in read_jsonl(Path(data["ground_truth"]))}
            for t in batch:  # the annotators, through Label Studio's API
                annotate(server, t, truth[t["data"]["sample_id"]])
            annotated = time.time()

            def settled(r) -> bool:  # the run ended, or the listener ran the round itself (the run waits in vain)
                return r.state.is_final() or "round 1 finished" in " ".join(receiver.log().split())

            run = _wait_for(client, run_id, settled, "finished", worker, worker_log, limit=600)
            logs = [lg.message for lg in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))]
            assert run.state.is_completed(), (
                f"run ended {run.state.name}: {run.state.message}\n" + "\n".join(logs[-40:])
                + f"\n--- worker ---\n{_tail(worker_log)}\n--- listener ---\n{receiver.log_tail()}")
            states = sorted(client.read_flow_run_states(run_id), key=lambda s: s.timestamp)
            runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["labeling-round"])))
    finally:
        receiver.kill()
        _stop(worker)

    # The same run went Suspended → (resumed after the annotations) Running → Completed.
    names = [s.name for s in states]
    suspended = names.index("Suspended")
    resumed_at = next(i for i in range(suspended + 1, len(names)) if names[i] == "Running")
    assert states[resumed_at].timestamp.timestamp() > annotated - 1, names
    assert names[-1] == "Completed", names
    # The listener resumed it, saying why; it ran no round of its own (that would be a second flow run).
    listener = " ".join(receiver.log().split())
    assert "resumed round-000, suspended waiting for these labels" in listener, listener[-3000:]
    assert "round 1 finished" not in listener, listener[-3000:]
    # (the deployment's cron schedule keeps its next runs Scheduled: they have not run)
    assert [r.id for r in runs if not r.state.is_scheduled()] == [run.id], [(r.name, r.state.name) for r in runs]
    assert any(m.startswith("resumed: labels in inbox True") and "tamis listen: " in m for m in logs), logs[-40:]
    assert run.name == "round-001" and run.state.message.startswith("round 1: ")
    # The resumed run pulled the annotations into the ledger, trained on them and pushed the next batch.
    ledger = Ledger(ledger_path(art))
    assert ledger.labels() == {t["data"]["sample_id"]: truth[t["data"]["sample_id"]] for t in batch}
    assert {e["round"] for e in ledger.entries()} == {1}
    assert any(m.startswith("trained 2 steps") for m in logs)
    second = completed_rounds(art)[-1]
    assert second.round == 1 and second.labeled == 4 and second.label_studio["pushed"] == 4
    after = project_tasks(server, pid)
    assert sum(t["data"].get("tamis_set") == "001/export" for t in after) == 4 and len(after) == 8
    assert len(read_jsonl(art / "webhooks" / "events.jsonl")) == len(batch)  # one event per annotation


def _cli_tamis(args: list[str], env: dict[str, str], cwd: Path) -> str:
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "flows.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"tamis {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return " ".join(proc.stdout.split())
