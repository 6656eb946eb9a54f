"""The `tamis` command: main.py builds the app from the cmd_*.py modules (one area's commands each), which share the
--config option and the loader through common.py and the console's log filters through logs.py. Importing this
package loads none of them, so a flow that reads logs.py (flows/ui.py) does not load the whole CLI."""


def run() -> None:
    """The console script (pyproject.toml: `tamis = "flows.cli:run"`, the name installed scripts call): the app is
    imported when the command runs."""
    from flows.cli.main import run as main

    main()
