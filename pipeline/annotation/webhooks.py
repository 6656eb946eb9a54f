"""Label Studio's webhook events as a durable queue, and the pure decision of when they start the next round.

The receiver (pipeline/annotation/webhook_server.py) appends each annotation event, reduced to what the decision
reads, to artifacts/webhooks/events.jsonl and fsyncs it before it answers; a delivery seen before (same action, same
annotation, same content) is not appended again, so Label Studio's duplicates and a replay change nothing.

What is "new" is not an offset into that file but Label Studio's own pull state: an annotation is new until the
round's pull has imported it (artifacts/label_studio/project-<id>/pulled.json holds the same annotation keys the
events carry). So a restart, an event that arrives while a round runs, or a round started by hand or by cron in
between needs no bookkeeping here: whatever a round pulled stops counting.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.annotation.counted import instant
from pipeline.annotation.export import TASKS_FILE
from pipeline.annotation.label_studio import PULL_FAILED, annotation_key, pulled_path, task_set_name
from pipeline.config import TriggerConfig
from pipeline.round_state import RoundState
from pipeline.store import append_jsonl, atomic_write_text, digest_json, read_jsonl

log = logging.getLogger(__name__)

WEBHOOK_DIR = "webhooks"
EVENTS_FILE = "events.jsonl"
DEAD_LETTER_FILE = "dead-letter.jsonl"  # queued events the loop cannot read: parked here, never retried
RETIRED_FILE = "retired.json"  # annotation keys a successful pull could not import (deleted, superseded)
MAX_ID = 2**63 - 1  # Label Studio's IDs are 64-bit database keys
CREATED, UPDATED, DELETED = "ANNOTATION_CREATED", "ANNOTATION_UPDATED", "ANNOTATIONS_DELETED"
ACTIONS = (CREATED, UPDATED, DELETED)


def events_path(artifacts: str | Path) -> Path:
    return Path(artifacts) / WEBHOOK_DIR / EVENTS_FILE


# ------------------------------------------------------------------------------------------------------ events
def _id(value: Any, what: str) -> int:
    """A Label Studio ID: a JSON integer in 0..2**63-1 (a float, a bool, a string or a list is refused)."""
    if type(value) is not int or not 0 <= value <= MAX_ID:
        raise ValueError(f"{what} must be an integer ID in 0..{MAX_ID}, got {_show(value)}")
    return value


def _optional(value: Any, types: tuple[type, ...], what: str) -> Any:
    """A field that may be absent (None) or one of `types` (bool is never an int here)."""
    if value is None or (isinstance(value, types) and not isinstance(value, bool)):
        return value
    raise ValueError(f"{what} must be {' or '.join(t.__name__ for t in types)} or absent, got {_show(value)}")


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return f"{type(value).__name__} {text[:40]}{'…' if len(text) > 40 else ''}"


def parse_event(payload: Any, received: float) -> dict[str, Any] | None:
    """One webhook body as a queue record, or None for an action the loop does not read (still acknowledged).

    Raises ValueError for a body that is not a Label Studio annotation event, field types included (an ID that is
    not an integer, a list where a name belongs): the receiver answers 400 and queues nothing, so the loop never
    meets a record it cannot fold.
    """
    if not isinstance(payload, Mapping) or not isinstance(payload.get("action"), str):
        raise ValueError("not a Label Studio webhook: a JSON object with an 'action' is expected")
    action = payload["action"]
    if action not in ACTIONS:
        return None
    project = payload.get("project")
    project = project.get("id") if isinstance(project, Mapping) else project
    project = None if project is None else _id(project, "project (or project.id)")
    if action == DELETED:
        anns = payload.get("annotations")
        if not isinstance(anns, list) or not all(isinstance(a, Mapping) and "id" in a for a in anns):
            raise ValueError(f"{action}: 'annotations' must be a list of objects with an 'id'")
        record = {"action": action, "project": project,
                  "deleted": sorted(_id(a["id"], "annotations[].id") for a in anns)}
    else:
        ann, task = payload.get("annotation"), payload.get("task")
        if not isinstance(ann, Mapping) or "id" not in ann or not isinstance(task, Mapping):
            raise ValueError(f"{action}: 'annotation' (with an 'id') and 'task' objects are expected")
        data = task.get("data") if isinstance(task.get("data"), Mapping) else {}
        record = {"action": action, "project": project, "annotation": _id(ann["id"], "annotation.id"),
                  # the pull's own key for this annotation's content: "imported yet?" is a set look-up
                  "ann_key": annotation_key(ann),
                  "updated_at": _optional(ann.get("updated_at"), (str,), "annotation.updated_at") or "",
                  "task": None if task.get("id") is None else _id(task["id"], "task.id"),
                  "sample_id": _optional(data.get("sample_id"), (str, int), "task.data.sample_id"),
                  "tamis_set": _optional(data.get("tamis_set"), (str,), "task.data.tamis_set")}
    # The delivery key: the same event delivered twice (or replayed) is the same record; an edit is a new one.
    record["key"] = digest_json(record)[:24]
    record["received"] = received
    return record


def record_problem(e: Any) -> str | None:
    """Why a queued record cannot be folded (a line written by an older receiver, or by hand); None when it can."""
    try:
        if not isinstance(e, Mapping) or e.get("action") not in ACTIONS:
            return "not an annotation event record"
        if type(e.get("received")) not in (int, float) or not math.isfinite(e["received"]):
            return f"'received' must be a number, got {_show(e.get('received'))}"
        _optional(e.get("project"), (int,), "project")
        if e["action"] == DELETED:
            if not isinstance(e.get("deleted"), list):
                return f"'deleted' must be a list of IDs, got {_show(e.get('deleted'))}"
            for i in e["deleted"]:
                _id(i, "deleted[]")
            return None
        _id(e.get("annotation"), "annotation")
        for field in ("ann_key", "updated_at"):
            if not isinstance(e.get(field), str):
                return f"{field!r} must be a string, got {_show(e.get(field))}"
        _optional(e.get("sample_id"), (str, int), "sample_id")
        _optional(e.get("tamis_set"), (str,), "tamis_set")
    except ValueError as exc:
        return str(exc)
    return None


class EventQueue:
    """artifacts/webhooks/events.jsonl: append-only, fsynced per event, deduplicated by delivery key."""

    def __init__(self, artifacts: str | Path):
        self.path = events_path(artifacts)
        self.dead_letter = self.path.with_name(DEAD_LETTER_FILE)
        self._lock = threading.Lock()
        self._keys = {k for e in read_jsonl(self.path) if isinstance(k := e.get("key"), str)}

    def append(self, record: Mapping[str, Any]) -> bool:
        """Write the event durably; False (and nothing written) when its delivery key is already in the queue."""
        with self._lock:
            if record["key"] in self._keys:
                return False
            append_jsonl(self.path, [record])  # fsynced: once this returns, a crash cannot lose it
            self._keys.add(record["key"])
            return True

    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path)

    def readable(self) -> list[dict[str, Any]]:
        """The events the loop can fold. One it cannot (a wrong type in an old line) is parked once in
        dead-letter.jsonl with its reason and a log line, and skipped from then on: it can never stop the loop."""
        good, bad = [], []
        for e in self.events():
            problem = record_problem(e)
            if problem is None:
                good.append(e)
            else:
                bad.append((e, problem))
        if bad:
            self._park(bad)
        return good

    def _park(self, bad: list[tuple[dict[str, Any], str]]) -> None:
        parked = {d.get("digest") for d in read_jsonl(self.dead_letter)}
        new = [{"digest": digest_json(e), "reason": why, "parked_at": time.time(), "event": e} for e, why in bad]
        new = [d for d in new if d["digest"] not in parked]
        for d in new:
            log.warning("%s: an event the trigger cannot read is parked in %s and skipped: %s", self.path,
                        self.dead_letter, d["reason"])
        append_jsonl(self.dead_letter, new)


# ---------------------------------------------------------------------------------------------- what is pending
def current_batch(artifacts: str | Path, state: RoundState | None) -> set[tuple[str, str]]:
    """The (sample_id, task set) pairs the last finished round sent out: its export and its re-label tasks."""
    out: set[tuple[str, str]] = set()
    for folder in (state.export_dir, state.relabel_dir) if state else ():
        tasks = Path(folder) / TASKS_FILE if folder else None
        if tasks is None or not tasks.is_file():
            continue
        name = task_set_name(artifacts, folder)
        out |= {(str(t["data"]["sample_id"]), name) for t in json.loads(tasks.read_text(encoding="utf-8"))}
    return out


def pulled_keys(artifacts: str | Path, projects: Iterable[Any]) -> set[str]:
    """The annotation keys the rounds' pulls imported from these Label Studio projects."""
    out: set[str] = set()
    for pid in {p for p in projects if isinstance(p, int)}:
        path = pulled_path(artifacts, pid)
        if path.is_file():
            out |= set(json.loads(path.read_text(encoding="utf-8")))
    return out


def retired_path(artifacts: str | Path) -> Path:
    return Path(artifacts) / WEBHOOK_DIR / RETIRED_FILE


def retired_keys(artifacts: str | Path) -> set[str]:
    """Annotation keys a round's pull (which reached Label Studio) could not import: the annotation was deleted, or
    edited again, while the receiver was down. They no longer count as new."""
    path = retired_path(artifacts)
    return set(json.loads(path.read_text(encoding="utf-8"))) if path.is_file() else set()


def retire(artifacts: str | Path, keys: Iterable[str]) -> None:
    atomic_write_text(retired_path(artifacts), json.dumps(sorted(retired_keys(artifacts) | set(keys)), indent=0) + "\n")


def stale_after(imports: Iterable[Mapping[str, Any]], left: set[str] | frozenset[str]) -> set[str]:
    """Of the labels a round started for and left unimported, those to retire: all of them when its pull reached
    Label Studio (what it did not import is gone or superseded there, and would start a round every retry_s for
    ever), none when the pull failed (Label Studio down: they wait for a retry)."""
    return set() if any(i.get(PULL_FAILED) for i in imports) else set(left)



@dataclass(frozen=True)
class Pending:
    """What the events say now: annotations not imported yet, and how much of the batch is annotated."""

    new: frozenset[str]  # annotation keys (content included) no round has pulled yet
    batch: int  # tasks in the last round's batch
    batch_left: int  # of them, tasks without a live annotation
    last_event: float | None  # when the newest annotation event arrived (time.time())
    stopped: str | None = None  # the last round's stop reason: no round starts after it


def pending(events: Iterable[Mapping[str, Any]], pulled: set[str], batch: set[tuple[str, str]],
            stopped: str | None = None) -> Pending:
    """Fold the events, in any order: per annotation its newest version (Label Studio's updated_at as an instant, then
    arrival) counts, and a deleted annotation stays deleted (Label Studio never reuses an ID)."""
    latest: dict[int, Mapping[str, Any]] = {}
    deleted: set[int] = set()
    last = None
    for e in events:
        last = e["received"] if last is None else max(last, e["received"])
        if e["action"] == DELETED:
            deleted.update(e["deleted"])
            continue
        have = latest.get(e["annotation"])
        if have is None or (instant(e["updated_at"]), e["received"]) >= (instant(have["updated_at"]),
                                                                          have["received"]):
            latest[e["annotation"]] = e
    live = [e for a, e in latest.items() if a not in deleted]
    done = {(str(e["sample_id"]), e["tamis_set"]) for e in live}
    return Pending(new=frozenset(e["ann_key"] for e in live) - pulled, batch=len(batch),
                   batch_left=len(batch - done), last_event=last, stopped=stopped)


# ------------------------------------------------------------------------------------------------- the decision
@dataclass(frozen=True)
class Decision:
    start: bool
    reason: str  # the sentence the listener logs
    wake_at: float | None = None  # when the answer may change without a new event (a quiet period or a retry ends)


def decide(trigger: TriggerConfig, p: Pending, *, now: float, retry_at: float | None = None) -> Decision:
    """Whether the next round starts now. Pure: the listener calls it after each event and at `wake_at`.

    `retry_at`: set by the listener after a round that left these labels unimported (Label Studio down, the round
    failed, another round held the lock); until then nothing starts, so a failing round is not retried in a loop.
    """
    if p.stopped:
        return Decision(False, f"the last round stopped ({p.stopped}); no round starts until the config changes "
                               "and a round is run by hand")
    if not p.new:
        return Decision(False, "no new labels since the last pull")
    n = len(p.new)
    if retry_at is not None and now < retry_at:
        return Decision(False, f"{n} new labels wait for a retry in {retry_at - now:.0f} s (rounds.trigger.retry_s)",
                        wake_at=retry_at)
    if trigger.batch_complete and p.batch and not p.batch_left:
        return Decision(True, f"the batch of {p.batch} tasks is fully annotated ({n} new labels)")
    if trigger.min_new_labels is not None and n >= trigger.min_new_labels:
        return Decision(True, f"{n} new labels reached rounds.trigger.min_new_labels = {trigger.min_new_labels}")
    wake_at = None
    if trigger.debounce_s is not None and p.last_event is not None:
        quiet = now - p.last_event
        if quiet >= trigger.debounce_s:
            return Decision(True, f"{n} new labels and no event for {quiet:.0f} s "
                                  f"(rounds.trigger.debounce_s = {trigger.debounce_s:g})")
        wake_at = p.last_event + trigger.debounce_s
    left = f"{p.batch_left} of the batch's {p.batch} tasks still unannotated" if p.batch else "no batch out"
    return Decision(False, f"{n} new labels; {left}", wake_at=wake_at)
