"""The written record of a finished round, in the order a crash needs: the metrics so far, the label check's table,
the learning curve and the per-class results, then summary.md and round.json (which marks the round finished), then
report.html, a view that never fails the round. The flow hands what it returns to the Prefect UI."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.labelcheck import check_report_markdown
from pipeline.metrics import learning_curve, read_metrics, round_curve_png
from pipeline.perclass import EvalReport, load_eval_report
from pipeline.report import summary_markdown
from pipeline.round.plan import RoundPlan
from pipeline.round.records import write_round
from pipeline.round_state import RoundState
from pipeline.roundreport.build import RoundReport, try_round_report
from pipeline.roundreport.sources import ReportSources


@dataclass(frozen=True)
class WriteUp:
    """What the round wrote, for the UI: the metrics log, the label check's markdown, the curve's PNG, the
    evaluation's per-class report and the round's report (None where the round has none)."""

    metrics_rows: list[dict[str, Any]]
    label_report: str
    curve: Path | None
    evaluation: EvalReport | None
    round_report: RoundReport | None


def write_up(artifacts: str | os.PathLike[str], answers: Sequence[str] | None, plan: RoundPlan, state: RoundState,
             check: Mapping[str, Any] | None, *, resolve: Callable[[], ReportSources]) -> WriteUp:
    """Write the round's summary.md, round.json and report.html (`check`: the label check's ref or None; `resolve`:
    the report's sources, resolve_sources on the project, called once round.json is written)."""
    rows = read_metrics(artifacts)
    label_report = check_report_markdown(check)
    curve = learning_curve(artifacts, rows, answers=answers)
    # The report's curve stops at this round: the picture just drawn, unless a later round is logged (a rerun).
    report_curve = round_curve_png(rows, state.round, answers=answers, drawn=curve)
    evaluation = load_eval_report(state.eval_dir)  # per-class metrics and the confusion matrix
    # The file keeps the PNG's path (a data URI would make summary.md unreadable as text); the UI gets the picture.
    write_round(plan, state, summary_markdown(state, rows, label_report, curve_path=curve, evaluation=evaluation))
    return WriteUp(rows, label_report, curve, evaluation,
                   try_round_report(resolve, state, report_curve))
