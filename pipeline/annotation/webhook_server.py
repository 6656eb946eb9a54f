"""The HTTP receiver Label Studio's webhooks call, and their registration on the project through its API.

The receiver does the least it can before it answers: check the shared secret (constant time), parse, append the
event to the durable queue (fsynced), wake the listener. Label Studio does not retry a failed delivery, so the answer
must be fast and a 2xx must mean "written to disk".

It also has to outlive whatever else reaches its port: one request per connection (every answer closes it, so a body
left unread is never read as a next request), a deadline to send the whole request (rounds.trigger.read_timeout_s),
a cap on connections handled at once (rounds.trigger.max_connections: one more gets a 503 at once), a listen backlog
a burst of deliveries fits in, and a 4xx or 503 (never a dropped connection) for a request it cannot take.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pipeline.annotation.label_studio import LabelStudioError, LabelStudioProject
from pipeline.annotation.webhooks import ACTIONS, EventQueue, parse_event
from pipeline.config import AnnotateConfig, TriggerConfig
from pipeline.config.trigger import WEBHOOK_PATH
from pipeline.errors import ConfigError, TamisError

log = logging.getLogger(__name__)

SECRET_HEADER = "X-Tamis-Secret"
MAX_BODY = 64 * 1024 * 1024  # an annotation event with an inline image in its task stays far below this
DRAIN_MAX = 64 * 1024  # an early answer first reads (and drops) a body this small: the client sees it, not a reset
BACKLOG = 1024  # connections the kernel holds until accept(): a burst of deliveries waits instead of being reset
_DIGITS = re.compile(r"[0-9]{1,19}")  # Content-Length as RFC 9110 writes it: no sign, space or underscore
_BUSY = json.dumps({"error": "too many connections at once (rounds.trigger.max_connections)"}).encode()
_BUSY_ANSWER = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
                b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY), _BUSY))


def secret_from_env(trigger: TriggerConfig) -> str:
    secret = os.environ.get(trigger.secret_env, "").strip()
    if len(secret) < 16:
        raise ConfigError(
            f"rounds.trigger: the environment variable {trigger.secret_env} must hold the webhook secret (at least 16 "
            f"characters, e.g. `export {trigger.secret_env}=$(python -c 'import secrets; print(secrets.token_hex(24))')`"
            f"); it has {len(secret)}. Label Studio sends it in the {SECRET_HEADER} header (`tamis setup-webhook`)")
    return secret


# ------------------------------------------------------------------------------------------------ where it listens
def _addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host.split("%", 1)[0])]
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except OSError:
            return []
        return [ipaddress.ip_address(str(i[4][0]).split("%", 1)[0]) for i in infos]


def every_interface(host: str) -> bool:
    """"", 0.0.0.0 and :: mean every interface of the machine, public ones included (a name is not looked up)."""
    try:
        return not host.strip() or ipaddress.ip_address(host.strip().split("%", 1)[0]).is_unspecified
    except ValueError:
        return False


def check_bind(trigger: TriggerConfig) -> str | None:
    """Refuse a receiver reachable from beyond loopback or a private network unless rounds.trigger.allow_public_bind
    says so (it speaks plain HTTP, the secret in a header); with it, the warning to print. None when local."""
    addrs = _addresses(trigger.host) if trigger.host.strip() else []
    if not every_interface(trigger.host) and addrs and all(a.is_loopback or a.is_private for a in addrs):
        return None
    where = "every interface" if every_interface(trigger.host) else f"{trigger.host!r}, not a loopback or private address"
    if not trigger.allow_public_bind:
        raise ConfigError(
            f"rounds.trigger.host = {trigger.host!r} listens on {where}, over plain HTTP with the secret in a header. "
            "Keep host: 127.0.0.1 behind a TLS reverse proxy (docs/webhooks.md), use a private address, or set "
            "rounds.trigger.allow_public_bind: true to accept it")
    return (f"the webhook receiver listens on {where} (rounds.trigger.allow_public_bind): plain HTTP, anyone who "
            "can reach the port can try the secret; put a TLS reverse proxy in front")


def registrable_url(trigger: TriggerConfig, url: str | None) -> str:
    """The URL `tamis setup-webhook` gives Label Studio: --url, else public_url, else http://host:port; never one
    on 0.0.0.0, "" or :: (no machine can call that)."""
    url = url or trigger.url
    host = re.sub(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", "", url).split("/", 1)[0].rsplit("@", 1)[-1]
    host = host[1:].split("]", 1)[0] if host.startswith("[") else host.rsplit(":", 1)[0]
    if every_interface(host):
        raise ConfigError(
            f"the webhook URL {url} names no machine Label Studio can call (rounds.trigger.host = {trigger.host!r} "
            "is where the receiver listens, every interface); set rounds.trigger.public_url to the address Label "
            "Studio reaches this machine at (e.g. https://tamis-hooks.example.com/label-studio) or pass --url")
    return url


# --------------------------------------------------------------------------------------------------- the handler
def content_length(headers: Any) -> int | tuple[int, str]:
    """The body's length, or the answer (status, reason) that refuses the request."""
    if headers.get("Transfer-Encoding") is not None:
        return 411, "chunked bodies are not read: send a Content-Length"
    given = headers.get_all("Content-Length") or []
    if not given:
        return 411, "Content-Length is required"
    if len(given) > 1 or not _DIGITS.fullmatch(given[0]):
        return 400, f"Content-Length must be one decimal number, got {', '.join(map(repr, given))[:80]}"
    if int(given[0]) > MAX_BODY:
        return 413, f"body of {int(given[0])} bytes; at most {MAX_BODY}"
    return int(given[0])


class _Handler(BaseHTTPRequestHandler):
    server: WebhookServer
    protocol_version = "HTTP/1.1"
    _body_read = False

    def setup(self) -> None:
        self.timeout = self.server.read_timeout  # each read and write; the server's deadline bounds the whole request
        super().setup()

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        if status >= 400 and not self._body_read:
            self._drain()
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")  # one request per connection: nothing unread is parsed as a request
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def _drain(self) -> None:
        """Read a small body that will not be used, so the client gets the answer rather than a reset."""
        length = content_length(self.headers)
        if isinstance(length, int) and length <= DRAIN_MAX:
            with contextlib.suppress(OSError):
                self.rfile.read(length)
        self._body_read = True

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/health":
            return self._answer(200, {"status": "ok"})
        return self._answer(404, {"error": f"POST Label Studio's webhooks to {WEBHOOK_PATH}"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path.split("?", 1)[0] != WEBHOOK_PATH:
            return self._answer(404, {"error": f"POST Label Studio's webhooks to {WEBHOOK_PATH}"})
        given = self.headers.get(SECRET_HEADER, "").encode()
        if not hmac.compare_digest(given, self.server.secret):
            return self._answer(401, {"error": f"missing or wrong {SECRET_HEADER} header"})
        length = content_length(self.headers)
        if not isinstance(length, int):
            return self._answer(length[0], {"error": length[1]})
        body, self._body_read = self.rfile.read(length), True
        self.server.read_done(self.connection)
        if len(body) < length:
            return self._answer(400, {"error": f"body cut short: {len(body)} of {length} bytes"})
        try:
            record = parse_event(json.loads(body), time.time())
        except (ValueError, TypeError, RecursionError, OverflowError) as exc:  # 1e999, 100,000-deep nesting, bad IDs
            return self._answer(400, {"error": f"not a Label Studio annotation event: {str(exc)[:300]}"})
        if record is None:
            return self._answer(200, {"queued": False, "reason": f"only {', '.join(ACTIONS)} are read"})
        try:
            fresh = self.server.queue.append(record)
        except (OSError, TamisError) as exc:  # disk full (the store's ArtifactError), read-only: Label Studio logs it
            log.error("webhook event not written: %s", exc)
            return self._answer(503, {"error": "the event could not be written to disk"})
        self._answer(200, {"queued": fresh, "key": record["key"]})
        if fresh:
            self.server.on_event(record)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        log.debug("webhook %s: " + format, self.client_address[0], *args)


# ---------------------------------------------------------------------------------------------------- the server
class WebhookServer(ThreadingHTTPServer):
    """The receiver on (host, port); `serve_in_thread()` runs it beside the listener's loop."""

    daemon_threads = True
    request_queue_size = BACKLOG

    def __init__(self, trigger: TriggerConfig, queue: EventQueue, secret: str,
                 on_event: Callable[[dict[str, Any]], None] = lambda record: None):
        self.queue, self.secret, self.on_event = queue, secret.encode(), on_event
        self.read_timeout = trigger.read_timeout_s
        self.warning = check_bind(trigger)
        self._slots = threading.BoundedSemaphore(trigger.max_connections)
        self._reading: dict[socket.socket, float] = {}  # connection → when it must have sent its whole request
        self._reading_lock = threading.Lock()
        if self.warning:
            log.warning("%s", self.warning)
        try:
            super().__init__((trigger.host, trigger.port), _Handler)
        except OSError as exc:
            raise ConfigError(f"rounds.trigger: cannot listen on {trigger.host}:{trigger.port} ({exc}); set "
                              "rounds.trigger.port to a free port") from None

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # at the cap: a quick 503, no thread, nothing read
            with contextlib.suppress(OSError):
                request.settimeout(1.0)
                request.sendall(_BUSY_ANSWER)
            self.shutdown_request(request)
            return
        with self._reading_lock:
            self._reading[request] = time.monotonic() + self.read_timeout
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._finished(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._finished(request)

    def _finished(self, request: Any) -> None:
        self.read_done(request)
        self._slots.release()

    def read_done(self, request: Any) -> None:
        with self._reading_lock:
            self._reading.pop(request, None)

    def service_actions(self) -> None:
        """Called by serve_forever every poll (0.5 s): end the connections past their deadline to send the request,
        so a slow or half-sent request holds a thread and a slot only this long."""
        now = time.monotonic()
        with self._reading_lock:
            late = [r for r, deadline in self._reading.items() if deadline < now]
            for r in late:
                del self._reading[r]
        for r in late:
            with contextlib.suppress(OSError):
                r.shutdown(socket.SHUT_RDWR)  # its thread's read returns at once; the thread closes it

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away, or was cut off at its deadline: a log line, not a traceback on stderr."""
        log.debug("webhook connection from %s ended: %r", client_address[0], sys.exc_info()[1])

    def serve_in_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="tamis-webhooks", daemon=True)
        thread.start()
        return thread


# --------------------------------------------------------------------------------------------------- registration
def register_webhook(annotate: AnnotateConfig, artifacts: str | os.PathLike[str], url: str, secret: str,
                     client: Any | None = None) -> dict[str, Any]:
    """Point the Label Studio project's webhook at `url` with the secret header: created, or updated in place when the
    project has one to that URL already (so re-running it rotates the secret). Returns {"project", "webhook",
    "created"}."""
    project = LabelStudioProject(annotate, artifacts, client)
    pid = project.project_id()
    hooks = project.client.webhooks
    have = [h for h in project._call(f"listing the webhooks of project {pid}", lambda: list(hooks.list(project=str(pid))))
            if getattr(h, "url", None) == url and getattr(h, "project", pid) == pid]
    fields = dict(url=url, headers={SECRET_HEADER: secret}, send_payload=True, send_for_all_actions=False,
                  is_active=True, actions=list(ACTIONS))
    if have:
        hook = project._call(f"updating webhook {have[0].id} of project {pid}", hooks.update, id=have[0].id, **fields)
    else:
        hook = project._call(f"creating a webhook on project {pid}", hooks.create, project=pid, **fields)
    if getattr(hook, "id", None) is None:
        raise LabelStudioError(f"Label Studio at {annotate.label_studio.url}: the webhook was not saved")
    log.info("Label Studio: project %s webhook %s → %s", pid, hook.id, url)
    return {"project": pid, "webhook": int(hook.id), "created": not have}
