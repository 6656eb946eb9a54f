"""Whether the model has learned anything yet: the main metric's 95 % interval still containing chance after
several trained rounds is the sign a team misses in its second hour (0.17 accuracy on 8 answers over three rounds
reads as "some accuracy" until someone does the division). One decision, one sentence with the numbers and what to
try; `tamis status`, summary.md, the round report and the model card all print the same sentence.

Chance is 1 / k for accuracy on a closed answer set of k answers (a model that guesses uniformly, or always answers
one class of a balanced test set). Open answers have no chance level: token F1 of a guess depends on the answers'
lengths and words, so the check is skipped there and says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.config.sections import ModelConfig, TrainConfig

MIN_TRAINED_ROUNDS = 2  # one weak round is normal (a handful of labels); two in a row is the pattern to flag
LABELS_PER_ANSWER = 20  # the label count the advice aims at: a few dozen per answer before judging a base model


@dataclass(frozen=True)
class ChanceCheck:
    """The verdict: `warning` is the sentence to show when the model is still at chance, else None; `reason` says
    why no warning (not enough rounds, above chance, open answers) in words a `--json` reader can use."""

    warning: str | None
    reason: str
    chance: float | None = None


def _trained_rounds(rows: Sequence[Mapping[str, Any]], metric: str,
                    up_to: int | None) -> list[tuple[int, int, float, list[float] | None]]:
    """(round, labels, value, ci95) of `metric` per evaluated round, oldest first; a re-evaluated round keeps its
    newest row (the log is append-only)."""
    by_round: dict[int, tuple[int, int, float, list[float] | None]] = {}
    for r in rows:
        if r["metric"] == metric and (up_to is None or int(r["round"]) <= up_to):
            by_round[int(r["round"])] = (int(r["round"]), int(r["labels"]), float(r["value"]), r.get("ci95"))
    return [by_round[k] for k in sorted(by_round)]


def _advice(labels: int, k: int, train: TrainConfig, model: ModelConfig) -> str:
    """What to try, with the config fields and values to change."""
    per = labels / k
    more = max(0, LABELS_PER_ANSWER * k - labels)
    tips = [f"more labels ({labels} labels over {k} answers is {per:.1f} per answer"
            + (f"; about {more} more reach {LABELS_PER_ANSWER} per answer: raise select.batch_size or run more "
               "rounds)" if more else ")")]
    steps = (f"train.max_steps: {train.max_steps} → {train.max_steps * 3}" if train.max_steps
             else f"train.epochs: {train.epochs:g} → {train.epochs * 3:g}")
    tips.append(f"more training steps ({steps}; or train.learning_rate {train.learning_rate:g} → "
                f"{train.learning_rate * 2:g})")
    name = model.name_or_path
    if model.build_tiny_if_missing or "tiny" in name.lower():
        tips.append(f"a real base model (model.name_or_path `{name}` looks like a random-weight tiny test model, "
                    "which cannot learn: try HuggingFaceTB/SmolVLM-256M-Instruct or a larger one, docs/models.md)")
    else:
        tips.append(f"a bigger base model (model.name_or_path `{name}` → a larger checkpoint of its family, "
                    "docs/models.md)")
    tips.append("checking the labels (`tamis labels issues`, and a few labeled images by hand: a swapped answer "
                "name or a label file matched to the wrong images keeps any model at chance)")
    return "; ".join(f"({i}) {t}" for i, t in enumerate(tips, 1))


def chance_check(rows: Sequence[Mapping[str, Any]], answers: Sequence[str] | None, *, train: TrainConfig,
                 model: ModelConfig, up_to_round: int | None = None,
                 min_rounds: int = MIN_TRAINED_ROUNDS) -> ChanceCheck:
    """Whether accuracy's 95 % interval (the metrics log's `ci95`; the value itself when none was logged) still
    contains chance, 1 / len(answers), after `min_rounds` or more evaluated rounds (rounds up to `up_to_round`).
    `rows`: artifacts/metrics.jsonl (pipeline.metrics.read_metrics)."""
    if not answers:
        return ChanceCheck(None, "open answers: no chance level to compare with (token F1 of a guess depends on the "
                                 "answers' lengths and words); the check applies to a closed answer set")
    k = len(answers)
    chance = 1 / k
    curve = _trained_rounds(rows, "accuracy", up_to_round)
    if len(curve) < min_rounds:
        return ChanceCheck(None, f"{len(curve)} evaluated round(s); the check waits for {min_rounds}", chance)
    rnd, labels, value, ci = curve[-1]
    lo, hi = (float(ci[0]), float(ci[1])) if ci else (value, value)
    if lo > chance:
        return ChanceCheck(None, f"accuracy {value:.3f} (95 % CI {lo:.3f}–{hi:.3f}) is above chance {chance:.3f}",
                           chance)
    history = ", ".join(f"{v:.3f}" for _, _, v, _ in curve)
    interval = f"95 % CI {lo:.3f}–{hi:.3f}" if ci else "no interval logged"
    warning = (f"The model is still at chance: accuracy {value:.3f} ({interval}) after {len(curve)} trained rounds "
               f"(round {rnd}, {labels} labels; accuracy by round {history}) is indistinguishable from guessing one "
               f"of {k} answers ({chance:.3f}). Try: {_advice(labels, k, train, model)}.")
    return ChanceCheck(warning, "at chance", chance)


def card_lines(warning: str | None) -> list[str]:
    """The model card's warning section for the exported round's `at_chance` warning (RoundState.at_chance), or
    nothing."""
    return ["", "## Warning: at chance", "", warning] if warning else []
