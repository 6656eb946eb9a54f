"""Which round this is, with which labels, and which samples it may select.

A round is the last one again when its labeled set is unchanged (a re-run), else the next; its labels are the seed
labels overridden by the ledger's; its pool leaves out what is labeled, flagged, still with the annotators or in
the stop set.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from pipeline.errors import DataError
from pipeline.round_state import AdapterRecord, RoundState, completed_rounds, round_dir
from pipeline.store import arrow_column, digest_json, read_manifest


def next_round_index(done: Sequence[RoundState], labeled_digest: str | None) -> int:
    """After the finished rounds `done` (oldest first): the last round again when the labeled set is unchanged (a
    re-run), else the round after it."""
    if not done:
        return 0
    last = done[-1]
    return last.round if labeled_digest is not None and last.labeled_digest == labeled_digest else last.round + 1


def import_round(artifacts: str | os.PathLike[str]) -> int:
    """The round labels imported now belong to, the same for the inbox and `tamis labels import`: the next round,
    the first whose labeled set holds them (0 before any round finished)."""
    return next_round_index(completed_rounds(artifacts), None)


def exported_before(artifacts: str | os.PathLike[str], round_index: int) -> set[str]:
    """Samples sent to annotators in rounds before `round_index` (exported but maybe not labeled yet)."""
    from pipeline.annotation.export import exported_sample_ids

    return exported_sample_ids(artifacts, before_round=round_index)


def still_out(artifacts: str | os.PathLike[str], plan: RoundPlan) -> set[str]:
    """Samples exported in earlier rounds and still with the annotators: not labeled, and not given back by a
    rejected label row since their last export (pipeline/annotation/rejections.py): those return to the pool."""
    from pipeline.annotation.export import exported_sample_ids
    from pipeline.annotation.rejections import rejected_samples

    out = exported_before(artifacts, plan.index) - set(plan.labels)
    since: dict[int, set[str]] = {}
    for sid, r in rejected_samples(artifacts).items():
        if sid in out:
            since.setdefault(r, set()).add(sid)
    for r, sids in since.items():  # rejected at the import of round r: exported again in round r or later → out
        out -= sids - exported_sample_ids(artifacts, since_round=r, before_round=plan.index)
    return out


@dataclass
class PoolData:
    """The prepared dataset's columns a round decides on (IDs, splits, seed answers, as Arrow holds them: no Python
    object per row of a 10⁶-image pool) and its label-matching index."""

    ids: Any  # pyarrow arrays, row-aligned
    splits: Any
    answers: Any
    index: Any  # pipeline.annotation.labels.SampleIndex: matches labels by ID, the user's own ID or image path
    dataset: Any = None  # the prepared dataset itself (memory-mapped): the round's steps read its rows from here
    recipe: tuple[str, str] | None = None  # how it was prepared (stage version, config digest): sets made of it key on it

    @classmethod
    def of(cls, prepared: Any) -> PoolData:
        from pipeline.annotation.labels import SampleIndex

        return cls(*(arrow_column(prepared, c) for c in ("sample_id", "split", "answer")),
                   index=SampleIndex.from_dataset(prepared), dataset=prepared)

    @classmethod
    def load(cls, prepared_dir: str | os.PathLike[str]) -> PoolData:
        """The prepare stage's dataset in `prepared_dir` and how it was prepared, read once for the whole round."""
        from pipeline.preprocess import load_prepared

        ds, m = load_prepared(prepared_dir), read_manifest(Path(prepared_dir))
        return replace(cls.of(ds), recipe=(m.stage_version, m.config_digest))

    def __len__(self) -> int:
        return len(self.ids)

    def _where(self, split: str, *, answered: bool = False) -> Any:
        import pyarrow.compute as pc

        mask = pc.equal(self.splits, split)
        return pc.and_(mask, pc.is_valid(self.answers)) if answered else mask

    def pool_ids(self, exclude: Collection[str] = ()) -> list[str]:
        """Rows of the pool split, dataset order, without `exclude`."""
        import pyarrow as pa
        import pyarrow.compute as pc

        mask = self._where("pool")
        if exclude:
            mask = pc.and_(mask, pc.invert(pc.is_in(self.ids, value_set=pa.array(sorted(exclude), pa.string()))))
        return pc.filter(self.ids, mask).to_pylist()

    def _pairs(self, split: str) -> list[tuple[str, str]]:
        import pyarrow.compute as pc

        mask = self._where(split, answered=True)
        return list(zip(pc.filter(self.ids, mask).to_pylist(), pc.filter(self.answers, mask).to_pylist(),
                        strict=True))

    def stop_set(self, size: int, seed: int) -> list[str]:
        """The rounds' stop set (rounds.stop_set): pool samples no round selects, predicted by every adapter."""
        from pipeline.stopping import stop_set

        return stop_set(self.pool_ids(), size, seed) if size > 0 else []

    def check_evaluable(self) -> None:
        """A round that trains evaluates its adapter on the labeled test split: refuse before training without one."""
        if not self._pairs("test"):
            raise DataError(
                f"no labeled test rows among the {len(self)} ingested samples: every round evaluates its adapter "
                "on rows with split 'test' and an answer. Add a source of held-out labeled images with `split: test` "
                "(e.g. a JSONL manifest with image, answer and split per row) to data.sources")

    def test_rows(self) -> list[tuple[str, str]]:
        """(sample ID, answer) of the labeled test split every round evaluates on, in dataset order."""
        return self._pairs("test")

    def seed_labels(self) -> dict[str, str]:
        """Answers the data came with on its train split: labels before any annotator."""
        return dict(self._pairs("train"))


def round_labels(pool: PoolData, ledger_labels: Mapping[str, str]) -> dict[str, str]:
    """The labels a round trains on: the seed labels, overridden by the ledger's labels of this dataset's samples."""
    ids = list(ledger_labels)
    known = pool.index.knows(ids)
    return {**pool.seed_labels(), **{s: ledger_labels[s] for s, k in zip(ids, known, strict=True) if k}}


def labels_now(artifacts: str | os.PathLike[str], pool: PoolData, *, round_index: int) -> dict[str, str]:
    """The round's labels once labels have followed their re-saved or moved images to their new sample IDs
    (pipeline/annotation/carry.py: a carry entry each, logged)."""
    from pipeline.annotation.carry import follow_images

    return round_labels(pool, follow_images(artifacts, pool.dataset, pool.index, round_index=round_index))


@dataclass
class RoundPlan:
    """Which round this run is, with what labels, and what came before it."""

    index: int
    dir: Path
    labels: dict[str, str]
    labeled_digest: str
    rerun: RoundState | None  # the finished round this run repeats (its labeled set is unchanged)
    previous: list[RoundState]  # finished rounds before this one, oldest first
    history: list[Path]  # their folders, in the same order

    def warm_start(self, init: str) -> AdapterRecord | None:
        """The adapter training starts from: the last earlier round's with train.init = warm, never this round's
        own (on a re-run of round r, round r's adapter would be its own warm start)."""
        return self.previous[-1].adapter if self.previous and init == "warm" else None

    @property
    def last(self) -> RoundState | None:
        """The finished round before this one, None for the first."""
        return self.previous[-1] if self.previous else None

    def state(self, imports: list[dict[str, Any]], **fields: Any) -> RoundState:
        """The round's state as round.json records it, before any stage ran (`fields`: what the caller knows)."""
        from pipeline.report import import_record

        return RoundState(round=self.index, labeled=len(self.labels), labeled_digest=self.labeled_digest,
                          imports=import_record(self.rerun, imports), **fields)


def plan_round(artifacts: str | os.PathLike[str], labels: dict[str, str]) -> RoundPlan:
    """The round for this labeled set: the last one again when it is unchanged (a re-run), else the next."""
    return plan_after(completed_rounds(artifacts), artifacts, labels)


def plan_after(done: Sequence[RoundState], artifacts: str | os.PathLike[str], labels: dict[str, str]) -> RoundPlan:
    """plan_round after the finished rounds `done` (completed_rounds, read once by a round that has them)."""
    digest = digest_json(sorted(labels.items()))
    r = next_round_index(done, digest)
    previous = [s for s in done if s.round < r]
    return RoundPlan(index=r, dir=round_dir(artifacts, r), labels=labels, labeled_digest=digest,
                     rerun=next((s for s in done if s.round == r), None), previous=previous,
                     history=[round_dir(artifacts, s.round) for s in previous])


class Eligible(NamedTuple):
    """What a round may select from: `ids`, the pool samples it may select (dataset order); `exclude`, every ID it
    must not; `out`, the samples exported in earlier rounds and still with the annotators (still_out), which the
    label budget has promised already."""

    ids: list[str]
    exclude: set[str]
    out: set[str]


def eligible_pool(artifacts: str | os.PathLike[str], pool: PoolData, plan: RoundPlan,
                  quality_excluded: set[str], *, stop: Sequence[str] = ()) -> Eligible:
    """The pool samples the round may select: not labeled, flagged by quality, exported in an earlier round and
    still with the annotators (still_out), or in the stop set."""
    out = still_out(artifacts, plan)
    exclude = set(plan.labels) | quality_excluded | out | set(stop)
    return Eligible(pool.pool_ids(exclude), exclude, out)
