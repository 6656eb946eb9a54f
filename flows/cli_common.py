"""What the `tamis` command modules share: the --config option and the config loader.

flows/cli.py builds the app from the flows/cmd_*.py modules; they import from here, never from cli.py, so no module
depends on one that is still being initialised.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from pipeline.config import ProjectConfig

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="Project config YAML (default: the embedded configs/demo.yaml).")
]


def load(config: Path | None) -> ProjectConfig:
    """Load the config once and point Prefect at the project's artifacts before Prefect is imported."""
    from flows.settings import configure_prefect
    from pipeline.config import load_config

    cfg = load_config(config)
    configure_prefect(cfg.artifacts)
    return cfg


# Piped output has no terminal width; rich would fall back to 80 columns and cut table cells ("accura…").
PIPED_WIDTH = 200


def out_console(**options: Any) -> Any:
    """The console for a command's result: the terminal's width, COLUMNS when set, else PIPED_WIDTH. Tables keep
    their natural width (up to that), so piped or captured output reads like the terminal's. `options` go to rich's
    Console (e.g. markup=False)."""
    from rich.console import Console

    console = Console(**options)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(width=PIPED_WIDTH, **options)
    return console
