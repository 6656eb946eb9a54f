"""`tamis listen` and `tamis setup-webhook`: rounds that start when Label Studio's annotations arrive.

The receiver runs in a thread and only queues events; this process's main thread runs the library's trigger loop
(pipeline/annotation/listener.py: the decision and the retries), which runs the round as `tamis round` does: the
`labeling-round` flow (pull from Label Studio, import, train, select, push the next batch), one at a time, under the
project lock. With rounds.wait_for_labels, a deployed round suspended waiting
for these labels is resumed instead (as `tamis resume` does), so its worker runs the round.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from flows.cli.common import ConfigOpt, config_file, load, out_console

if TYPE_CHECKING:
    from pipeline.annotation.listener import TriggerLoop

log = logging.getLogger(__name__)


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

    from flows.cli.cmd_rounds import waiting_rounds

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


def listener_for(config: Path | None, cfg: Any, run_round: Callable[[str | None], dict] | None = None,
                 resume: Callable[[Path | None, str], str | None] | None = None) -> TriggerLoop:
    """The library's trigger loop for this project, running rounds as `tamis round` does (`run_round(config_path)`,
    the flow, whose result is round.json's object) and resuming suspended ones as `tamis resume` does."""
    from pipeline.annotation.listener import TriggerLoop, listen_trigger
    from pipeline.round_state import RoundState

    run, path = run_round or _labeling_round, str(config) if config else None
    return TriggerLoop(listen_trigger(cfg.rounds, cfg.annotate, "listen"), cfg.artifacts,
                       run_round=lambda: RoundState.from_json(run(path)),
                       resume=lambda note: (resume or resume_waiting_round)(config, note),
                       wait_for_labels=cfg.rounds.wait_for_labels)


def listen_cmd(config: ConfigOpt = None) -> None:
    """Receive Label Studio's webhooks and start the next round when rounds.trigger says so; Ctrl-C or SIGTERM
    stops."""
    config = config_file(config)
    from pipeline.annotation.webhook_server import WebhookServer, secret_from_env

    cfg = load(config)
    listener = listener_for(config.resolve() if config else None, cfg)
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
    from pipeline.annotation.listener import listen_trigger
    from pipeline.annotation.webhook_server import register_webhook, registrable_url, secret_from_env

    config = config_file(config)

    cfg = load(config)
    trigger = listen_trigger(cfg.rounds, cfg.annotate, "setup-webhook")
    url = registrable_url(trigger, url)
    done = register_webhook(cfg.annotate, cfg.artifacts, url, secret_from_env(trigger))
    verb = "created" if done["created"] else "updated"
    out_console().print(f"webhook {done['webhook']} {verb} on Label Studio project {done['project']}: it calls "
                        f"{url} on annotation events; run `tamis listen` to receive them", highlight=False)


def register(app: typer.Typer) -> None:
    app.command("listen")(listen_cmd)
    app.command("setup-webhook")(setup_webhook_cmd)
