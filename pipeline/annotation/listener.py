"""The trigger loop of `tamis listen`: pending webhook events → the decision (webhooks.decide) → a round, one at a
time, and what happens when a round cannot run or leaves labels behind (the retry policy).

The loop knows no Prefect: it is handed how to run a round and how to resume a suspended one (the CLI passes the
labeling-round flow and Prefect's resume), so every rule below is tested with plain functions.

- another round holds the project lock: look again in LOCK_RETRY_S, the trigger stays queued (once);
- the round failed: its labels stay pending, the next try after rounds.trigger.retry_s;
- the round's pull failed (Label Studio down): the labels it started for are tried again after retry_s;
- the round's pull reached Label Studio but did not import them (deleted or edited while the receiver was down):
  they are retired, so they stop starting a round every retry_s for ever;
- with rounds.wait_for_labels, a deployed round suspended for these labels is resumed instead of run here, and
  nothing else starts for retry_s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.annotation.webhooks import (
    EventQueue,
    Pending,
    current_batch,
    decide,
    pending,
    pulled_keys,
    retire,
    retired_keys,
    stale_after,
)
from pipeline.config import AnnotateConfig, RoundsConfig, TriggerConfig
from pipeline.errors import ConfigError, LockError
from pipeline.round_state import RoundState, completed_rounds

log = logging.getLogger(__name__)

POLL_S = 30.0  # the loop looks again at least this often (a round started by hand changes what is pending)
LOCK_RETRY_S = 10.0  # another round holds the project lock: look again this soon, the trigger stays queued (once)


def listen_trigger(rounds: RoundsConfig, annotate: AnnotateConfig, command: str) -> TriggerConfig:
    """rounds.trigger, refused (naming `command` and the fix) when it or the Label Studio project it pulls from is
    not configured."""
    if rounds.trigger is None:
        raise ConfigError(f"`tamis {command}`: rounds.trigger is not set in the config; add e.g. `rounds: {{trigger: "
                          "{batch_complete: true}}}` (docs/webhooks.md)")
    if annotate.label_studio is None:
        raise ConfigError(f"`tamis {command}`: annotate.label_studio is not set; the rounds it starts pull their "
                          "labels from a Label Studio project: add {url, project, token_env}")
    return rounds.trigger


class TriggerLoop:
    """One project's loop. `run_round()` runs the next round and returns its state (it may raise LockError while
    another round runs); `resume(note)` resumes this project's deployed round suspended for its labels and returns
    its name, or None when none waits."""

    def __init__(self, trigger: TriggerConfig, artifacts: str | Path, *, run_round: Callable[[], RoundState],
                 resume: Callable[[str], str | None], wait_for_labels: bool = False):
        self.trigger, self.artifacts = trigger, artifacts
        self.run_round, self.resume, self.wait_for_labels = run_round, resume, wait_for_labels
        self.queue = EventQueue(artifacts)
        self.wake = threading.Event()  # set by the receiver on each event: look now
        self.retry_at: float | None = None
        self.rounds_started = 0

    def pending(self) -> Pending:
        states = completed_rounds(self.artifacts)
        last = states[-1] if states else None
        events = self.queue.readable()  # an event it cannot fold is parked in dead-letter.jsonl, never fatal
        done = pulled_keys(self.artifacts, {e.get("project") for e in events}) | retired_keys(self.artifacts)
        return pending(events, done, current_batch(self.artifacts, last), stopped=last and last.stopped)

    def step(self) -> float | None:
        """Decide once and run the round when due; the seconds to wait before the next look (None: look again now)."""
        p = self.pending()
        d = decide(self.trigger, p, now=time.time(), retry_at=self.retry_at)
        if not d.start:
            log.debug("no round yet: %s", d.reason)
            return POLL_S if d.wake_at is None else max(0.05, min(POLL_S, d.wake_at - time.time()))
        log.info("starting the next round: %s", d.reason)
        self.retry_at = None
        self.rounds_started += 1
        if self.wait_for_labels and self._resumed(d.reason):
            return None
        try:
            state = self.run_round()
        except LockError as exc:  # a round by hand or by cron is running: this trigger waits for it, once
            log.info("%s; looking again in %.0f s", exc, LOCK_RETRY_S)
            self.retry_at = time.time() + LOCK_RETRY_S
            return None
        except Exception:  # noqa: BLE001 - a failed round must not end the listener; the labels stay pending
            log.exception("the round failed; its labels stay pending, next try in %.0f s (rounds.trigger.retry_s)",
                          self.trigger.retry_s)
            self.retry_at = time.time() + self.trigger.retry_s
            return None
        log.info("round %s finished: %s selected, export %s", state.round, state.selected, state.export_dir)
        self._after_round(state, p.new & self.pending().new)
        return None

    def _after_round(self, state: RoundState, left: frozenset[str]) -> None:
        """Labels the round started for but did not import: retried after retry_s when its pull failed (Label Studio
        down), retired when the pull reached Label Studio (deleted or edited again while the receiver was down)."""
        if not left:
            return
        if stale := stale_after(state.imports, left):
            log.warning("%d labels the round started for are no longer in Label Studio as announced (deleted or "
                        "edited while the receiver was down); they stop counting as new (%s)", len(stale),
                        ", ".join(sorted(stale)[:5]))
            retire(self.artifacts, stale)
            return
        log.warning("%d labels the round started for are still not imported (the pull failed); next try in %.0f s",
                    len(left), self.trigger.retry_s)
        self.retry_at = time.time() + self.trigger.retry_s

    def _resumed(self, reason: str) -> bool:
        """A deployed round suspended for these labels is resumed on its worker (and shows in the UI as resumed);
        meanwhile nothing else starts for retry_s, unless its pull takes the labels first."""
        try:
            name = self.resume(f"tamis listen: {reason}")
        except Exception as exc:  # noqa: BLE001 - the server is unreachable: run the round here instead
            log.warning("could not look for a suspended round to resume (%s); running the round here", exc)
            return False
        if name is None:
            return False
        log.info("resumed %s, suspended waiting for these labels; its worker runs the round", name)
        self.retry_at = time.time() + self.trigger.retry_s
        return True

    def run(self, stop: threading.Event) -> None:
        """Look, run, wait, until `stop` is set (a receiver's event cuts a wait short through `wake`)."""
        while not stop.is_set():
            wait = self.step()
            if wait is not None:
                self.wake.wait(wait)
                self.wake.clear()
