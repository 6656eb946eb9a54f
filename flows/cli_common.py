"""What the `tamis` command modules share: the --config option and the config loader.

flows/cli.py builds the app from the flows/cmd_*.py modules; they import from here, never from cli.py, so no module
depends on one that is still being initialised.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

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
