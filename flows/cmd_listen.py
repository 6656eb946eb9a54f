"""`tamis listen` and `tamis setup-webhook`: rounds that start when Label Studio's annotations arrive.

The receiver runs in a thread and only queues events; this process's main thread asks the library whether the next
round starts (pipeline.annotation.webhooks.decide) after each event and when a quiet period or a retry ends, and
runs it as `tamis round` does: the `labeling-round` flow (pull from Label Studio, import, train, select, push the
next batch), one at a time, under the project lock. With rounds.wait_for_labels, a deployed round suspended waiting
for these labels is resumed instead (as `tamis resume` does), so its worker runs the round.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from flows.cli_common import ConfigOpt, config_file, load, out_console
from pipeline.errors import ConfigError, LockError

log = logging.getLogger(__name__)

POLL_S = 30.0  # the loop looks again at least this often (a round started by hand changes what is pending)
LOCK_RETRY_S = 10.0  # another round holds the project lock: look again this soon, the trigger stays queued (once)


def _trigger(cfg: Any, command: str) -> Any:
    if cfg.rounds.trigger is None:
        raise ConfigError(f"`tamis {command}`: rounds.trigger is not set in the config; add e.g. `rounds: {{trigger: "
                          "{batch_complete: true}}}` (docs/webhooks.md)")
    if cfg.annotate.label_studio is None:
        raise ConfigError(f"`tamis {command}`: annotate.label_studio is not set; the rounds it starts pull their "
                          "labels from a Label Studio project: add {url, project, token_env}")
    return cfg.rounds.trigger


def run_config_path(run: Any) -> Path | None:
    """The config file a deployed run reads. A relative config_path (prefect.yaml's default, `--param
    config_path=configs/x.yaml`) is relative to the folder the run works in, TAMIS_PROJECT_DIR of its job variables
    (prefect.yaml's pull step moves there), not to this process's working directory."""
    from prefect import get_client

    path = run.parameters.get("config_path")
    if path is None or Path(path).is_absolute():
        return None if path is None else Path(path)
    env = dict((run.job_variables or {}).get("env") or {})
    if "TAMIS_PROJECT_DIR" not in env and run.deployment_id is not None:
        with get_client(sync_client=True) as client:
            env = dict((client.read_deployment(run.deployment_id).job_variables or {}).get("env") or {})
    folder = env.get("TAMIS_PROJECT_DIR")
    return Path(folder, path) if folder else Path(path)


def resume_waiting_round(config: Path | None, note: str) -> str | None:
    """Resume this project's deployed round suspended waiting for its labels (rounds.wait_for_labels), as
    `tamis resume` does; its name, or None when none waits (or no Prefect server is configured)."""
    from prefect.flow_runs import resume_flow_run
    from prefect.settings import get_current_settings

    from flows.cmd_rounds import waiting_rounds

    if not get_current_settings().api.url:
        return None  # Prefect's embedded server: no deployment, nothing can be suspended

    def same(run: Any) -> bool:
        path = run_config_path(run)
        return (path is None and config is None) or (
            path is not None and config is not None and path.resolve() == Path(config).resolve())

    mine = sorted((r for r in waiting_rounds() if same(r)), key=lambda r: r.created)
    if not mine:
        return None
    run = mine[-1]
    resume_flow_run(run.id, run_input={"labels_in_inbox": True, "labels_file": "", "note": note})
    return run.name


def _labeling_round(config_path: str | None) -> dict[str, Any]:
    """The round `tamis round` runs: the labeling-round flow (a flow run on PREFECT_API_URL's server when set)."""
    from flows.round import labeling_round

    return labeling_round(config_path)


class Listener:
    """The trigger loop of one project: pending events → decision → a round, one at a time."""

    def __init__(self, config: Path | None, cfg: Any, run_round: Callable[[str | None], dict] | None = None,
                 resume: Callable[[Path | None, str], str | None] | None = None):
        from pipeline.annotation.webhooks import EventQueue

        self.config, self.cfg, self.trigger = config, cfg, _trigger(cfg, "listen")
        self.run_round = run_round or _labeling_round
        self.resume = resume or resume_waiting_round
        self.queue = EventQueue(cfg.artifacts)
        self.wake = threading.Event()
        self.retry_at: float | None = None
        self.rounds_started = 0

    def pending(self) -> Any:
        from pipeline.annotation.webhooks import current_batch, pending, pulled_keys, retired_keys
        from pipeline.round_state import completed_rounds

        art = self.cfg.artifacts
        states = completed_rounds(art)
        last = states[-1] if states else None
        events = self.queue.readable()  # an event it cannot fold is parked in dead-letter.jsonl, never fatal
        done = pulled_keys(art, {e.get("project") for e in events}) | retired_keys(art)
        return pending(events, done, current_batch(art, last), stopped=last and last.stopped)

    def step(self) -> float | None:
        """Decide once and run the round when due; the seconds to wait before the next look (None: look again now)."""
        from pipeline.annotation.webhooks import decide

        p = self.pending()
        d = decide(self.trigger, p, now=time.time(), retry_at=self.retry_at)
        if not d.start:
            log.debug("no round yet: %s", d.reason)
            return POLL_S if d.wake_at is None else max(0.05, min(POLL_S, d.wake_at - time.time()))
        log.info("starting the next round: %s", d.reason)
        self.retry_at = None
        self.rounds_started += 1
        if self.cfg.rounds.wait_for_labels and self._resumed(d.reason):
            return None
        try:
            state = self.run_round(str(self.config) if self.config else None)
        except LockError as exc:  # a round by hand or by cron is running: this trigger waits for it, once
            log.info("%s; looking again in %.0f s", exc, LOCK_RETRY_S)
            self.retry_at = time.time() + LOCK_RETRY_S
            return None
        except Exception:  # noqa: BLE001 - a failed round must not end the listener; the labels stay pending
            log.exception("the round failed; its labels stay pending, next try in %.0f s (rounds.trigger.retry_s)",
                          self.trigger.retry_s)
            self.retry_at = time.time() + self.trigger.retry_s
            return None
        log.info("round %s finished: %s selected, export %s", state.get("round"), state.get("selected"),
                 state.get("export_dir"))
        self._after_round(state, p.new & self.pending().new)
        return None

    def _after_round(self, state: dict, left: frozenset[str]) -> None:
        """Labels the round started for but did not import: retried after retry_s when its pull failed (Label Studio
        down), retired when the pull reached Label Studio (deleted or edited again while the receiver was down)."""
        from pipeline.annotation.webhooks import retire, stale_after

        if not left:
            return
        if stale := stale_after(state.get("imports") or [], left):
            log.warning("%d labels the round started for are no longer in Label Studio as announced (deleted or "
                        "edited while the receiver was down); they stop counting as new (%s)", len(stale),
                        ", ".join(sorted(stale)[:5]))
            retire(self.cfg.artifacts, stale)
            return
        log.warning("%d labels the round started for are still not imported (the pull failed); next try in %.0f s",
                    len(left), self.trigger.retry_s)
        self.retry_at = time.time() + self.trigger.retry_s

    def _resumed(self, reason: str) -> bool:
        """A deployed round suspended for these labels is resumed on its worker (and shows in the UI as resumed);
        meanwhile nothing else starts for retry_s, unless its pull takes the labels first."""
        try:
            name = self.resume(self.config, f"tamis listen: {reason}")
        except Exception as exc:  # noqa: BLE001 - the server is unreachable: run the round here instead
            log.warning("could not look for a suspended round to resume (%s); running the round here", exc)
            return False
        if name is None:
            return False
        log.info("resumed %s, suspended waiting for these labels; its worker runs the round", name)
        self.retry_at = time.time() + self.trigger.retry_s
        return True

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            wait = self.step()
            if wait is not None:
                self.wake.wait(wait)
                self.wake.clear()


def listen_cmd(config: ConfigOpt = None) -> None:
    """Receive Label Studio's webhooks and start the next round when rounds.trigger says so; Ctrl-C or SIGTERM
    stops."""
    config = config_file(config)
    from pipeline.annotation.webhook_server import WebhookServer, secret_from_env

    cfg = load(config)
    listener = Listener(config.resolve() if config else None, cfg)
    server = WebhookServer(listener.trigger, listener.queue, secret_from_env(listener.trigger),
                           on_event=lambda record: listener.wake.set())
    server.serve_in_thread()
    host, port = server.server_address[:2]
    log.info("listening for Label Studio webhooks on http://%s:%s (Label Studio calls %s); events in %s", host, port,
             listener.trigger.url, listener.queue.path)
    out_console().print(f"listening on http://{host}:{port}; events go to {listener.queue.path}", highlight=False)
    if server.warning:
        out_console().print(f"warning: {server.warning}", highlight=False)
    stop = threading.Event()
    # SIGTERM (systemd, Docker, `kill`) stops it as Ctrl-C does: a service started in the background has SIGINT
    # ignored, and a round cut short resumes from its cached stages at the next start.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        listener.run(stop)
    except KeyboardInterrupt:
        log.info("stopped")
    finally:
        server.shutdown()
        server.server_close()


def setup_webhook_cmd(
    config: ConfigOpt = None,
    url: Annotated[str | None, typer.Option("--url", help="The URL Label Studio calls (default: "
                                             "rounds.trigger.public_url, else http://host:port of the receiver).")] = None,
) -> None:
    """Register (or update) the Label Studio project's webhook that calls `tamis listen`, with the secret header."""
    from pipeline.annotation.webhook_server import register_webhook, registrable_url, secret_from_env

    config = config_file(config)

    cfg = load(config)
    trigger = _trigger(cfg, "setup-webhook")
    url = registrable_url(trigger, url)
    done = register_webhook(cfg.annotate, cfg.artifacts, url, secret_from_env(trigger))
    verb = "created" if done["created"] else "updated"
    out_console().print(f"webhook {done['webhook']} {verb} on Label Studio project {done['project']}: it calls "
                        f"{url} on annotation events; run `tamis listen` to receive them", highlight=False)


def register(app: typer.Typer) -> None:
    app.command("listen")(listen_cmd)
    app.command("setup-webhook")(setup_webhook_cmd)
