"""Label Studio webhooks: the event queue, the trigger decision (a pure function) and the receiver over real HTTP.

The live round trip against a real Label Studio is tests/test_webhooks_live.py.
"""

from __future__ import annotations

import itertools
import json
import socket
import urllib.error
import urllib.request

import pytest

from pipeline.annotation.label_studio import annotation_key
from pipeline.annotation.webhooks import (
    CREATED,
    DELETED,
    UPDATED,
    EventQueue,
    Pending,
    decide,
    parse_event,
    pending,
)
from pipeline.config import TriggerConfig

SECRET = "s3cret-s3cret-s3cret-0123"


def ann_payload(action: str, ann_id: int, sample: str, choice: str, updated: str, task_set: str = "000/export"):
    """A body as Label Studio 1.23 sends it (webhooks/serializers_for_hooks.py: the annotation and task models'
    fields, the project's)."""
    return {"action": action, "project": {"id": 7, "title": "p"},
            "annotation": {"id": ann_id, "task": 100 + ann_id, "project": 7, "was_cancelled": False,
                           "updated_at": updated, "lead_time": 3.0,
                           "result": [{"from_name": "answer", "to_name": "image", "type": "choices",
                                       "value": {"choices": [choice]}}]},
            "task": {"id": 100 + ann_id, "data": {"image": "/x.png", "sample_id": sample, "tamis_set": task_set}}}


def deleted_payload(*ids: int):
    return {"action": DELETED, "project": {"id": 7}, "annotations": [{"id": i} for i in ids]}


BATCH = {("a", "000/export"), ("b", "000/export"), ("c", "000/export")}


def test_parse_event_keys_the_delivery_and_carries_the_pull_key():
    body = ann_payload(CREATED, 1, "a", "3", "2026-01-01T10:00:00Z")
    rec = parse_event(body, 5.0)
    assert rec["ann_key"] == annotation_key(body["annotation"])  # the pull's own key: "imported?" is a look-up
    assert (rec["sample_id"], rec["tamis_set"], rec["project"], rec["annotation"]) == ("a", "000/export", 7, 1)
    assert parse_event(body, 9.0)["key"] == rec["key"]  # a redelivery later is the same delivery
    edited = ann_payload(UPDATED, 1, "a", "4", "2026-01-01T10:05:00Z")
    assert parse_event(edited, 5.0)["key"] != rec["key"]
    assert parse_event({"action": "PROJECT_UPDATED", "project": {"id": 7}}, 1.0) is None
    for bad in ([], {"annotation": {}}, {"action": CREATED, "annotation": {"id": 1}},
                {"action": DELETED, "annotations": [{"x": 1}]}):
        with pytest.raises(ValueError):
            parse_event(bad, 1.0)


def test_queue_dedupes_and_survives_a_restart_and_a_torn_line(tmp_path):
    q = EventQueue(tmp_path)
    a = parse_event(ann_payload(CREATED, 1, "a", "3", "t1"), 1.0)
    assert q.append(a) and not q.append(a)
    with open(q.path, "ab") as f:  # a crash mid-append left half a line
        f.write(b'{"key": "half')
    again = EventQueue(tmp_path)  # the restarted receiver
    assert not again.append(parse_event(ann_payload(CREATED, 1, "a", "3", "t1"), 2.0))
    assert again.append(parse_event(ann_payload(CREATED, 2, "b", "1", "t1"), 2.0))
    assert [e["annotation"] for e in again.events()] == [1, 2]


def test_pending_is_the_same_in_any_delivery_order_with_duplicates():
    events = [parse_event(p, t) for t, p in enumerate([
        ann_payload(CREATED, 1, "a", "3", "2026-01-01T10:00:00Z"),
        ann_payload(UPDATED, 1, "a", "8", "2026-01-01T10:05:00Z"),  # corrected
        ann_payload(CREATED, 2, "b", "1", "2026-01-01T10:01:00Z"),
        ann_payload(CREATED, 3, "c", "2", "2026-01-01T10:02:00Z"),
        deleted_payload(3),  # c's annotation deleted: c is not done
        ann_payload(CREATED, 4, "c", "5", "2026-01-01T10:06:00Z"),
    ], start=1)]
    want = pending(events, set(), BATCH)
    updated = annotation_key(ann_payload(UPDATED, 1, "a", "8", "x")["annotation"])
    assert updated in want.new and len(want.new) == 3 and want.batch_left == 0 and want.batch == 3
    for order in itertools.permutations(events):
        got = pending([*order, order[0]], set(), BATCH)  # any order, and a duplicate
        assert (got.new, got.batch_left) == (want.new, want.batch_left)
    # once a round's pull imported them, they are no longer new; c without its replacement is not done
    assert not pending(events, set(want.new), BATCH).new
    assert pending(events[:5], set(), BATCH).batch_left == 1


def test_decide_rules():
    t = TriggerConfig(batch_complete=True, min_new_labels=5, debounce_s=60)
    p = Pending(new=frozenset({"1:a", "2:b"}), batch=3, batch_left=1, last_event=1000.0)
    d = decide(t, p, now=1010.0)
    assert not d.start and d.wake_at == 1060.0 and "1 of the batch's 3 tasks" in d.reason
    assert decide(t, p, now=1060.0).start  # quiet for debounce_s
    assert decide(t, Pending(p.new, 3, 0, 1000.0), now=1001.0).start  # the batch is complete
    assert decide(t, Pending(frozenset(map(str, range(5))), 3, 1, 1000.0), now=1001.0).start  # min_new_labels
    assert not decide(TriggerConfig(), p, now=5000.0).start  # batch rule only: one task still out
    late = decide(t, Pending(p.new, 3, 0, 1000.0), now=1001.0, retry_at=1300.0)
    assert not late.start and late.wake_at == 1300.0  # a round just failed on these labels: wait for the retry
    assert not decide(t, Pending(frozenset(), 3, 0, 1000.0), now=1e9).start  # nothing new: nothing starts
    stopped = decide(t, Pending(p.new, 3, 0, 1000.0, stopped="label budget reached"), now=1001.0)
    assert not stopped.start and "label budget" in stopped.reason
    with pytest.raises(ValueError, match="no rule"):
        TriggerConfig(batch_complete=False)


# --------------------------------------------------------------------------------------------- the HTTP receiver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_receiver_refuses_without_the_secret_and_queues_once(tmp_path):
    from pipeline.annotation.webhook_server import SECRET_HEADER, WebhookServer

    trigger = TriggerConfig(port=_free_port())
    seen = []
    server = WebhookServer(trigger, EventQueue(tmp_path), SECRET, on_event=seen.append)
    server.serve_in_thread()
    try:
        body = json.dumps(ann_payload(CREATED, 1, "a", "3", "t1")).encode()
        assert _post(trigger.url, body, {})[0] == 401
        assert _post(trigger.url, body, {SECRET_HEADER: SECRET[:-1] + "x"})[0] == 401
        assert not EventQueue(tmp_path).events()  # nothing refused was written
        status, answer = _post(trigger.url, body, {SECRET_HEADER: SECRET})
        assert status == 200 and answer["queued"] is True
        assert _post(trigger.url, body, {SECRET_HEADER: SECRET}) == (200, {"queued": False, "key": answer["key"]})
        assert _post(trigger.url, b"{not json", {SECRET_HEADER: SECRET})[0] == 400
        odd = ann_payload(CREATED, 1, "a", "3", "t1")
        odd["annotation"]["id"] = [1]
        assert _post(trigger.url, json.dumps(odd).encode(), {SECRET_HEADER: SECRET})[0] == 400
        assert _post(trigger.url.replace("/label-studio", "/other"), body, {SECRET_HEADER: SECRET})[0] == 404
        other = json.dumps({"action": "TASKS_CREATED", "tasks": []}).encode()
        assert _post(trigger.url, other, {SECRET_HEADER: SECRET}) == (200, {
            "queued": False, "reason": "only ANNOTATION_CREATED, ANNOTATION_UPDATED, ANNOTATIONS_DELETED are read"})
        assert [r["annotation"] for r in seen] == [1]  # the listener was woken once, for the one new event
        assert len(EventQueue(tmp_path).events()) == 1
    finally:
        server.shutdown()
        server.server_close()


def test_a_short_secret_is_refused_with_the_fix(monkeypatch):
    from pipeline.annotation.webhook_server import secret_from_env
    from pipeline.errors import ConfigError

    monkeypatch.setenv("TAMIS_WEBHOOK_SECRET", "short")
    with pytest.raises(ConfigError, match="at least 16 characters"):
        secret_from_env(TriggerConfig())


# ------------------------------------------------------------------------------------- the listener's loop, the CLI
def _listener_project(tmp_path, **trigger):
    """A project whose round 0 sent out a batch of a, b, c (as its round.json and export say) to project 7."""
    import yaml

    from pipeline.annotation.export import TASKS_FILE

    art = tmp_path / "art"
    export = art / "rounds/000/export"
    export.mkdir(parents=True)
    (export / TASKS_FILE).write_text(json.dumps([{"data": {"sample_id": s}} for s in "abc"]))
    (art / "rounds/000/round.json").write_text(json.dumps({"round": 0, "export_dir": str(export), "stopped": None}))
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "paths": {"artifacts": str(art)}, "annotate": {"label_studio": {"project": 7}},
        "rounds": {"trigger": {"port": _free_port(), **trigger}}}))
    return config


def _annotated(queue, *samples, first_id=1):
    for i, s in enumerate(samples, start=first_id):
        queue.append(parse_event(ann_payload(CREATED, i, s, "1", f"t{i}"), float(i)))


def _pull_all(art):
    """What a round's pull leaves: every annotation event's key in pulled.json."""
    from pipeline.annotation.label_studio import pulled_path

    keys = [e["ann_key"] for e in EventQueue(art).events() if "ann_key" in e]
    pulled_path(art, 7).parent.mkdir(parents=True, exist_ok=True)
    pulled_path(art, 7).write_text(json.dumps(keys))


def test_the_library_loop_runs_resumes_and_retries_with_plain_functions(tmp_path):
    """The retry policy is library code (pipeline/annotation/listener.py): no CLI module, no Prefect; a round's
    result is a RoundState, and a resumed round blocks a second one for retry_s."""
    import time

    from pipeline.annotation.listener import TriggerLoop, listen_trigger
    from pipeline.config import load_config
    from pipeline.round_state import RoundState

    cfg = load_config(_listener_project(tmp_path, retry_s=90))
    ran, resumed = [], []

    def a_round():
        ran.append(1)
        _pull_all(cfg.artifacts)
        return RoundState(round=1, selected=3, export_dir="e")

    loop = TriggerLoop(listen_trigger(cfg.rounds, cfg.annotate, "listen"), cfg.artifacts, run_round=a_round,
                       resume=lambda note: resumed.append(note) or "round-001", wait_for_labels=True)
    _annotated(loop.queue, "a", "b", "c")
    assert loop.step() is None and resumed and not ran  # a suspended round was resumed, none run here
    assert loop.retry_at == pytest.approx(time.time() + 90, abs=5) and loop.step() > 0 and not ran
    loop.retry_at, loop.wait_for_labels = 0.0, False
    assert loop.step() is None and ran == [1] and loop.retry_at is None  # ran; its pull took every label
    assert loop.step() == 30.0 and ran == [1]


def test_listen_refuses_a_config_without_a_trigger_or_label_studio():
    from pipeline.annotation.listener import listen_trigger
    from pipeline.config import ProjectConfig, parse_config
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match=r"`tamis listen`: rounds.trigger is not set"):
        listen_trigger(ProjectConfig().rounds, ProjectConfig().annotate, "listen")
    cfg = parse_config({"rounds": {"trigger": {"port": 1}}})
    with pytest.raises(ConfigError, match=r"`tamis setup-webhook`: annotate.label_studio is not set"):
        listen_trigger(cfg.rounds, cfg.annotate, "setup-webhook")


def test_a_trigger_during_a_running_round_starts_one_more_round_and_a_lock_waits(tmp_path):
    from flows.cli.cmd_listen import listener_for
    from pipeline.annotation.listener import LOCK_RETRY_S
    from pipeline.config import load_config
    from pipeline.errors import LockError

    config = _listener_project(tmp_path, min_new_labels=2)
    cfg = load_config(config)
    calls = []

    def a_round(config_path):  # the flow: it pulls what is in; meanwhile two more annotations arrive
        calls.append(config_path)
        if len(calls) == 1:
            raise LockError("Another labeling round is running for this project")
        _pull_all(cfg.artifacts)
        if len(calls) == 2:
            _annotated(listener.queue, "d", "e", first_id=10)
        return {"round": len(calls) - 1}

    listener = listener_for(config, cfg, run_round=a_round)
    _annotated(listener.queue, "a", "b")
    assert listener.step() is None and len(calls) == 1  # started, found the lock
    assert listener.retry_at is not None and listener.step() > LOCK_RETRY_S - 2  # waits for the lock, starts nothing
    assert len(calls) == 1
    listener.retry_at = 0.0  # the wait is over
    assert listener.step() is None and len(calls) == 2  # the round ran; two labels came in while it did
    assert listener.step() is None and len(calls) == 3  # ... which start exactly one more round
    assert listener.step() == 30.0 and len(calls) == 3  # nothing new: it sleeps until the next event


def test_a_round_that_leaves_the_labels_unimported_is_retried_after_retry_s(tmp_path):
    import time

    from flows.cli.cmd_listen import listener_for
    from pipeline.annotation.label_studio import PULL_FAILED
    from pipeline.config import load_config

    config = _listener_project(tmp_path, retry_s=120)
    calls = []
    outcome = {"raise": None}

    def a_round(path):  # Label Studio is down: the round's pull fails (its import record says so); later the round fails
        calls.append(path)
        if outcome["raise"]:
            raise outcome["raise"]
        return {"round": 1, "imports": [{"file": "Label Studio http://127.0.0.1:9 project 7",
                                         "error": "connection refused", PULL_FAILED: True}]}

    listener = listener_for(config, load_config(config), run_round=a_round)
    _annotated(listener.queue, "a", "b", "c")
    assert listener.step() is None and len(calls) == 1
    assert listener.retry_at == pytest.approx(time.time() + 120, abs=5)
    assert listener.step() == 30.0 and len(calls) == 1  # not again at once (it looks again in POLL_S): no hammering

    outcome["raise"] = RuntimeError("CUDA out of memory")
    listener.retry_at = 0.0
    assert listener.step() is None and len(calls) == 2 and listener.retry_at > time.time() + 100  # survives it


def test_listen_and_setup_webhook_without_a_trigger_say_what_to_add(tmp_path):
    import yaml
    from typer.testing import CliRunner

    from flows.cli.main import app
    from pipeline.errors import ConfigError

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"paths": {"artifacts": str(tmp_path / "art")}}))
    for command in ("listen", "setup-webhook"):
        res = CliRunner().invoke(app, [command, "--config", str(config)])
        assert isinstance(res.exception, ConfigError), res.output
        assert "rounds.trigger is not set" in str(res.exception) and "batch_complete" in str(res.exception)
    config.write_text(yaml.safe_dump({"paths": {"artifacts": str(tmp_path / "art")},
                                      "rounds": {"trigger": {"batch_complete": False}}}))
    res = CliRunner().invoke(app, ["listen", "--config", str(config)])
    assert isinstance(res.exception, ConfigError) and "no rule would ever start a round" in str(res.exception)


def test_tamis_listen_stops_on_sigterm_even_started_in_the_background(tmp_path):
    """`tamis listen` run as a service (systemd, Docker, `nohup … &`) is stopped with SIGTERM, and a background job
    starts with SIGINT ignored, so Ctrl-C's KeyboardInterrupt never comes: SIGTERM must stop it as Ctrl-C does (it
    used to end it without its "stopped" line and its server's shutdown)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import yaml

    config = _listener_project(tmp_path)
    port = yaml.safe_load(config.read_text())["rounds"]["trigger"]["port"]
    env = {**os.environ, "TAMIS_WEBHOOK_SECRET": "s" * 24, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "listen", "--config", str(config)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, "tamis listen did not answer within 60 s"
                time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # ignored, as in any background job
        time.sleep(0.5)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=30)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0 and "stopped" in output, output


def test_with_wait_for_labels_the_suspended_deployed_round_is_resumed_not_run_twice(tmp_path, prefect_harness):
    """rounds.wait_for_labels: the project's round suspended on the server (as a deployed run suspends) is resumed
    with the form's answer, as `tamis resume` would; the listener runs nothing itself, and a run of another project
    is left alone."""
    import yaml
    from prefect import flow, get_client
    from prefect.states import Suspended

    from flows.cli.cmd_listen import listener_for, resume_waiting_round
    from flows.waiting import WAIT_KEY
    from pipeline.config import load_config

    config = _listener_project(tmp_path)
    data = yaml.safe_load(config.read_text())
    data["rounds"]["wait_for_labels"] = True
    config.write_text(yaml.safe_dump(data))

    @flow(name="labeling-round")
    def stand_in(config_path: str | None = None) -> None:  # the server only needs the flow's name
        pass

    with get_client(sync_client=True) as client:  # two deployed runs, suspended as a waiting round suspends
        deployment = client.create_deployment(flow_id=client.create_flow(stand_in), name="scheduled",
                                              entrypoint="flows/round.py:labeling_round")
        other, mine = (client.create_flow_run_from_deployment(deployment, parameters={"config_path": str(path)},
                                                               state=Suspended(pause_key=WAIT_KEY))
                       for path in (tmp_path / "other.yaml", config))
    calls = []
    listener = listener_for(config, load_config(config), run_round=calls.append)
    _annotated(listener.queue, "a", "b", "c")
    assert listener.step() is None and calls == []  # resumed, not run here
    assert listener.retry_at is not None and listener.step() > 0 and calls == []  # and not again meanwhile
    with get_client(sync_client=True) as client:
        resumed, left = client.read_flow_run(mine.id), client.read_flow_run(other.id)
        assert not resumed.state.is_paused() and left.state.is_paused()
    assert resume_waiting_round(config, "again") is None  # nothing of this project waits any more


def test_a_deployed_round_given_a_relative_config_path_is_resumed_from_a_listener_started_elsewhere(
        tmp_path, prefect_harness, monkeypatch):
    """prefect.yaml's runs get a config_path relative to the project folder their pull step moves into
    (TAMIS_PROJECT_DIR): a listener started in another folder (a service's working directory) with the config's full
    path still finds its suspended run and resumes it, instead of running a second round of its own. A relative path
    under another project folder is not this project's."""
    import yaml
    from prefect import flow, get_client
    from prefect.states import Suspended

    from flows.cli.cmd_listen import listener_for
    from flows.waiting import WAIT_KEY
    from pipeline.config import load_config

    project = tmp_path / "project"
    project.mkdir()
    config = _listener_project(project)
    data = yaml.safe_load(config.read_text())
    data["rounds"]["wait_for_labels"] = True
    config.write_text(yaml.safe_dump(data))
    (tmp_path / "service").mkdir()
    monkeypatch.chdir(tmp_path / "service")

    @flow(name="labeling-round")
    def stand_in(config_path: str | None = None) -> None:
        pass

    relative = str(config.relative_to(tmp_path))  # project/c.yaml
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow(stand_in)
        runs = {}
        for name, folder in (("other", tmp_path / "another"), ("mine", tmp_path)):
            deployment = client.create_deployment(flow_id=flow_id, name=f"scheduled-{name}",
                                                  entrypoint="flows/round.py:labeling_round",
                                                  job_variables={"env": {"TAMIS_PROJECT_DIR": str(folder)}})
            runs[name] = client.create_flow_run_from_deployment(
                deployment, parameters={"config_path": relative}, state=Suspended(pause_key=WAIT_KEY))
    calls = []
    listener = listener_for(config.resolve(), load_config(config), run_round=calls.append)
    _annotated(listener.queue, "a", "b", "c")
    assert listener.step() is None and calls == []  # resumed, not run here
    with get_client(sync_client=True) as client:
        assert not client.read_flow_run(runs["mine"].id).state.is_paused()
        assert client.read_flow_run(runs["other"].id).state.is_paused()
