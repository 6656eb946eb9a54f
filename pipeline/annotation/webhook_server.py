"""The HTTP receiver Label Studio's webhooks call, and their registration on the project through its API.

The receiver does the least it can before it answers: check the shared secret (constant time), parse, append the
event to the durable queue (fsynced), wake the listener. Label Studio does not retry a failed delivery, so the answer
must be fast and a 2xx must mean "written to disk".
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pipeline.annotation.label_studio import LabelStudioError, LabelStudioProject
from pipeline.annotation.webhooks import ACTIONS, EventQueue, parse_event
from pipeline.config import AnnotateConfig, TriggerConfig
from pipeline.config.trigger import WEBHOOK_PATH
from pipeline.errors import ConfigError

log = logging.getLogger(__name__)

SECRET_HEADER = "X-Tamis-Secret"
MAX_BODY = 64 * 1024 * 1024  # an annotation event with an inline image in its task stays far below this


def secret_from_env(trigger: TriggerConfig) -> str:
    secret = os.environ.get(trigger.secret_env, "").strip()
    if len(secret) < 16:
        raise ConfigError(
            f"rounds.trigger: the environment variable {trigger.secret_env} must hold the webhook secret (at least 16 "
            f"characters, e.g. `export {trigger.secret_env}=$(python -c 'import secrets; print(secrets.token_hex(24))')`"
            f"); it has {len(secret)}. Label Studio sends it in the {SECRET_HEADER} header (`tamis setup-webhook`)")
    return secret


class _Handler(BaseHTTPRequestHandler):
    server: WebhookServer
    protocol_version = "HTTP/1.1"

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/health":
            return self._answer(200, {"status": "ok"})
        return self._answer(404, {"error": f"POST Label Studio's webhooks to {WEBHOOK_PATH}"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path.split("?", 1)[0] != WEBHOOK_PATH:
            return self._answer(404, {"error": f"POST Label Studio's webhooks to {WEBHOOK_PATH}"})
        given = self.headers.get(SECRET_HEADER, "").encode()
        if not hmac.compare_digest(given, self.server.secret):
            self.close_connection = True
            return self._answer(401, {"error": f"missing or wrong {SECRET_HEADER} header"})
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            return self._answer(411, {"error": "Content-Length is required"})
        if not 0 <= length <= MAX_BODY:
            self.close_connection = True
            return self._answer(413, {"error": f"body of {length} bytes; at most {MAX_BODY}"})
        try:
            record = parse_event(json.loads(self.rfile.read(length)), time.time())
        except (ValueError, TypeError) as exc:  # JSONDecodeError included; an ID that is not a number
            return self._answer(400, {"error": f"not a Label Studio annotation event: {exc}"})
        if record is None:
            return self._answer(200, {"queued": False, "reason": f"only {', '.join(ACTIONS)} are read"})
        try:
            fresh = self.server.queue.append(record)
        except OSError as exc:  # disk full, read-only: a 5xx so Label Studio's log shows the failed delivery
            log.error("webhook event not written: %s", exc)
            return self._answer(503, {"error": "the event could not be written"})
        self._answer(200, {"queued": fresh, "key": record["key"]})
        if fresh:
            self.server.on_event(record)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        log.debug("webhook %s: " + format, self.client_address[0], *args)


class WebhookServer(ThreadingHTTPServer):
    """The receiver on (host, port); `serve_in_thread()` runs it beside the listener's loop."""

    daemon_threads = True

    def __init__(self, trigger: TriggerConfig, queue: EventQueue, secret: str,
                 on_event: Callable[[dict[str, Any]], None] = lambda record: None):
        self.queue, self.secret, self.on_event = queue, secret.encode(), on_event
        try:
            super().__init__((trigger.host, trigger.port), _Handler)
        except OSError as exc:
            raise ConfigError(f"rounds.trigger: cannot listen on {trigger.host}:{trigger.port} ({exc}); set "
                              "rounds.trigger.port to a free port") from None

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
