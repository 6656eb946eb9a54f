"""`python -m flows.cli ARGS`: the `tamis` command (as tests and benchmarks run it without the console script)."""

from flows.cli import run

run()
