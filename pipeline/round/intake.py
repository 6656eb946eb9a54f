"""A round's opening: the labels in from every source (a live Label Studio project first, then the inbox: the same
importer for both), the raw votes settled, then which round this is, with which labels, and its state before any
stage runs. Every finished round's round.json is read once here, for the round labels go into and the one planned.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from pipeline.annotation.inbox import import_inbox
from pipeline.annotation.label_files import LabelKeys
from pipeline.annotation.label_studio import pull_labels
from pipeline.annotation.redundancy import settle_votes
from pipeline.config import AnnotateConfig, DataConfig, QualityConfig, SelectConfig
from pipeline.quality import explain_flags
from pipeline.round.plan import PoolData, RoundPlan, labels_now, next_round_index, plan_after
from pipeline.round_state import RoundState, completed_rounds
from pipeline.selection import planned_strategy
from pipeline.status import annotation_time


class Opened(NamedTuple):
    plan: RoundPlan
    state: RoundState
    agreed: dict[str, Any]  # settle_votes: {"consensus": the round's record} when some sample had two votes, else {}


def open_round(artifacts: str | os.PathLike[str], pool: PoolData, *, annotate: AnnotateConfig, data: DataConfig,
               select: SelectConfig, quality: QualityConfig, quality_info: Mapping[str, Any]) -> Opened:
    """Import the labels that came in since the last round, settle their votes and plan the round on the labels
    `pool` (PoolData.load) then holds; `quality_info`: the quality stage's info, explained in the round's state."""
    done = completed_rounds(artifacts)
    start = next_round_index(done, None)
    imports = pull_labels(annotate, data, artifacts, known_ids=pool.index, round_index=start) + import_inbox(
        artifacts, index=pool.index, answers=data.scored_answers, round_index=start, keys=LabelKeys.from_config(data),
        aliases=data.answer_aliases)
    agreed = settle_votes(artifacts, annotate, answers=data.scored_answers, round_index=start)
    plan = plan_after(done, artifacts, labels_now(artifacts, pool, round_index=start))
    state = plan.state(imports, annotation_time=annotation_time(artifacts, next_batch=select.batch_size),
                       strategy=planned_strategy(select, data.scored_answers, plan.labels, plan.history),
                       quality_flags=explain_flags(quality_info, quality))
    return Opened(plan, state, agreed)
