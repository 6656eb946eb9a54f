"""Scheduled rounds: prefect.yaml, `tamis serve`, and a real `prefect server` → deploy → process worker → run."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli.main import app
from pipeline.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PREFECT = str(BIN / "prefect")
runner = CliRunner()


# ------------------------------------------------------------------------------------------------- fast checks
def test_prefect_yaml_deploys_the_round_flow_offline_on_the_demo_schedule():
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    demo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    assert not spec.get("build") and not spec.get("push")  # nothing that needs a registry or the network
    (dep,) = spec["deployments"]
    assert dep["name"] == "scheduled" and dep["work_pool"]["name"] == "tamis"
    path, func = dep["entrypoint"].split(":")
    assert (ROOT / path).is_file() and f"def {func}(" in (ROOT / path).read_text()
    assert (ROOT / dep["parameters"]["config_path"]).is_file()
    from pipeline.config import RoundsConfig

    assert [s["cron"] for s in dep["schedules"]] == [demo.get("rounds", {}).get("cron", RoundsConfig().cron)]
    assert spec["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $TAMIS_PROJECT_DIR }}"}}]
    assert dep["work_pool"]["job_variables"]["env"]["TAMIS_PROJECT_DIR"] == "{{ $PWD }}"


def test_serve_refuses_a_bad_cron_naming_where_it_came_from(tmp_path):
    res = runner.invoke(app, ["serve", "--cron", "every monday"])
    assert res.exit_code != 0 and isinstance(res.exception, ConfigError)
    assert "--cron: 'every monday' is not a valid cron expression" in str(res.exception)
    assert "'0 6 * * 1'" in str(res.exception)

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"paths": {"artifacts": str(tmp_path / "art")}, "rounds": {"cron": "0 25 * * *"}}))
    res = runner.invoke(app, ["serve", "--config", str(config)])
    assert isinstance(res.exception, ConfigError)
    assert f"{config}: rounds.cron: '0 25 * * *' is not a valid cron expression" in str(res.exception)


def test_serve_refuses_to_start_without_a_server_to_fire_the_schedule(tmp_path):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"paths": {"artifacts": str(tmp_path / "art")}}))
    # The session's test harness may have set an API URL in the settings context; drop it here.
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        res = runner.invoke(app, ["serve", "--config", str(config), "--cron", "0 6 * * 1"])
    assert isinstance(res.exception, ConfigError)
    assert "PREFECT_API_URL is not set" in str(res.exception) and "prefect server start" in str(res.exception)
    assert not (tmp_path / "art" / "rounds").exists()


# --------------------------------------------------------------------------------------- real server, slow
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else "<no log>"


def _start(cmd: list[str], env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen:
    # Own process group: the worker's flow-run child is stopped with it.
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


def _cli(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 180) -> str:
    proc = subprocess.run([PREFECT, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"prefect {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory) -> Iterator[tuple[str, dict[str, str]]]:
    """A real `prefect server start` on 127.0.0.1 with its own PREFECT_HOME → (API URL, env for clients)."""
    import httpx

    home = tmp_path_factory.mktemp("prefect-server")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(home / "home"), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
               PREFECT_UI_ENABLED="false", PREFECT_LOGGING_LEVEL="INFO")
    log = home / "server.log"
    server = _start([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, log, home)
    api = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, f"prefect server exited with {server.returncode}:\n{_tail(log)}"
            try:
                if httpx.get(f"{api}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"prefect server not healthy after 240 s:\n{_tail(log)}"
            time.sleep(1)
        yield api, {**env, "PREFECT_API_URL": api}
    finally:
        _stop(server)


def copy_project_code(root: Path) -> None:
    """The project's code, configs and prefect.yaml copied into `root`: the folder `prefect deploy` runs in and the
    deployment's runs start in (its packages shadow the editable install on PYTHONPATH)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("flows", "pipeline", "configs"):
        shutil.copytree(ROOT / name, root / name, ignore=ignore)
    shutil.copy2(ROOT / "prefect.yaml", root / "prefect.yaml")


def _tiny_project(root: Path) -> Path:
    """A copy of the project code + a tiny config (60 digits, tiny model built on first use) → the config path."""
    from pipeline.data.demo import write_digits

    copy_project_code(root)
    data = write_digits(root / "data" / "digits", limit=60)
    cfg = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    cfg["paths"]["artifacts"] = str(root / "artifacts")
    cfg["data"]["sources"] = [{"kind": "jsonl", "path": str(data / "manifest.jsonl")}]
    cfg["data"]["ground_truth"] = str(data / "ground_truth.jsonl")
    cfg["model"].update(name_or_path=str(root / "models" / "tiny-idefics3"), build_tiny_if_missing=True)
    cfg["train"].update(batch_size=4, effective_batch_size=4, max_steps=2)
    cfg["select"].update(batch_size=8, shard_size=64)
    cfg["rounds"].update(simulate_annotator=True)
    path = root / "configs" / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.mark.slow
def test_deploy_from_prefect_yaml_to_a_process_worker_and_run_a_round(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    api, env = prefect_server
    project = tmp_path / "project"
    config = _tiny_project(project)
    # Shells set PWD to the folder `prefect deploy` runs in; the copy's packages shadow the editable install.
    env = {**env, "PWD": str(project), "PYTHONPATH": str(project)}

    _cli(["work-pool", "create", "tamis", "--type", "process"], env, project)
    _cli(["deploy", "--all", "--no-prompt"], env, project, timeout=300)
    out = _cli(["deployment", "run", "labeling-round/scheduled", "--param", f"config_path={config}"], env, project)
    run_id = re.search(r"UUID: ([0-9a-f-]{36})", out)
    assert run_id, out

    worker_log = tmp_path / "worker.log"
    worker = _start([PREFECT, "worker", "start", "--pool", "tamis"], env, worker_log, tmp_path)
    try:
        with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            dep = client.read_deployment_by_name("labeling-round/scheduled")
            assert [s.schedule.cron for s in dep.schedules] == ["0 6 * * 1"]
            assert dep.parameters == {"config_path": "configs/demo.yaml"} and dep.work_pool_name == "tamis"
            assert dep.job_variables["env"]["TAMIS_PROJECT_DIR"] == str(project)

            deadline = time.monotonic() + 900
            while not (run := client.read_flow_run(run_id.group(1))).state.is_final():
                assert worker.poll() is None, f"worker exited with {worker.returncode}:\n{_tail(worker_log)}"
                assert time.monotonic() < deadline, f"run still {run.state.name} after 900 s:\n{_tail(worker_log)}"
                time.sleep(3)
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
            assert run.state.is_completed(), (
                f"run ended {run.state.name}: {run.state.message}\n"
                + "\n".join(lg.message for lg in logs[-40:]) + f"\n--- worker ---\n{_tail(worker_log)}"
            )
            arts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    finally:
        _stop(worker)

    assert run.parameters == {"config_path": str(config)} and run.deployment_id == dep.id
    by_key = {a.key: a for a in arts}
    assert by_key["round-summary"].type == "markdown"
    assert "Labeling round 0" in by_key["round-summary"].data and "labeled samples" in by_key["round-summary"].data
    assert by_key["selection"].type == "table"
    # The export folder as text to copy (a browser opens no file:// link from a web page) and a command to serve it.
    hand_off = by_key["export-folder"].data
    assert "file://" not in hand_off and "python -m http.server" in hand_off, hand_off
    export = Path(re.search(r"```\n(/[^\n]+)\n```", hand_off).group(1))
    assert export.is_dir() and export.is_relative_to(project / "artifacts") and any(export.iterdir())
    assert run.name == "round-000" and "round-000" in run.tags
    # The job variables reached the flow-run process: task results sit next to the project's artifacts.
    assert any((project / "artifacts" / "prefect" / "results").iterdir())


@pytest.mark.slow
def test_serve_registers_the_scheduled_deployment_from_the_config(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL, temporary_settings

    api, env = prefect_server
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"paths": {"artifacts": str(tmp_path / "art")}, "rounds": {"cron": "15 4 * * 2"}}))
    log = tmp_path / "serve.log"
    serve = _start([str(BIN / "tamis"), "serve", "--config", str(config)], env, log, tmp_path)
    try:
        with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            deadline = time.monotonic() + 180
            while True:
                assert serve.poll() is None, f"tamis serve exited with {serve.returncode}:\n{_tail(log)}"
                try:
                    dep = client.read_deployment_by_name("labeling-round/scheduled")
                    if [s.schedule.cron for s in dep.schedules] == ["15 4 * * 2"]:
                        break
                except ObjectNotFound:
                    pass
                assert time.monotonic() < deadline, f"no served deployment after 180 s:\n{_tail(log)}"
                time.sleep(1)
    finally:
        _stop(serve)
    assert dep.parameters == {"config_path": str(config.resolve())}
    assert dep.work_pool_name is None  # served from the process itself, no work pool


def deploy_run_and_start_worker(env: dict[str, str], project: Path, config_path: str,
                                log: Path) -> tuple[str, subprocess.Popen]:
    """prefect.yaml deployed from `project` onto the process pool `tamis`, a run of it with `config_path`, and a
    worker started in `log`'s folder → (the run's ID, the worker)."""
    _cli(["work-pool", "create", "tamis", "--type", "process", "--overwrite"], env, project)
    _cli(["deploy", "--all", "--no-prompt"], env, project, timeout=300)
    out = _cli(["deployment", "run", "labeling-round/scheduled", "--param", f"config_path={config_path}"], env, project)
    run_id = re.search(r"UUID: ([0-9a-f-]{36})", out)
    assert run_id, out
    return run_id.group(1), _start([PREFECT, "worker", "start", "--pool", "tamis"], env, log, log.parent)


def _wait_for(client, run_id: str, done, what: str, worker: subprocess.Popen, worker_log: Path, limit: float = 900):
    deadline = time.monotonic() + limit
    while not done(run := client.read_flow_run(run_id)):
        assert worker.poll() is None, f"worker exited with {worker.returncode}:\n{_tail(worker_log)}"
        assert not run.state.is_final(), f"run ended {run.state.name} ({run.state.message}) before {what}:\n" \
                                         f"{_tail(worker_log)}"
        assert time.monotonic() < deadline, f"run still {run.state.name} after {limit} s, not {what}:\n" \
                                            f"{_tail(worker_log)}"
        time.sleep(3)
    return run


def _task_inputs_the_ui_accepts(client, run_ids) -> None:
    """The Task Runs tab's query (task runs of a flow run) answers, and no input is a subflow's result: the V1 UI
    rejects `flow_run` inputs ("Invalid TaskInputResponse") and then lists no task at all."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    for run_id in run_ids:
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
        assert task_runs, run_id
        kinds = {i.input_type for tr in task_runs for values in tr.task_inputs.values() for i in values}
        assert kinds <= {"task_run", "parameter", "constant"}, (run_id, kinds)


@pytest.mark.slow
def test_a_deployed_round_waits_for_its_annotators_and_resumes_into_the_next_round(prefect_server, tmp_path):
    """rounds.wait_for_labels: the run suspends after its export (no lock held, `tamis status` answers), the
    annotators' file is given through the resume form's input, and the same run imports it and runs round 1."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterParentFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.flow_runs import resume_flow_run
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from pipeline.annotation.ledger import Ledger, ledger_path
    from pipeline.annotation.simulate import simulate_annotator
    from pipeline.lock import ProjectLock

    api, env = prefect_server
    project = tmp_path / "project"
    config = _tiny_project(project)
    cfg = yaml.safe_load(config.read_text())
    # The form may name a file only inside the artifacts folder or rounds.labels_from: the annotators' folder here.
    cfg["rounds"].update(simulate_annotator=False, wait_for_labels=True, wait_timeout_s=3600,
                         labels_from=str(tmp_path / "annotators"))
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    art = project / "artifacts"
    env = {**env, "PWD": str(project), "PYTHONPATH": str(project)}

    worker_log = tmp_path / "worker.log"
    run_id, worker = deploy_run_and_start_worker(env, project, str(config), worker_log)
    try:
        with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            run = _wait_for(client, run_id, lambda r: r.state.is_paused(), "suspended", worker, worker_log)
            assert run.state.name == "Suspended" and run.name == "round-000"
            assert {"round-000", "waiting-for-labels"} <= set(run.tags)
            assert run.state.state_details.run_input_keyset  # the form the UI shows
            # Suspended holds nothing: the project lock is free and `tamis status` answers.
            with ProjectLock(art / "round.lock"):
                pass
            status = subprocess.run([str(BIN / "tamis"), "status", "--json", "-c", str(config)], env=env,
                                    capture_output=True, text=True, timeout=120, cwd=project)
            assert status.returncode == 0, status.stderr
            assert json.loads(status.stdout)["rounds_done"] == 1

            # The annotators answer the export; the form's input names their file.
            answers = simulate_annotator(art / "rounds/000/export", cfg["data"]["ground_truth"],
                                         tmp_path / "annotators", round_index=0)
            resume_flow_run(run.id, run_input={"labels_in_inbox": False, "labels_file": str(answers),
                                               "note": "batch 0 done"})
            run = _wait_for(client, run_id, lambda r: r.state.is_final(), "finished", worker, worker_log)
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
            messages = [lg.message for lg in logs]
            assert run.state.is_completed(), (
                f"run ended {run.state.name}: {run.state.message}\n" + "\n".join(messages[-40:])
                + f"\n--- worker ---\n{_tail(worker_log)}")
            subflows = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])))
            _task_inputs_the_ui_accepts(client, [run.id, *(s.id for s in subflows)])
            arts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    finally:
        _stop(worker)

    assert run.name == "round-001" and {"round-000", "round-001"} <= set(run.tags)
    assert "waiting-for-labels" not in run.tags  # the flag of the round before the resume
    assert run.state.message.startswith("round 1: ")
    assert "round-001-score-pool" in {s.name for s in subflows}
    ledger = Ledger(ledger_path(art))
    assert len(ledger.labels()) == 8 and {e["round"] for e in ledger.entries()} == {1}  # imported by round 1
    assert (art / "inbox" / answers.name).is_file()
    assert (art / "rounds/001/export/label_studio_tasks.json").is_file()
    assert len(json.loads((art / "rounds/001/export/label_studio_tasks.json").read_text())) == 8
    # The library's lines and the note reached the run's logs in the UI.
    assert any("batch 0 done" in m for m in messages)
    assert any("labels appended" in m for m in messages)  # pipeline.annotation: the import's report
    assert any(m.startswith("trained 2 steps") for m in messages)  # pipeline.model.train
    by_key = {}
    for a in sorted(arts, key=lambda a: a.created, reverse=True):  # the API's order is not the creation order
        by_key.setdefault(a.key, a)
    assert by_key["learning-curve"].type == "image" and by_key["learning-curve"].data.startswith("data:image/png")
    assert by_key["round-summary"].description == "Labeling round 1"  # round 0, in the same run, had no curve
    assert "![learning curve](data:image/png;base64," in by_key["round-summary"].data
    assert {"round-progress", "training-progress", "export-folder"} <= set(by_key)
