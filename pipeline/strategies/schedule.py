"""Budget-aware selection: coverage while labels are scarce, then uncertainty × diversity (TCM-style).

With few labels a model's uncertainty says little and coverage of the pool's dense regions wins (TypiClust,
ProbCover, MaxHerding); with more labels uncertainty wins (Hacohen et al. 2022; Doucet et al. 2024, TCM). The switch
is a stated rule (`select.schedule.switch`), evaluated from what a round knows, so every round can say which phase
it is in and why. Once switched, a project stays switched: the rules only look at a growing history.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.config import ScheduleConfig


@dataclass(frozen=True)
class Phase:
    """What a round selects with, and why."""

    name: str  # "coverage" or "uncertainty"
    strategy: str
    diversity: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"phase": self.name, "strategy": self.strategy, "diversity": self.diversity, "reason": self.reason}


def strategy_label(cold_start: str, strategy: str, diversity: str, *, cold: bool,
                   phase: Mapping[str, str] | None = None) -> str:
    """The one name of what chose a round's batch, as the CLI table, round.json, selection.jsonl (`round_strategy`),
    metrics.jsonl and the Prefect UI all print it: "cold start: maxherding" for the first batch (select.cold_start),
    the schedule's phase when there is one (phase_label), else select.strategy+select.diversity."""
    if cold:
        return f"cold start: {cold_start}"
    return phase_label(phase) if phase else f"{strategy}+{diversity}"


def phase_label(phase: Mapping[str, str]) -> str:
    """How a round's selection reads in tables: "coverage: maxherding" (the coverage phase ignores the model's
    scores, so its nominal strategy, random, would mislead), else "strategy+diversity"."""
    if phase["phase"] == "coverage":
        return f"coverage: {phase['diversity']}"
    return f"{phase['strategy']}+{phase['diversity']}"


def accuracy_stopped_rising(history: Sequence[float], patience: int) -> int | None:
    """Index (into `history`) of the first value after which the newest-labels accuracy did not rise above its
    earlier best for `patience` consecutive rounds; None while it is still rising."""
    best = float("-inf")
    flat = 0
    for i, acc in enumerate(history):
        if i and acc <= best:
            flat += 1
            if flat >= patience:
                return i
        else:
            flat = 0
        best = max(best, acc)
    return None


def choose_phase(
    schedule: ScheduleConfig | Mapping[str, Any],
    *,
    strategy: str,
    diversity: str,
    labeled: int,
    n_classes: int | None,
    newest_accuracy: Sequence[float] = (),
) -> Phase:
    """The phase for a round that starts with `labeled` labels.

    `newest_accuracy` holds, oldest first, each earlier round's accuracy of the model on the batch it selected,
    measured against the labels that batch then received (the model never trained on them): how much a new label
    still surprises the model.
    """
    sch = schedule if isinstance(schedule, ScheduleConfig) else ScheduleConfig.model_validate(dict(schedule))
    after = Phase("uncertainty", strategy, diversity, "")
    if sch.coverage == "none":
        return Phase(after.name, strategy, diversity, "no schedule: select.strategy × select.diversity every round")
    if sch.switch == "labels_per_class":
        classes = n_classes or 10
        need = sch.labels_per_class * classes
        what = f"{sch.labels_per_class} per class × {classes} classes" if n_classes else \
            f"{sch.labels_per_class} × 10 (open answers)"
        if labeled < need:
            return Phase("coverage", "random", sch.coverage,
                         f"{labeled} labels < {need} ({what}): coverage with {sch.coverage}")
        return Phase(after.name, strategy, diversity,
                     f"{labeled} labels ≥ {need} ({what}): {strategy} × {diversity}")
    hist = [round(float(a), 4) for a in newest_accuracy]
    stop = accuracy_stopped_rising(hist, sch.patience)
    if stop is None:
        return Phase("coverage", "random", sch.coverage,
                     f"accuracy on the newest labels still rising ({hist or 'no history yet'}): coverage with "
                     f"{sch.coverage}")
    return Phase(after.name, strategy, diversity,
                 f"accuracy on the newest labels stopped rising after round {stop} ({hist}): {strategy} × {diversity}")


def newest_label_accuracy(selection_rows: Sequence[Mapping[str, Any]], labels: Mapping[str, str]) -> float | None:
    """Accuracy of a round's pre-annotations (the `prediction` of each selected sample, made before it was
    labeled) against the labels it got; None when the round had no predictions or none of its picks is labeled."""
    pairs = [(r["prediction"], labels[r["sample_id"]]) for r in selection_rows
             if r.get("prediction") is not None and r["sample_id"] in labels]
    if not pairs:
        return None
    return sum(p == y for p, y in pairs) / len(pairs)
