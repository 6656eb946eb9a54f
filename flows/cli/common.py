"""What the `tamis` command modules share: the --config option and the config loader.

flows/cli/main.py builds the app from the flows/cli/cmd_*.py modules; they import from here, never from main.py, so no module
depends on one that is still being initialised.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from pipeline.config import ProjectConfig

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="Project config YAML (default: ./tamis.yaml, which `tamis init` "
                              "writes; `-c demo` or `-c demo-open`: the built-in demo configs).")
]
PROJECT_CONFIG = Path("tamis.yaml")  # what `tamis init` writes, and what every command reads without -c
BUILTIN = ("demo", "demo-open")  # configs/<name>.yaml, asked for by name: `-c demo`


def config_file(config: Path | None, *, required: bool = True) -> Path | None:
    """The config a command reads: -c's file (`demo` / `demo-open`: the built-in configs, unless such a file is
    here), else ./tamis.yaml (said on stderr, so a project's own config is never mistaken for another), else an
    error naming -c and `tamis init` (None when not `required`: a command that runs on the defaults).

    The built-in demo config is never a silent default: run in a project folder, it wrote the demo's artifacts
    into the project's and failed on a demo manifest that was not there."""
    from pipeline.config import DEFAULT_CONFIG
    from pipeline.errors import ConfigError

    if config is not None:
        if str(config) in BUILTIN and not config.exists():
            return DEFAULT_CONFIG.with_name(f"{config}.yaml")
        return config
    if PROJECT_CONFIG.is_file():
        print(f"using ./{PROJECT_CONFIG}", file=sys.stderr)
        return PROJECT_CONFIG
    if not required:
        return None
    raise ConfigError(f"no config: -c was not given and there is no ./{PROJECT_CONFIG} in {Path.cwd()}; pass "
                      f"-c {PROJECT_CONFIG} (your project's config), or write one with `tamis init PATH_TO_IMAGES` "
                      "(the demo: `tamis demo`, or -c demo)")


def project_config(config: Path | None, *, required: bool = True) -> ProjectConfig:
    """The config `config_file` finds, loaded; the defaults when none is found and none is `required`."""
    from pipeline.config import load_config, parse_config

    path = config_file(config, required=required)
    return load_config(path) if path is not None else parse_config({}, origin="the defaults")


def load(config: Path | None) -> ProjectConfig:
    """Load the config once (`config_file`: -c, else ./tamis.yaml) and point Prefect at the project's artifacts
    before Prefect is imported. A command that passes the config's path on to a flow resolves it with
    `config_file` first, so the flow reads the same file."""
    from flows.settings import configure_prefect

    cfg = project_config(config)
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
