"""A round's state: what round.json records, what the round summary, `tamis round` / `tamis status`, the Prefect UI
and the unchanged-round check read. One typed object instead of a dict of string keys; the file keeps its shape.

Library functions fill it (pipeline/rounds.py), the flow only orders them. `from_json` reads files written by any
tamis: a key it does not know is kept as it is (and written back), a key the file lacks takes its default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

ROUNDS_DIR = "rounds"  # under the artifacts folder: one rounds/NNN/ folder per round


def round_dir(artifacts: str | os.PathLike[str], round_index: int, *parts: str) -> Path:
    """artifacts/rounds/NNN (and `parts` below it: `round_dir(art, 3, "export")` is rounds/003/export): the one
    place the round folders' layout is spelled."""
    return Path(artifacts, ROUNDS_DIR, f"{round_index:03d}", *parts)


def adapter_ref(adapter: Mapping[str, Any] | None) -> dict[str, str] | None:
    """The train stage's reference ({adapter_dir, adapter_digest, …}) as the score and select stages take an
    adapter: {"dir", "digest"}; None for the base model (no adapter yet)."""
    return None if not adapter else {"dir": adapter["adapter_dir"], "digest": adapter["adapter_digest"]}


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
    imports: list[dict[str, Any]] = field(default_factory=list)  # pipeline.report.import_record
    metrics: dict[str, float] | None = None  # the adapter's test metrics; None before any labels
    annotation_time: dict[str, Any] | None = None  # pipeline.status.annotation_time
    strategy: str = ""
    quality_flags: list[str] | None = None  # pipeline.quality.explain_flags
    eval_dir: str | None = None
    stability: dict[str, Any] | None = None  # the stop set's agreement (pipeline.stopping.measure_stop_set)
    labelcheck: dict[str, Any] | None = None  # the label check's summary (rounds.label_check_record)
    consensus: dict[str, Any] | None = None  # several annotators a sample (pipeline.annotation.consensus)
    pool: int = 0  # eligible pool samples
    labels_spent: int | None = None  # labels paid for, re-labels included (None: not counted yet)
    tasks_out: int = 0  # exported earlier, not labeled yet
    stopped: str | None = None  # why the round selects nothing (rounds.stop_reason)
    at_chance: str | None = None  # the warning when accuracy is still at chance (pipeline.chance.chance_check)
    label_studio: dict[str, Any] | None = None  # the push of the batch to Label Studio
    selected: int | None = None  # None: the round selected nothing (it stopped)
    export_dir: str | None = None
    selection_dir: str | None = None
    outliers: dict[str, Any] | None = None
    phase: dict[str, Any] | None = None  # the selection phase and its reason (strategies.schedule)
    embeddings: str | None = None
    cost: dict[str, Any] | None = None  # select.cost's model and forecast
    candidates: dict[str, Any] | None = None  # what select.candidates scored
    relabel: int | None = None  # likely label errors queued for re-labeling
    relabel_dir: str | None = None
    label_studio_relabel: dict[str, Any] | None = None
    consensus_dir: str | None = None  # the redundancy tasks (annotate.redundancy)
    consensus_requeued: int | None = None
    consensus_trimmed: dict[str, Any] | None = None  # unsure samples rounds.label_budget held back: {count, reason}
    adapter: dict[str, Any] | None = None  # the train stage's reference
    extra: dict[str, Any] = field(default_factory=dict)  # keys this tamis does not know, kept as they were

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RoundState:
        """A state from round.json's object (or a flow's result): unknown keys kept in `extra`, missing defaulted."""
        known = {f.name for f in fields(cls)} - {"extra"}
        state = cls(**{k: v for k, v in data.items() if k in known})
        state.extra = {k: v for k, v in data.items() if k not in known}
        return state

    @classmethod
    def of(cls, state: RoundState | Mapping[str, Any]) -> RoundState:
        """`state` itself, or read from its JSON object: what readers accept."""
        return state if isinstance(state, RoundState) else cls.from_json(state)

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
