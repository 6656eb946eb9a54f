"""Scheduled rounds: `tamis serve`, the one-process alternative to the `prefect.yaml` deployment.

Both register the deployment `labeling-round/scheduled`; `serve` also runs the scheduled flow runs itself, so no work
pool or worker is needed (but the schedule only fires while it runs).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any

import typer

from flows.cli.common import ConfigOpt, config_file, load
from pipeline.errors import ConfigError

log = logging.getLogger(__name__)
DEPLOYMENT_NAME = "scheduled"


def checked_cron(cron: str, origin: str) -> str:
    """Refuse a bad cron expression before Prefect does, with the source of the value and an example."""
    from prefect.client.schemas.schedules import CronSchedule
    from pydantic import ValidationError

    try:
        CronSchedule(cron=cron)
    except ValidationError:
        raise ConfigError(
            f"{origin}: {cron!r} is not a valid cron expression; give 5 fields (minute hour day-of-month month "
            "day-of-week, in UTC), e.g. '0 6 * * 1' for Mondays at 06:00"
        ) from None
    return cron


def server_url() -> str:
    """The Prefect API to serve against; Prefect's embedded server has no scheduler, so a schedule would never fire."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if not url:
        raise ConfigError(
            "PREFECT_API_URL is not set: `tamis serve` needs a running Prefect server to fire its schedule (the "
            "embedded one has no scheduler); run `prefect server start`, then "
            "`export PREFECT_API_URL=http://127.0.0.1:4200/api` and retry"
        )
    return url


def serve_round(config: Path | None, cron: str | None, cfg: Any) -> None:
    """Register `labeling-round/scheduled` with `cron` (default: rounds.cron) and run its flow runs until stopped."""
    origin = "--cron" if cron else f"{config}: rounds.cron"
    schedule = checked_cron(cron or cfg.rounds.cron, origin)
    url = server_url()
    from flows.round import labeling_round

    log.info("serving labeling-round/%s on cron %r (UTC) against %s", DEPLOYMENT_NAME, schedule, url)

    # Absolute, because the runs may start in another working directory than this command.
    params = {"config_path": str(config.resolve())} if config else {}
    labeling_round.serve(name=DEPLOYMENT_NAME, cron=schedule, parameters=params)


def serve_cmd(
    config: ConfigOpt = None,
    cron: Annotated[str | None, typer.Option("--cron", help="Cron schedule in UTC, e.g. '0 6 * * 1' "
                                              "(default: rounds.cron of the config).")] = None,
) -> None:
    """Run labeling rounds on a schedule from this process (deployment labeling-round/scheduled); Ctrl-C stops."""
    if cron is not None:
        checked_cron(cron, "--cron")  # a bad --cron is refused before the config is looked for
    config = config_file(config)
    serve_round(config, cron, load(config))


def register_serve(app: typer.Typer) -> None:
    app.command("serve")(serve_cmd)
