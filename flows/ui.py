"""What a run shows in the Prefect UI besides its tasks: its name and tags, keyed progress bars, the library's log
lines. Each helper is a no-op outside a flow run, so library tests and plain calls work without a server."""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from flows.cli.logs import HARMLESS, UI_ONLY
from pipeline.round_state import RoundState

if TYPE_CHECKING:
    from pipeline.report import RoundProgress
    from pipeline.roundreport.writeup import WriteUp

# The library's loggers (all under `pipeline`) and Python warnings (`py.warnings` once captured) reach a run's logs.
UI_LOGGERS = ("pipeline", "py.warnings")


def _run_context() -> Any:
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return ctx if ctx is not None and ctx.flow_run is not None else None


def name_run(index: int, *, rerun: bool, stopped: bool = False, waiting: bool = False) -> None:
    """Name the current flow run after round `index` and set the round's tags (pipeline.report.run_name / run_tags);
    kept: the deployment's tags and earlier rounds' numbers (a resumed run did two rounds), dropped: the flags of the
    round before (`waiting-for-labels`, …)."""
    from prefect import get_client

    from pipeline.report import ROUND_FLAGS, run_name, run_tags

    ctx = _run_context()
    if ctx is None:
        return
    name, tags = run_name(index, rerun=rerun), run_tags(index, rerun=rerun, stopped=stopped, waiting=waiting)
    merged = list(dict.fromkeys([*(t for t in ctx.flow_run.tags or [] if t not in ROUND_FLAGS), *tags]))
    with get_client(sync_client=True) as client:
        client.update_flow_run(ctx.flow_run.id, name=name, tags=merged)
    ctx.flow_run.name, ctx.flow_run.tags = name, merged


def progress_sink(key: str, description: str) -> Callable[[float, str], None]:
    """A keyed progress artifact (its own entry on the Artifacts page, newest version on top) → `sink(percent,
    text)`; the text goes to the run's log, since a progress artifact shows only its first description."""
    from prefect import get_run_logger
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    if _run_context() is None:
        return lambda percent, text: None
    artifact_id = create_progress_artifact(progress=0.0, key=key, description=description)
    logger = get_run_logger()

    def sink(percent: float, text: str) -> None:
        update_progress_artifact(artifact_id, progress=percent, description=f"{description}: {text}")
        logger.info("%s: %.0f%% — %s", key, percent, text, extra={UI_ONLY: True})

    return sink


class HarmlessFilter(logging.Filter):
    """The known-harmless third-party warnings (flows/cli/logs.HARMLESS) stay out of the UI as out of the CLI."""

    def __init__(self) -> None:
        super().__init__()
        self._patterns = [re.compile(h.pattern) for h in HARMLESS]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.search(message) for p in self._patterns)


@contextlib.contextmanager
def library_logs_to_ui(level: int = logging.INFO) -> Iterator[None]:
    """Send the library's records at `level` and above and Python warnings to the current run's logs (Prefect sends
    only its own loggers and those named in PREFECT_LOGGING_EXTRA_LOGGERS); undone on exit."""
    if _run_context() is None:
        yield
        return
    from prefect.logging.handlers import APILogHandler

    handler = APILogHandler()
    handler.setLevel(level)
    handler.addFilter(HarmlessFilter())
    loggers = [logging.getLogger(n) for n in UI_LOGGERS]
    # Already sent by Prefect's own handler (PREFECT_LOGGING_EXTRA_LOGGERS names it): do not send twice.
    mine = [lg for lg in loggers if not any(isinstance(h, APILogHandler) for h in lg.handlers)]
    lib = logging.getLogger("pipeline")
    old_level = lib.level
    if lib.getEffectiveLevel() > level:
        lib.setLevel(level)
    captured = logging.captureWarnings  # records warnings.warn as py.warnings log records
    captured(True)
    for lg in mine:
        lg.addHandler(handler)
    try:
        yield
    finally:
        for lg in mine:
            lg.removeHandler(handler)
        captured(False)
        lib.setLevel(old_level)


def detach(value: Any) -> Any:
    """A plain copy of a run's result. Prefect links a result object to the run that returned it (by `id`), and a
    linked object passed to a task becomes a `flow_run` task input when that run is a subflow; the Prefect UI's
    Task Runs tab (V1) refuses such an input ("Invalid TaskInputResponse") and lists no task at all.

    The links of `value` and its items (Prefect links one layer deep) are dropped too: a plain dict or list is linked
    by its bare `id`, so once the original is freed, any new list a flow builds at its address (the select stage's
    typed shard refs) would be taken for the subflow's result."""
    from prefect.context import FlowRunContext

    plain = json.loads(json.dumps(value))
    if (ctx := FlowRunContext.get()) is not None:
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else ()
        for obj in (value, *items):
            ctx.run_results.pop(id(obj), None)
    return plain


def publish_round(artifacts: Any, state: RoundState, up: WriteUp, progress: RoundProgress, *, waiting: bool,
                  rerun: bool) -> None:
    """The round in the Prefect UI: its summary (with the curve, the batch's contact sheet and the confusion matrix
    inline, and where the round's report.html is), the curve, the export hand-off, the progress bar's last line and
    the run's name and tags. `up`: what the round wrote."""
    from prefect.artifacts import create_image_artifact, create_markdown_artifact

    from pipeline import report
    from pipeline.annotation import export

    name_run(state.round, rerun=rerun, stopped=state.stopped, waiting=waiting)  # first: the run list shows the round
    curve = up.curve
    uri = report.png_data_uri(curve) if curve else None
    confusion = up.evaluation.confusion_png if up.evaluation is not None else None
    batch = getattr(up.round_report, "batch_png", None)
    create_markdown_artifact(key="round-summary", description=f"Labeling round {state.round}",
                             markdown=report.summary_markdown(
                                 state, up.metrics_rows, up.label_report, curve_uri=uri, curve_path=curve,
                                 evaluation=up.evaluation, confusion_uri=report.png_data_uri(confusion) if confusion
                                 else None, batch_uri=report.png_data_uri(batch) if batch else None,
                                 report_path=getattr(up.round_report, "html", None)))
    if uri:
        create_image_artifact(key="learning-curve", image_url=uri,
                              description=f"Learning curve after round {state.round} ({curve})")
    if state.export_dir:
        create_markdown_artifact(key="export-folder", description=f"Round {state.round} export: where it is, how "
                                 "to hand it off", markdown=report.handoff_markdown(
                                     state.export_dir, artifacts=artifacts, round_index=state.round,
                                     count=state.selected_count, tasks_file=export.TASKS_FILE,
                                     label_config_file=export.LABEL_CONFIG_FILE, csv_file=export.CSV_FILE,
                                     waiting=waiting))
    progress.complete(report.state_message(state))
