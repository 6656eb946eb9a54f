"""`tamis` commands for this area; `register` adds them to the app."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    pass
