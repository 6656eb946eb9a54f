"""What `tamis` prints on stderr: tamis's own logs, other libraries only from WARNING up, known-harmless third-party
messages hidden unless --debug."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from flows.cli import logs as cli_logging
from flows.cli.logs import HARMLESS, ConsoleFilter, ignore_harmless_warnings
from pipeline.errors import ConfigError

TAMIS = Path(sys.executable).parent / "tamis"
# Lines other libraries print at INFO or as deprecation notices, which the default output must not hold.
LIBRARY_CHATTER = re.compile(r"Loading faiss|loaded faiss|swigfaiss|FutureWarning|\[transformers\]|bitsandbytes"
                             r"|kernels-community|Beginning flow run|Finished in state|Starting temporary server")


def record(name: str, level: int, msg: str, exc: BaseException | None = None,
           path: str = "/site-packages/lib/module.py") -> logging.LogRecord:
    exc_info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord(name, level, path, 1, msg, None, exc_info)


@pytest.mark.parametrize(("name", "level", "msg", "shown"), [
    ("pipeline.data.ingest", logging.INFO, "ingest: reading jsonl source", True),
    ("flows.round", logging.DEBUG, "round details", True),  # tamis's level is set on its loggers, not here
    ("faiss.loader", logging.INFO, "Loading faiss with AVX512 support.", False),
    ("prefect.flow_runs", logging.INFO, "Beginning flow run 'x' for flow 'prepare'", False),
    ("faiss.loader", logging.WARNING, "something faiss thinks is wrong", True),
    ("bitsandbytes.backends.cpu.ops", logging.WARNING,
     "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'.", False),
    ("bitsandbytes.backends.cpu.ops", logging.WARNING, "a different bitsandbytes warning", True),
    ("prefect.flow_runs", logging.ERROR, "Encountered exception during execution: RuntimeError('boom')", True),
])
def test_console_filter_keeps_tamis_and_library_warnings(name, level, msg, shown):
    assert ConsoleFilter().filter(record(name, level, msg)) is shown


def test_console_filter_keeps_tamis_lines_sent_through_prefects_run_logger():
    round_py = str(Path(cli_logging.__file__).parent.parent / "round.py")  # get_run_logger().info(...) in labeling_round
    assert ConsoleFilter().filter(record("prefect.flow_runs", logging.INFO, "labeling round for the demo config",
                                         path=round_py))


def test_console_filter_leaves_ui_only_progress_lines_to_the_prefect_ui():
    # A progress update goes to the run's logs in the UI; the terminal already shows the same step in its bar.
    ui_py = str(Path(cli_logging.__file__).parent.parent / "ui.py")
    update = record("prefect.task_runs", logging.INFO, "training-progress: 20% — step 20 / 100", path=ui_py)
    assert ConsoleFilter().filter(update)
    setattr(update, cli_logging.UI_ONLY, True)
    assert not ConsoleFilter().filter(update)


def test_console_filter_drops_library_tracebacks_of_tamis_user_errors():
    # `run` prints a TamisError as one paragraph; Prefect's copy of it, with a traceback, adds nothing.
    user_error = record("prefect.flow_runs", logging.ERROR, "Encountered exception during execution",
                        ConfigError("preprocess.size is not set"))
    crash = record("prefect.flow_runs", logging.ERROR, "Encountered exception during execution", RuntimeError("x"))
    assert not ConsoleFilter().filter(user_error)
    assert ConsoleFilter().filter(crash)


def test_harmless_warnings_are_ignored_and_others_still_shown():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ignore_harmless_warnings()
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning,
                      stacklevel=1)
        warnings.warn("Failed to load CPU gemm_4bit_forward from kernels-community: no kernels", UserWarning,
                      stacklevel=1)
        warnings.warn("`some_other_api` is deprecated", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["`some_other_api` is deprecated"]
    assert all(h.logger or h.category for h in HARMLESS)


@pytest.fixture
def project(tmp_path, prefect_harness) -> tuple[Path, dict[str, str]]:
    """A 20-digit project config and an environment that points the subprocesses at the session's Prefect server
    (each would otherwise start its own, 20-36 s here) and keeps Rich from wrapping lines."""
    from prefect.settings import get_current_settings

    digits = tmp_path / "digits"
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "paths": {"artifacts": str(tmp_path / "art")},
        "data": {"sources": [{"kind": "jsonl", "path": str(digits / "manifest.jsonl")}]},
        "preprocess": {"size": 32, "num_proc": 1},
    }))
    env = {**os.environ, "PREFECT_API_URL": str(get_current_settings().api.url), "COLUMNS": "200"}
    env.pop("TAMIS_DEBUG", None)
    return config, env


def tamis(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(TAMIS), *args], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_demo_data_and_prepare_print_no_library_chatter(project):
    config, env = project
    data = tamis("demo-data", "--out", str(config.parent / "digits"), "--limit", "20", env=env)
    assert "wrote 20 digit images" in data.stdout and "demo digits: 20 images" in data.stderr
    assert not LIBRARY_CHATTER.search(data.stderr), data.stderr

    prep = tamis("prepare", "--config", str(config), env=env)  # imports faiss and runs Prefect flows
    assert "ingest: 20 image files looked up, 20 read" in prep.stderr  # tamis's own INFO lines stay
    assert not LIBRARY_CHATTER.search(prep.stderr), prep.stderr
    assert "warn" not in prep.stderr.lower(), prep.stderr

    # Nothing changed since: the same table, no flow. A project of its own makes the debug run do the work again.
    again = tamis("prepare", "--config", str(config), env=env)
    assert "nothing changed since the last prepare" in again.stdout and "Beginning flow run" not in again.stderr
    fresh = config.with_name("fresh.yaml")
    fresh.write_text(config.read_text().replace(str(config.parent / "art"), str(config.parent / "art-debug")))
    debug = tamis("--debug", "prepare", "--config", str(fresh), env=env)
    assert "Loading faiss" in debug.stderr  # --debug still shows the libraries' INFO lines
    assert "Beginning flow run" in debug.stderr


@pytest.mark.parametrize("debug", [False, True])
def test_library_progress_bars_only_with_debug(debug):
    code = (f"from flows.cli.logs import configure_logging; configure_logging({debug}); import datasets; "
            "datasets.Dataset.from_dict({'a': [1, 2, 3]}).map(lambda r: r)")
    env = {k: v for k, v in os.environ.items() if not k.endswith("DISABLE_PROGRESS_BARS")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert ("Map" in done.stderr) is debug, done.stderr
