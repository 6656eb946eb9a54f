"""The `tamis` command. It launches flows, so it lives in flows/; everything else it calls is library code.

Each area's commands live in a small module (flows/cli/cmd_*.py) with a `register(app)`; they share the --config option
and the loader through flows/cli/common.py, so this module imports them and none of them imports it.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer
from rich.console import Console

from flows.cli import (
    cmd_data,
    cmd_init,
    cmd_labels,
    cmd_listen,
    cmd_model,
    cmd_prepare,
    cmd_report,
    cmd_rounds,
    cmd_use,
)
from flows.cli.common import ConfigOpt, config_file
from flows.cli.logs import configure_logging
from pipeline import __version__
from pipeline.errors import TamisError

app = typer.Typer(
    name="tamis",
    help="Data-centric active learning for vision-language models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
console = Console(stderr=True)
state = {"debug": False}

def _version(value: bool) -> None:
    if value:
        typer.echo(f"tamis {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks and debug logs.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    state["debug"] = debug
    configure_logging(debug)


config_app = typer.Typer(help="Inspect the project config.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("show")
def config_show(config: ConfigOpt = None) -> None:
    """Print the resolved config (defaults filled in, paths made absolute)."""
    config = config_file(config)
    from pipeline.config import load_config

    typer.echo(load_config(config).to_yaml(), nl=False)


for _module in (cmd_init, cmd_data, cmd_prepare, cmd_model, cmd_labels, cmd_rounds, cmd_use, cmd_report, cmd_listen):
    _module.register(app)


def run() -> None:
    """Console entry point: user errors become one paragraph and exit code 2, not a traceback."""
    try:
        app(standalone_mode=False)
    except TamisError as exc:
        if state["debug"]:
            raise
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        console.print("aborted")
        sys.exit(130)
    except Exception as exc:  # click usage errors and the like
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        if state["debug"] or os.environ.get("TAMIS_DEBUG"):
            raise
        console.print(f"[bold red]unexpected error:[/] {exc.__class__.__name__}: {exc} (rerun with --debug for a traceback)")
        sys.exit(1)
