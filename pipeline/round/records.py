"""What a round's state records of its stages (selection, re-label queue, evaluation, label check), and what a
finished round leaves behind: summary.md, then round.json last.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pipeline.config import LabelCheckConfig
from pipeline.round.plan import RoundPlan
from pipeline.round_state import ROUND_FILE, LabelCheckRecord, RoundState
from pipeline.store import atomic_write_json, atomic_write_text

SUMMARY_FILE = "summary.md"  # the round-summary artifact, also readable without the Prefect UI


def write_round(plan: RoundPlan, state: RoundState, summary: str) -> None:
    """summary.md, then round.json last: round.json is what marks the round finished."""
    atomic_write_text(plan.dir / SUMMARY_FILE, summary + "\n")
    atomic_write_json(plan.dir / ROUND_FILE, state.to_json())


def record_selection(state: RoundState, sel: Mapping[str, Any], exp: Mapping[str, Any]) -> None:
    """The round state's fields from its select and export references: what the summary, `tamis status` and the
    waiting form read (a phase's label replaces the configured strategy's)."""
    from pipeline.strategies.schedule import phase_label

    if "label_studio" in exp:
        state.label_studio = exp["label_studio"]
    state.selected, state.export_dir, state.selection_dir = sel["n"], exp["dir"], sel["dir"]
    state.outliers, state.phase, state.embeddings = sel.get("outliers"), sel.get("phase"), sel.get("embeddings")
    state.cost = sel.get("cost")
    if sel.get("round_strategy"):  # the select stage's own name for it (the same strategy_label)
        state.strategy = sel["round_strategy"]
    elif sel.get("phase"):
        state.strategy = phase_label(sel["phase"])
    if sel.get("candidates"):
        state.candidates = sel["candidates"]


def relabels(labelcheck: LabelCheckConfig, check: Mapping[str, Any] | None) -> bool:
    """Whether the round queues its likely label errors for re-labeling: a label check ran, labelcheck.relabel_top_n."""
    return check is not None and bool(labelcheck.relabel_top_n)


def record_relabel(state: RoundState, rel: Mapping[str, Any]) -> None:
    """The re-label queue in the round's state ({"count", "dir", "label_studio"?} from flows/labelcheck.relabel_ref)."""
    state.relabel = rel["count"]
    if rel["count"]:
        state.relabel_dir = rel["dir"]
    if "label_studio" in rel:
        state.label_studio_relabel = rel["label_studio"]


def record_evaluation(artifacts: str | os.PathLike[str], plan: RoundPlan, state: RoundState,
                      ev: Mapping[str, Any]) -> None:
    """The adapter's test metrics and evaluation folder in the state, and booked on the learning curve."""
    from pipeline.metrics import book_metrics

    state.metrics, state.eval_dir = ev["metrics"], ev["dir"]
    book_metrics(artifacts, round_index=plan.index, labels=len(plan.labels), metrics=ev["metrics"],
                 strategy=state.strategy, intervals=ev.get("intervals"))


LABEL_CHECK_KEYS = ("dir", "method", "checked", "issues", "abstained", "oos_accuracy", "expected_false_alarms",
                    "message")  # what round.json keeps of the label check's reference


def label_check_record(check: Mapping[str, Any] | None) -> LabelCheckRecord | None:
    """The label check's summary as round.json keeps it (LABEL_CHECK_KEYS); None when no check ran."""
    return None if check is None else LabelCheckRecord(**{k: check.get(k) for k in LABEL_CHECK_KEYS})
