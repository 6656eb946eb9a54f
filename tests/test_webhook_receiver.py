"""The webhook receiver under what else reaches its port: bursts, slow and half-sent requests, smuggling, bad
types, huge numbers, a full disk, a public bind; and the trigger loop's folding of what it queued.

The protocol itself (secret, dedupe, the decision) is tests/test_webhooks.py; a ten-minute soak of all of this
against `tamis listen` in its own process is tests/test_webhook_soak.py (slow).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from test_webhooks import SECRET, _free_port, _listener_project, ann_payload
from webhook_scenario import Receiver

from pipeline.annotation.label_studio import annotation_key, pulled_path
from pipeline.annotation.webhook_server import MAX_BODY, SECRET_HEADER, WebhookServer
from pipeline.annotation.webhooks import CREATED, UPDATED, EventQueue, parse_event, pending
from pipeline.config import TriggerConfig
from pipeline.errors import ConfigError
from pipeline.store import append_jsonl, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
PATH = "/label-studio"


@contextlib.contextmanager
def receiver(artifacts: Path, **trigger):
    server = WebhookServer(TriggerConfig(port=_free_port(), **trigger), EventQueue(artifacts), SECRET)
    server.serve_in_thread()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def post(port: int, body: bytes, secret: str | None = SECRET, timeout: float = 30) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", PATH, body, {"Content-Type": "application/json", **({SECRET_HEADER: secret} if secret
                                                                                 else {})})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def raw(port: int, data: bytes, wait: float = 3.0) -> tuple[bytes, bool]:
    """Send bytes as they are; what came back until the server closed (True) or `wait` passed (False)."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(data)
        end = time.monotonic() + wait
        while time.monotonic() < end:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                return got, False
            except ConnectionResetError:
                return got, True
            if not chunk:
                return got, True
            got += chunk
    return got, False


def event(i: int, **task_data) -> bytes:
    body = ann_payload(CREATED, i, f"s{i}", "1", "2026-01-01T10:00:00Z")
    body["task"]["data"].update(task_data)
    return json.dumps(body).encode()


def request(body: bytes, length: str | None = None, path: str = PATH, extra: str = "") -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\n{SECRET_HEADER}: {SECRET}\r\n{extra}"
            f"Content-Length: {len(body) if length is None else length}\r\n\r\n")
    return head.encode() + body


# ------------------------------------------------------------------------------------------------ 2: the backlog
def test_200_concurrent_deliveries_all_get_a_200_and_are_queued_exactly_once(tmp_path):
    """The listen backlog was 5: of 200 deliveries at once, most were reset before accept()."""
    with receiver(tmp_path) as server:
        port = server.server_address[1]
        go, answers = threading.Barrier(200), [None] * 200

        def deliver(i: int) -> None:
            go.wait()
            try:
                answers[i] = post(port, event(i))[0]
            except OSError as exc:
                answers[i] = repr(exc)

        threads = [threading.Thread(target=deliver, args=(i,)) for i in range(200)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert answers == [200] * 200, sorted(map(str, answers))[:5]
        assert post(port, event(7))[1]["queued"] is False  # and a redelivery is not queued again
    ids = [e["annotation"] for e in EventQueue(tmp_path).events()]
    assert sorted(ids) == list(range(200))


# ---------------------------------------------------------------------------------------- 3: types, dead letters
@pytest.mark.parametrize("bad", [{"project": [7]}, {"tamis_set": ["000/export"]}, {"sample_id": {"a": 1}},
                                 {"task_id": "101"}, {"project": True}])
def test_an_event_with_a_wrong_field_type_is_refused_and_not_queued(tmp_path, bad):
    body = json.loads(event(1))
    if "project" in bad:
        body["project"] = bad["project"]
    elif "task_id" in bad:
        body["task"]["id"] = bad["task_id"]
    else:
        body["task"]["data"].update(bad)
    with receiver(tmp_path) as server:
        status, answer = post(server.server_address[1], json.dumps(body).encode())
    assert status == 400 and "must be" in answer["error"], answer
    assert not EventQueue(tmp_path).events()


def test_a_queued_event_the_loop_cannot_read_is_parked_and_the_loop_goes_on(tmp_path, caplog):
    """An old receiver queued `"project": [7]`: the loop raised TypeError (unhashable) and every restart died on it."""
    from flows.cli.cmd_listen import listener_for
    from pipeline.config import load_config

    config = _listener_project(tmp_path, min_new_labels=1)
    cfg = load_config(config)
    good = parse_event(ann_payload(CREATED, 1, "a", "1", "2026-01-01T10:00:00Z"), 1.0)
    poisoned = {**parse_event(ann_payload(CREATED, 2, "b", "1", "2026-01-01T10:00:00Z"), 2.0), "project": [7]}
    append_jsonl(EventQueue(cfg.artifacts).path, [poisoned, good])
    calls = []
    listener = listener_for(config, cfg, run_round=lambda path: calls.append(path) or {"round": 1, "imports": []})
    assert listener.step() is None and len(calls) == 1  # the good event still starts its round
    parked = read_jsonl(listener.queue.dead_letter)
    assert [p["event"]["annotation"] for p in parked] == [2] and "project" in parked[0]["reason"]
    assert "parked" in caplog.text and str(listener.queue.dead_letter) in caplog.text
    listener.step()
    assert len(read_jsonl(listener.queue.dead_letter)) == 1  # parked once, not at every look


# ----------------------------------------------------------------------------------- 4: deadline, connection cap
def test_half_sent_requests_are_cut_at_the_deadline_and_connections_are_capped(tmp_path):
    """Without the secret and without ever finishing, 150 such requests held 150 threads for ever."""
    with receiver(tmp_path, read_timeout_s=2.0, max_connections=8) as server:
        port = server.server_address[1]
        before = threading.active_count()
        t0 = time.monotonic()
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(12)]
        for s in held:
            s.sendall(b"POST /label-studio HTTP/1.1\r\nHost: x\r\nContent-Le")
        time.sleep(0.3)
        status, answer = post(port, event(1), timeout=5)  # at the cap: a quick 503, not a wait
        assert status == 503 and "max_connections" in answer["error"] and time.monotonic() - t0 < 2.0
        dribble = socket.create_connection(("127.0.0.1", port))  # a byte now and then: the deadline is the total
        socks = [*held, dribble]
        for s in socks:
            s.setblocking(False)
        closed_at: dict[int, float] = {}
        while len(closed_at) < len(socks) and time.monotonic() - t0 < 12:
            with contextlib.suppress(OSError):
                dribble.send(b"P")
            for i, s in enumerate(socks):
                try:
                    if i not in closed_at and not s.recv(4096):
                        closed_at[i] = time.monotonic() - t0
                except BlockingIOError:
                    pass
                except ConnectionResetError:
                    closed_at[i] = time.monotonic() - t0
            time.sleep(0.1)
        assert len(closed_at) == len(socks) and max(closed_at.values()) < 5.0, closed_at  # 2 s + a poll
        for s in socks:
            s.close()
        assert post(port, event(2))[0] == 200  # the slots are free again
        time.sleep(0.5)
        assert threading.active_count() <= before + 1
    assert [e["annotation"] for e in EventQueue(tmp_path).events()] == [2]


# ---------------------------------------------------------------------------------- 5: smuggling, Content-Length
@pytest.mark.parametrize("first", ["404", "411"])
def test_an_early_answer_closes_the_connection_so_its_body_is_never_a_second_request(tmp_path, first):
    smuggled = request(event(99))  # an authenticated delivery hidden in the body of a request answered early
    if first == "404":
        data = request(smuggled, path="/other")
    else:
        data = (f"POST {PATH} HTTP/1.1\r\nHost: x\r\n{SECRET_HEADER}: {SECRET}\r\nTransfer-Encoding: chunked\r\n\r\n"
                ).encode() + smuggled
    with receiver(tmp_path) as server:
        got, closed = raw(server.server_address[1], data)
    assert got.startswith(f"HTTP/1.1 {first} ".encode()) and got.count(b"HTTP/1.1 ") == 1, got
    assert closed and b"Connection: close" in got
    assert not EventQueue(tmp_path).events()


@pytest.mark.parametrize("length", ["{n_}", "+{n}", "{n} ", "\r\n {n}", "{n}, {n}"])
def test_content_length_is_digits_only(tmp_path, length):
    body = event(1)
    n = str(len(body))
    value = length.format(n=n, n_=f"{n[:1]}_{n[1:]}")
    with receiver(tmp_path) as server:
        got, closed = raw(server.server_address[1], request(body, value))
        assert got.startswith(b"HTTP/1.1 400 ") and closed, got
        got, closed = raw(server.server_address[1], request(b"{}", str(MAX_BODY + 1)))
        assert got.startswith(b"HTTP/1.1 413 ") and closed, got
    assert not EventQueue(tmp_path).events()


# ------------------------------------------------------------------------------------------------ 6: the bind rule
@pytest.mark.parametrize("host", ["0.0.0.0", "", "::", "8.8.8.8"])
def test_every_interface_or_a_public_address_needs_allow_public_bind(host):
    from pipeline.annotation.webhook_server import check_bind

    with pytest.raises(ConfigError, match="allow_public_bind"):
        check_bind(TriggerConfig(host=host))
    assert "TLS reverse proxy" in check_bind(TriggerConfig(host=host, allow_public_bind=True))
    for local in ("127.0.0.1", "localhost", "::1", "10.1.2.3", "192.168.1.20"):
        assert check_bind(TriggerConfig(host=local)) is None


def test_tamis_listen_on_every_interface_is_refused_and_allowed_with_a_warning(tmp_path):
    config = _listener_project(tmp_path, host="0.0.0.0")
    env = {**os.environ, "TAMIS_WEBHOOK_SECRET": SECRET, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "flows.cli", "listen", "--config", str(config)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "allow_public_bind" in run.stdout + run.stderr, run.stdout + run.stderr
    data = yaml.safe_load(config.read_text())
    data["rounds"]["trigger"]["allow_public_bind"] = True
    config.write_text(yaml.safe_dump(data))
    listen = Receiver(tmp_path, config, env, f"http://127.0.0.1:{data['rounds']['trigger']['port']}/health")
    listen.start()  # listens, and says so
    try:
        assert post(data["rounds"]["trigger"]["port"], event(1))[0] == 200
    finally:
        listen.kill(signal.SIGTERM)
    assert "warning: the webhook receiver listens on every interface" in " ".join(listen.log().split()), listen.log()


def test_setup_webhook_never_registers_an_every_interface_url(tmp_path):
    from pipeline.annotation.webhook_server import registrable_url

    config = _listener_project(tmp_path, host="0.0.0.0", allow_public_bind=True)
    env = {**os.environ, "TAMIS_WEBHOOK_SECRET": SECRET, "LABEL_STUDIO_API_KEY": "k", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "flows.cli", "setup-webhook", "--config", str(config)], env=env,
                         capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "rounds.trigger.public_url" in out and "--url" in out, out
    trigger = TriggerConfig(host="0.0.0.0", allow_public_bind=True)
    for url in ("http://0.0.0.0:8787/label-studio", "http://[::]:8787/label-studio", "http://:8787/label-studio"):
        with pytest.raises(ConfigError, match="public_url"):
            registrable_url(trigger, url)
    public = TriggerConfig(host="0.0.0.0", allow_public_bind=True, public_url="https://hooks.example.com/label-studio")
    assert registrable_url(public, None) == "https://hooks.example.com/label-studio"
    assert registrable_url(TriggerConfig(), None) == "http://127.0.0.1:8787/label-studio"


# ---------------------------------------------------------------------------------------- 9, 10: what is pending
def test_an_annotation_deleted_while_the_receiver_was_down_is_retired_after_one_pull(tmp_path):
    """Its event says "new" and no deletion event came: with min_new_labels a round started every retry_s for ever,
    each importing nothing."""
    from flows.cli.cmd_listen import listener_for
    from pipeline.annotation.listener import POLL_S
    from pipeline.annotation.webhooks import retired_keys
    from pipeline.config import load_config

    config = _listener_project(tmp_path, min_new_labels=1, retry_s=60)
    cfg = load_config(config)
    calls = []

    def a_round(path):  # Label Studio is up; b's annotation is gone from it, so the pull imports a only
        calls.append(path)
        keys = [e["ann_key"] for e in EventQueue(cfg.artifacts).events() if e["annotation"] == 1]
        pulled_path(cfg.artifacts, 7).parent.mkdir(parents=True, exist_ok=True)
        pulled_path(cfg.artifacts, 7).write_text(json.dumps(keys))
        return {"round": 1, "imports": [{"file": "pull-1.json", "accepted": 1}]}

    listener = listener_for(config, cfg, run_round=a_round)
    for i, s in ((1, "a"), (2, "b")):
        listener.queue.append(parse_event(ann_payload(CREATED, i, s, "1", "2026-01-01T10:00:00Z"), float(i)))
    assert listener.step() is None and len(calls) == 1
    gone = annotation_key(ann_payload(CREATED, 2, "b", "1", "x")["annotation"])
    assert retired_keys(cfg.artifacts) == {gone} and not listener.pending().new
    listener.retry_at = 0.0  # however long it waits
    assert listener.step() == POLL_S and len(calls) == 1  # no second round for nothing


def test_updated_at_is_compared_as_an_instant_not_as_text():
    """As text `…:00Z` sorts after `…:00.400000Z`, so the older version of an annotation won."""
    newer = ann_payload(UPDATED, 1, "a", "new", "2026-01-01T10:00:00.400000Z")
    older = ann_payload(UPDATED, 1, "a", "old", "2026-01-01T10:00:00Z")
    same_as_older = ann_payload(UPDATED, 1, "a", "old2", "2026-01-01T11:00:00+01:00")  # earlier than `newer` too
    events = [parse_event(p, t) for t, p in ((1.0, newer), (2.0, older), (3.0, same_as_older))]
    for order in (events, events[::-1]):
        assert pending(order, set(), set()).new == {annotation_key(newer["annotation"])}


# ------------------------------------------------------------------------------- 12, 13: a full disk, odd numbers
def test_a_full_disk_answers_503_with_a_short_body(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (not root, or no mount permission)")
    try:
        (disk / "webhooks").mkdir()
        with contextlib.suppress(OSError), open(disk / "filler", "wb") as f:  # fill it to the last byte
            while True:
                f.write(b"x" * 4096)
                f.flush()
        with receiver(disk) as server:
            status, answer = post(server.server_address[1], event(1))
        assert status == 503 and answer == {"error": "the event could not be written to disk"}
    finally:
        subprocess.run(["umount", str(disk)], check=False)


@pytest.mark.parametrize("ident", ["1e999", "1.0", "true", str(2**64), "-1", "[1]"])
def test_an_id_that_is_not_an_integer_in_range_is_a_400(tmp_path, ident):
    body = event(5).replace(b'"annotation": {"id": 5,', f'"annotation": {{"id": {ident},'.encode())
    assert ident.encode() in body
    with receiver(tmp_path) as server:
        status, answer = post(server.server_address[1], body)
    assert status == 400 and "annotation.id" in answer["error"], answer
    assert not EventQueue(tmp_path).events()


def test_100000_deep_nesting_is_a_400(tmp_path):
    body = b'{"action": "ANNOTATION_CREATED", "annotation": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with receiver(tmp_path) as server:
        status, answer = post(server.server_address[1], body)
    assert status == 400 and "not a Label Studio annotation event" in answer["error"]
