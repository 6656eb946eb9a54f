"""What the `tamis` command shows on the terminal. Only the CLI calls `configure_logging`: the library (`pipeline/`)
never configures logging or silences warnings, so a notebook or script that imports it keeps its own choices.

Default: tamis's own loggers at INFO, every other library from WARNING up, minus the few known-harmless third-party
messages listed below (each with the reason it is harmless). `--debug`: tamis at DEBUG, other libraries' INFO and
DEBUG records too, and nothing filtered, so a hidden message can always be seen again.

transformers is the exception: it prints through its own handler ("[transformers] ...", no propagation) at its own
verbosity, WARNING unless TRANSFORMERS_VERBOSITY says otherwise; its warnings about tamis's calls are fixed at the
source instead (tiny models' context length, the KV cache keyword, activation checkpointing).
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import flows
import pipeline

TAMIS_LOGGERS = ("pipeline", "flows", "tamis")
# A record with this attribute set (logging `extra`) is for the Prefect UI only: the terminal shows the same thing
# another way (a progress bar), so printing it there too would double every update.
UI_ONLY = "tamis_ui_only"
# A flow's `get_run_logger()` logs tamis's own lines under Prefect's logger name ("prefect.flow_runs", so that they
# reach the Prefect UI); the file a record was logged from tells them apart from Prefect's own.
TAMIS_SOURCES = tuple(str(Path(p).resolve().parent) + os.sep for p in (pipeline.__file__, flows.__file__))
# Chatty at DEBUG (HTTP requests, font look-ups, lock files) and never what a tamis problem is about: WARNING even in
# --debug, as before.
QUIET_IN_DEBUG = ("httpx", "httpcore", "urllib3", "PIL", "matplotlib", "filelock", "fsspec")

# Library INFO lines need no entry here: the level policy hides them. The ones users met before it:
# - faiss.loader: "Loading faiss with AVX512 support." / "Could not load library with AVX512 support due to:
#   ModuleNotFoundError(...)" / "Successfully loaded faiss." on every import of faiss (prepare, select): faiss-cpu
#   probes its CPU-specific builds, and the wheel without them falls back to the generic one, with the same results.
# - prefect: "Starting temporary server", "Beginning flow run", "Finished in state Completed()"; the Prefect UI
#   still gets them (its API handler is not this console handler).


@dataclass(frozen=True)
class Harmless:
    """A third-party message hidden by default: a log record from `logger` (or below) or a Python warning of
    `category` whose text starts with `pattern` (a regex)."""

    pattern: str
    logger: str | None = None
    category: type[Warning] | None = None


HARMLESS: tuple[Harmless, ...] = (
    # transformers 5 renamed `is_gradient_checkpointing` to `is_activation_checkpointing` and made the old property
    # warn. peft (not tamis) reads the old name in PeftModel.__init__, so the warning comes once per adapter created or
    # loaded, i.e. several times a round. The alias still returns the right value until transformers v6; peft's
    # upgrade is what removes it.
    Harmless(r"`is_gradient_checkpointing` is deprecated", category=FutureWarning),
    # bitsandbytes, on a CPU with AVX512-BF16, tries to fetch an optional fused 4-bit matmul kernel from the hub
    # (package `kernels`, repo kernels-community). tamis runs offline and does not install `kernels`, so the fetch
    # fails and bitsandbytes uses its built-in CPU 4-bit path: same numbers, somewhat slower. Sent as a log record by
    # bitsandbytes.backends.cpu.ops (0.50) and as a warnings.warn in other releases: both are listed.
    Harmless(r"Failed to load CPU gemm_4bit_forward from kernels-community", logger="bitsandbytes"),
    Harmless(r"Failed to load CPU gemm_4bit_forward from kernels-community", category=Warning),
)


def is_tamis(name: str) -> bool:
    return any(name == root or name.startswith(root + ".") for root in TAMIS_LOGGERS)


class ConsoleFilter(logging.Filter):
    """Which records reach the terminal by default: all of tamis's, other libraries' from WARNING up except the
    harmless ones, and no library's traceback of a tamis user error (`run` prints that error as one paragraph)."""

    def __init__(self, harmless: tuple[Harmless, ...] = HARMLESS) -> None:
        super().__init__()
        self._logs = [(h.logger, re.compile(h.pattern)) for h in harmless if h.logger is not None]

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, UI_ONLY, False):
            return False
        if is_tamis(record.name) or os.path.abspath(record.pathname).startswith(TAMIS_SOURCES):
            return True
        if record.levelno < logging.WARNING:
            return False
        if _is_user_error(record):
            return False
        message = record.getMessage()
        return not any(_under(record.name, name) and pattern.match(message) for name, pattern in self._logs)


def _under(name: str, root: str | None) -> bool:
    return root is not None and (name == root or name.startswith(root + "."))


def _is_user_error(record: logging.LogRecord) -> bool:
    # Prefect logs a failed flow or task run's exception with its traceback at ERROR; for a TamisError (a bad config,
    # an unreadable source) that is the same message `run` prints, plus a traceback the user does not need.
    from pipeline.errors import TamisError

    return bool(record.exc_info) and isinstance(record.exc_info[1], TamisError)


def ignore_harmless_warnings(harmless: tuple[Harmless, ...] = HARMLESS) -> None:
    """Add an "ignore" warnings filter per harmless Python warning (process-wide: call it from the CLI only)."""
    for h in harmless:
        if h.category is not None:
            warnings.filterwarnings("ignore", message=h.pattern, category=h.category)


def configure_logging(debug: bool) -> None:
    """Route every log record through one Rich handler on stderr, with the levels and filters described above."""
    from rich.console import Console
    from rich.logging import RichHandler

    # A console per invocation: it reads the terminal width (COLUMNS) now, not when this module was imported.
    handler = RichHandler(console=Console(stderr=True), show_path=debug, rich_tracebacks=debug)
    if not debug:
        # tamis shows its own progress; the libraries' bars (datasets' Map/Filter/Saving, transformers' "Loading
        # weights") would reach piped output as carriage-return lines. Both read these when they are imported,
        # which the CLI does only after this.
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        handler.addFilter(ConsoleFilter())
        ignore_harmless_warnings()
    # The root level decides for every library that sets none itself; tamis's loggers get theirs explicitly.
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(message)s",
                        handlers=[handler], force=True)
    for name in TAMIS_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if debug else logging.INFO)
    for name in QUIET_IN_DEBUG:
        logging.getLogger(name).setLevel(logging.WARNING)
