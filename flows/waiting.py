"""A deployed round that waits for its annotators: the form it suspends with, and what the run knows about itself.

Suspended, a run holds no process, no worker slot and no lock; resumed, its worker starts it again from the top and
it finds its pause key (`resumed()`), so it skips straight to the labels.
"""

from __future__ import annotations

from typing import Any

from prefect.input import RunInput
from pydantic import Field

from pipeline.config import ProjectConfig, load_config
from pipeline.report import run_name, state_message
from pipeline.round.stop import should_wait
from pipeline.round_state import RoundState, completed_rounds

WAIT_KEY = "labels-in"  # the round's one suspension: a resumed run finds it among its pause keys


class LabelsIn(RunInput):
    """The form a round waiting for its annotators shows in the Prefect UI (and `tamis resume` fills in)."""

    labels_in_inbox: bool = Field(default=True, title="The labels are in the inbox",
                                  description="The annotators' export is in artifacts/inbox/ (or give its path below).")
    labels_file: str = Field(default="", title="Annotators' export file",
                             description="Path, on the worker's machine, of a Label Studio JSON export or a CSV / "
                                         "JSONL with sample_id,label, inside the artifacts folder or "
                                         "rounds.labels_from; copied into the inbox. Empty: use the inbox.")
    note: str = Field(default="", title="Note", description="Written to the run's log.")


def first_name() -> str:
    """The name a run starts with: the round after the last finished one (renamed once the labels are counted)."""
    from prefect.runtime import flow_run

    try:
        done = completed_rounds(load_config(flow_run.parameters.get("config_path")).artifacts)
    except Exception:  # a bad config fails the run itself, with its message; the name must not fail first
        return run_name(None)
    return run_name(done[-1].round + 1 if done else 0)


def resumed() -> bool:
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return ctx is not None and WAIT_KEY in (ctx.flow_run.empirical_policy.pause_keys or set())


def deployed() -> bool:
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return ctx is not None and ctx.flow_run.deployment_id is not None


def waits_for_labels(cfg: ProjectConfig, state: RoundState) -> bool:
    return should_wait(cfg.rounds, state, deployed=deployed())


def final(state: RoundState) -> Any:
    """The run's final state, whose message the runs list shows: what the round did or why it stopped; its data is
    round.json's object (a plain JSON result)."""
    from prefect.states import Completed

    return Completed(message=state_message(state), data=state.to_json())
