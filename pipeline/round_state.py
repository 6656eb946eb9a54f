"""A round's state: what round.json records, what the round summary, `tamis round` / `tamis status`, the Prefect UI
and the unchanged-round check read. One typed object instead of a dict of string keys; the file keeps its shape.

Library functions fill it (pipeline/round/), the flow only orders them. `from_json` reads files written by any
tamis: a key it does not know is kept as it is (and written back), a key the file lacks takes its default. Every
reader of round.json reads it here (completed_rounds, trained_round), as a RoundState, never as its JSON object.

The nested records are TypedDicts: the JSON objects the stages return, named with the keys their readers read, so
round.json (and every cache key built from a record, such as a warm start's adapter) keeps its bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypedDict

from pipeline.errors import ConfigError

ROUNDS_DIR = "rounds"  # under the artifacts folder: one rounds/NNN/ folder per round
ROUND_FILE = "round.json"  # written last: a round folder without it is an unfinished round


def round_dir(artifacts: str | os.PathLike[str], round_index: int, *parts: str) -> Path:
    """artifacts/rounds/NNN (and `parts` below it: `round_dir(art, 3, "export")` is rounds/003/export): the one
    place the round folders' layout is spelled."""
    return Path(artifacts, ROUNDS_DIR, f"{round_index:03d}", *parts)


def adapter_ref(adapter: Mapping[str, Any] | None) -> dict[str, str] | None:
    """The train stage's reference ({adapter_dir, adapter_digest, …}) as the score and select stages take an
    adapter: {"dir", "digest"}; None for the base model (no adapter yet)."""
    return None if not adapter else {"dir": adapter["adapter_dir"], "digest": adapter["adapter_digest"]}


class ImportRecord(TypedDict, total=False):
    """One label file or pull a round imported (pipeline/annotation/labels.py: ImportReport), or the error that
    refused it; a pull that did not reach Label Studio also carries "pull_failed"."""

    file: str
    summary: str
    error: str
    accepted: int
    rejected: int
    rejections: list[dict[str, Any]]  # the first rejected rows, file:line and why
    rejections_file: str
    already_imported: bool


class ConsensusSummary(TypedDict, total=False):
    """Several annotators a sample (pipeline/annotation/consensus.py: round_record): the method, counts and the
    annotator table the round summary shows."""

    method: str
    model_rater: bool
    samples: int
    undecided: int
    mean_confidence: float
    annotators: list[dict[str, Any]]


class AdapterRecord(TypedDict, total=False):
    """The train stage's reference (pipeline/model/train_stage.py): its folder and manifest key, the PEFT folder."""

    dir: str
    digest: str
    adapter_dir: str
    adapter_digest: str


class PhaseRecord(TypedDict, total=False):
    """The selection phase and why (pipeline/strategies/schedule.py)."""

    phase: str
    reason: str


class LabelCheckRecord(TypedDict, total=False):
    """What round.json keeps of the label check's reference (pipeline/round/records.py: LABEL_CHECK_KEYS)."""

    dir: str
    method: str
    checked: int
    issues: int
    abstained: int
    oos_accuracy: float | None
    expected_false_alarms: float | None
    message: str


class PushRecord(TypedDict, total=False):
    """A push of tasks to Label Studio (pipeline/annotation/label_studio.py), or the error that stopped it."""

    project: int
    pushed: int
    already: int
    error: str


class OutliersRecord(TypedDict, total=False):
    """The pool's outliers the select stage flagged (pipeline/strategies/outliers.py)."""

    flagged: int
    far: int
    persistent: int
    policy: str


class StabilityRecord(TypedDict, total=False):
    """The stop set's agreement with the previous adapter (pipeline/stopping.py: measure_stop_set)."""

    n: int
    agreement: float
    kappa: float
    f_change_bound: float | None
    forecast: str


class TimeRecord(TypedDict, total=False):
    """Annotator time recorded so far (pipeline/status.py: annotation_time)."""

    hours: float
    timed: int
    median_s: float
    p90_s: float
    next_batch: int
    next_batch_hours: float


class CostRecord(TypedDict, total=False):
    """select.cost's model and its forecast for the batch (pipeline/strategies/cost.py)."""

    n: int
    status: str
    reason: str
    cv_r2: float
    cv_mae_s: float
    median_mae_s: float
    next_batch: int
    next_batch_hours: float


class CandidatesRecord(TypedDict, total=False):
    """What select.candidates scored: all eligible samples (method "all") or candidates from `sources`."""

    method: str
    eligible: int
    candidates: int
    scored: int
    sources: dict[str, int]
    reason: str


class TrimmedRecord(TypedDict):
    """Unsure samples rounds.label_budget held back from the redundancy queue."""

    count: int
    reason: str


# Keys round.json always holds (null when empty), as the rounds before RoundState wrote them.
_ALWAYS = ("round", "labeled", "labeled_digest", "imports", "metrics", "annotation_time", "strategy",
           "quality_flags", "pool", "labels_spent", "tasks_out", "stopped", "adapter")
# Written, null or not, once the round selected (the select stage's references).
_SELECTION = ("selected", "export_dir", "selection_dir", "outliers", "phase", "embeddings", "cost")


@dataclass
class RoundState:
    """One round, as round.json records it. The nested records (metrics, phase, candidates, …) are the plain JSON
    objects the stages return; their fields are documented where they are made."""

    round: int = 0
    labeled: int = 0  # labels the round trains on
    labeled_digest: str | None = None
    imports: list[ImportRecord] = field(default_factory=list)  # pipeline.report.import_record: one per file
    metrics: dict[str, float] | None = None  # the adapter's test metrics; None before any labels
    annotation_time: TimeRecord | None = None  # pipeline.status.annotation_time
    strategy: str = ""
    quality_flags: list[str] | None = None  # pipeline.quality.explain_flags
    eval_dir: str | None = None
    stability: StabilityRecord | None = None  # the stop set's agreement (pipeline.stopping.measure_stop_set)
    labelcheck: LabelCheckRecord | None = None  # the label check's summary (round.records.label_check_record)
    consensus: ConsensusSummary | None = None  # several annotators a sample (pipeline.annotation.consensus)
    pool: int = 0  # eligible pool samples
    labels_spent: int | None = None  # labels paid for, re-labels included (None: not counted yet)
    tasks_out: int = 0  # exported earlier, not labeled yet
    stopped: str | None = None  # why the round selects nothing (round.stop.stop_reason)
    at_chance: str | None = None  # the warning when accuracy is still at chance (pipeline.chance.chance_check)
    label_studio: PushRecord | None = None  # the push of the batch to Label Studio
    selected: int | None = None  # None: the round selected nothing (it stopped)
    export_dir: str | None = None
    selection_dir: str | None = None
    outliers: OutliersRecord | None = None
    phase: PhaseRecord | None = None  # the selection phase and its reason (strategies.schedule)
    embeddings: str | None = None
    cost: CostRecord | None = None  # select.cost's model and forecast
    candidates: CandidatesRecord | None = None  # what select.candidates scored
    relabel: int | None = None  # likely label errors queued for re-labeling
    relabel_dir: str | None = None
    label_studio_relabel: PushRecord | None = None
    consensus_dir: str | None = None  # the redundancy tasks (annotate.redundancy)
    consensus_requeued: int | None = None
    consensus_trimmed: TrimmedRecord | None = None  # unsure samples rounds.label_budget held back: {count, reason}
    adapter: AdapterRecord | None = None  # the train stage's reference
    extra: dict[str, Any] = field(default_factory=dict)  # keys this tamis does not know, kept as they were

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RoundState:
        """A state from round.json's object (or a flow's result): unknown keys kept in `extra`, missing defaulted."""
        known = {f.name for f in fields(cls)} - {"extra"}
        state = cls(**{k: v for k, v in data.items() if k in known})
        state.extra = {k: v for k, v in data.items() if k not in known}
        return state

    def to_json(self) -> dict[str, Any]:
        """round.json's object: the keys always written, the selection's once it selected, the rest when set."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if f.name in _ALWAYS or (f.name in _SELECTION and self.selected is not None) or value is not None:
                out[f.name] = value
        return {**out, **self.extra}

    def update(self, values: Mapping[str, Any]) -> None:
        """Set the fields a library function returned as a JSON object (settle_votes, queue_redundancy)."""
        known = {f.name for f in fields(self)} - {"extra"}
        for k, v in values.items():
            if k in known:
                setattr(self, k, v)
            else:
                self.extra[k] = v

    @property
    def selected_count(self) -> int:
        return self.selected or 0


def completed_rounds(artifacts: str | os.PathLike[str]) -> list[RoundState]:
    """States of finished rounds (round.json is written last), in round order."""
    rounds = Path(artifacts) / ROUNDS_DIR
    states = []
    for p in sorted(rounds.glob(f"[0-9][0-9][0-9]/{ROUND_FILE}")) if rounds.is_dir() else []:
        try:
            states.append(RoundState.from_json(json.loads(p.read_text(encoding="utf-8"))))
        except (OSError, ValueError):
            continue  # an unreadable state is an unfinished round: it will be run again
    return sorted(states, key=lambda s: s.round)


def trained_round(artifacts: str | os.PathLike[str], index: int | None = None) -> RoundState:
    """The finished round that trained the adapter asked for: round `index`, else the latest round that trained one.
    What `tamis predict` and `tamis export-model` read an adapter from."""
    states = completed_rounds(artifacts)
    trained = [s for s in states if s.adapter]
    pick = trained[-1] if index is None and trained else next((s for s in trained if s.round == index), None)
    if pick is not None:
        return pick
    if index is None:
        what = f"no finished round in {artifacts} trained an adapter yet"
    elif all(s.round != index for s in states):
        what = f"round {index} is not a finished round in {artifacts}"
    else:
        what = f"round {index} trained no adapter (a cold-start round, before any labels)"
    raise ConfigError(f"{what}; rounds with an adapter: {', '.join(str(s.round) for s in trained) or 'none yet'}. "
                      "Pick one of those with --round, or run `tamis round` until a round has labels (the first "
                      "round only selects)")
