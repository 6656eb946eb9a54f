"""Import labels from annotators: Label Studio JSON / JSON_MIN exports, CSV and JSONL files.

A file is read whole and validated before anything is written. A malformed file (bad JSON/CSV, wrong structure, an
export from another project) raises LabelImportError naming the line and appends nothing. Bad rows (no matching
sample, label outside the answer set, empty label, duplicate, a tie between annotators) are rejected with file:line
and a reason, written to a rejection report, and the rest is appended to the ledger in one write (or, with
strict=True, any rejection aborts the whole file). A file whose digest the ledger already knows is a no-op.

Rows name their sample by, in this order (see `SampleIndex.resolve`, pipeline/annotation/matching.py): the tamis
sample_id; the source's own ID kept at ingestion (`external_id`, read from the `id` column or a source's
`id_column`); the image path (relative to its source, or any unique tail of it) or a Label Studio image URL
(`/data/local-files/?d=…`, `/data/upload/…`, http URLs by file name when unique). The ledger entry records which key
matched.

Label Studio exports: tasks an earlier import took are skipped whole (pipeline/annotation/taken.py), so a
whole-project export brings only what is new; a re-label task (the label check's, rounds/NNN/relabel/) is a later
decision on its sample, a correction of the round's answer, never more votes beside it.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.annotation.consensus import BoxIoU, Decision, Majority, votes_path
from pipeline.annotation.counted import new_rows
from pipeline.annotation.label_files import LabelFile, LabelKeys, LabelRow, read_label_file
from pipeline.annotation.ledger import Ledger, make_entry
from pipeline.annotation.matching import SampleIndex
from pipeline.annotation.rejections import write_rejections
from pipeline.annotation.taken import already_taken, remember, taken
from pipeline.config.answers import ClosedAnswers
from pipeline.errors import LabelImportError
from pipeline.meaning import normalize_answer
from pipeline.report import REJECTIONS_SHOWN
from pipeline.store import append_jsonl, digest_bytes, read_jsonl

log = logging.getLogger(__name__)


@dataclass
class Rejection:
    file: str
    line: int
    where: str
    sample_id: str | None
    label: str | None
    annotator: str
    reason: str


@dataclass
class Conflict:
    sample_id: str
    votes: dict[str, int]
    outcome: str  # "majority" (accepted) or "tie" (rejected)
    label: str | None


@dataclass
class ImportReport:
    file: str
    digest: str
    format: str = ""
    rows_read: int = 0
    accepted_rows: int = 0  # votes behind accepted labels, outvoted ones included (see conflicts)
    accepted: list[dict[str, Any]] = field(default_factory=list)  # ledger entries appended
    unchanged: list[str] = field(default_factory=list)  # samples whose current label the file repeats
    rejected: list[Rejection] = field(default_factory=list)
    conflicts: list[Conflict] = field(default_factory=list)
    skipped_cancelled: int = 0
    already_taken: int = 0  # rows of Label Studio tasks an earlier import took (pipeline/annotation/taken.py)
    unlabeled_tasks: int = 0
    already_imported: bool = False
    rejections_file: str | None = None
    dry_run: bool = False
    matched_by: dict[str, int] = field(default_factory=dict)  # key kind → label rows it matched
    mapped: dict[str, int] = field(default_factory=dict)  # "'h' → 'H'" → rows whose label named a declared answer so
    answer_column: str = "label"  # a table's column the answers were read from (LabelKeys.answer_column)
    times: list[dict[str, Any]] = field(default_factory=list)  # annotation-time rows (accepted votes with a time)
    votes: list[dict[str, Any]] = field(default_factory=list)  # raw-vote rows for the consensus log (ties included)

    @property
    def accounted(self) -> bool:
        return (self.accepted_rows + len(self.rejected) + self.skipped_cancelled + self.already_taken
                == self.rows_read)

    @property
    def corrections(self) -> int:
        return sum(e["kind"] == "correction" for e in self.accepted)

    def summary(self) -> str:
        if self.already_imported:
            return f"{self.file}: already imported (digest {self.digest[:12]}), nothing to do"
        if not self.rows_read:
            return f"{self.file}: no label rows ({self.unlabeled_tasks} tasks without annotations), nothing to do"
        keys = ", ".join(f"{n} by {k}" for k, n in sorted(self.matched_by.items()))
        return (
            f"{self.file}: {self.rows_read} label rows → {len(self.accepted)} labels "
            f"{'would be appended (dry run)' if self.dry_run else 'appended'} "
            f"({self.corrections} corrections), {len(self.unchanged)} unchanged, {len(self.rejected)} rejected, "
            f"{self.skipped_cancelled} skipped/cancelled, {len(self.conflicts)} annotator conflicts"
            + (f", {self.already_taken} taken by an earlier import" if self.already_taken else "")
            + (f"; rows matched: {keys}" if keys and set(self.matched_by) != {"sample_id"} else "")
            + (f"; answers read from column {self.answer_column!r} (no `label` column)"
               if self.answer_column != "label" else "")
            + (f"; mapped {sum(self.mapped.values())} labels: "
               + ", ".join(f"{k} ({n})" for k, n in sorted(self.mapped.items(), key=lambda kv: -kv[1]))
               if self.mapped else "")
            + (f"; {len(self.times)} timed annotations, {sum(t['seconds'] for t in self.times) / 3600:.2f} h"
               if self.times else "")
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def record(self) -> dict[str, Any]:
        """What a round keeps of the import (round.json's imports): counts, the summary, the first rejected rows with
        their file:line and reason, and where the full list is (pipeline.report.rejection_lines words them)."""
        return {"file": self.file, "summary": self.summary(), "accepted": len(self.accepted),
                "rejected": len(self.rejected), "already_imported": self.already_imported,
                "rejections": [{"where": x.where, "reason": x.reason} for x in self.rejected[:REJECTIONS_SHOWN]],
                "rejections_file": self.rejections_file}


# -------------------------------------------------------------------------------------------------- import
def _check_project(lf: LabelFile, index: SampleIndex) -> None:
    """A file none of whose rows names a sample here is another project's (or keyed by something unknown)."""
    keyed = [r for r in lf.rows if r.keys()]
    if lf.rows and not keyed:
        raise LabelImportError(
            f"{lf.path}: no row carries a sample_id, an id or an image (data.sample_id, meta.sample_id, data.image, "
            "or a sample_id / id / image column); name the sample each label is for"
        )
    if not keyed or any(r.resolved for r in keyed):
        return
    hint = "" if len(index) else "; this project has no ingested samples yet: run `tamis ingest` first"
    ids = {r.sample_id for r in keyed if r.sample_id}
    if ids:
        raise LabelImportError(
            f"{lf.path}: none of its {len(ids)} sample IDs (e.g. {sorted(ids)[0]!r}) is among {index.scope}; is it an "
            f"export from another project? (no row matched by id or image path either){hint}"
        )
    first = keyed[0]
    raise LabelImportError(
        f"{lf.path}: none of its {len(keyed)} label rows matches one of {index.scope} (e.g. {first.where}: "
        f"{', '.join(f'{k} {v!r}' for k, v in first.keys())}); is it an export from another project?{hint}"
    )


def _open_key(label: str) -> str:
    return normalize_answer(label)


def _counted(sid: str, r: LabelRow) -> dict[str, Any]:
    """What a time or vote row is counted once by: its annotation (pipeline/annotation/counted.py)."""
    return {"annotation": r.count_key(sid), **({"updated_at": r.updated} if r.updated else {})}


def _vote_row(sid: str, r: LabelRow, round_index: int, digest: str) -> dict[str, Any]:
    return {"sample_id": sid, "annotator": r.annotator, "label": r.label, "round": round_index, "source_digest": digest,
            **_counted(sid, r)}


def _validate(lf: LabelFile, rep: ImportReport, *, index: SampleIndex, closed: ClosedAnswers | None,
              skip: set[int]) -> dict[tuple[str, str], list[LabelRow]]:
    """Check each row on its own (rejections go to `rep`) → the votes per (sample, re-label set): a re-label task's
    answers are a later decision on the sample, not more votes beside the round's. `closed`: the declared answers a
    label must name (case and spaces ignored, or through an alias), None for open answers. `skip`: rows of tasks
    taken before (pipeline/annotation/taken.py)."""
    votes: dict[tuple[str, str], list[LabelRow]] = {}
    seen: dict[tuple[str, str, str, str], str] = {}
    for i, r in enumerate(lf.rows):
        raw = (r.label or "").strip()
        label = closed.match(raw) if closed is not None and raw else raw
        if i in skip:
            rep.already_taken += 1
        elif r.cancelled:
            rep.skipped_cancelled += 1
        elif r.problem:
            _reject(rep, r, r.problem)
        elif (why := index.resolve(r)) is not None:
            _reject(rep, r, why)
        elif not raw:
            _reject(rep, r, "empty label; fill it in or delete the row")
        elif label is None:
            _reject(rep, r, f"label {raw!r} is not in the answer set [{', '.join(closed.answers)}]; use one of these "
                            "(case and spaces do not matter), or map it to one in data.answer_aliases")
        elif (r.resolved, r.relabel, r.annotator, label) in seen:
            _reject(rep, r, f"duplicate row: {r.resolved} by {r.annotator} already given at "
                            f"{seen[r.resolved, r.relabel, r.annotator, label]}")
        else:
            # The same annotator (or an unnamed one: a CSV without an annotator column) giving two different
            # answers is a conflict, decided like two annotators: a tie is rejected, never first-row-wins.
            seen[r.resolved, r.relabel, r.annotator, label] = r.where
            if label != raw:
                rep.mapped[f"{raw!r} → {label!r}"] = rep.mapped.get(f"{raw!r} → {label!r}", 0) + 1
            r.label = label
            votes.setdefault((r.resolved, r.relabel), []).append(r)
    return votes


def _reject(rep: ImportReport, r: LabelRow, reason: str) -> None:
    key = r.resolved or r.sample_id or r.external_id or r.image
    rep.rejected.append(Rejection(rep.file, r.line, r.where, key, r.label, r.annotator, reason))


def _decide(votes: dict[tuple[str, str], list[LabelRow]], rep: ImportReport, *, current: dict[str, Any],
            open_answers: bool, round_index: int, rule: Callable[[Sequence[str]], Decision] = Majority.decide_one
            ) -> None:
    """Decide each sample's label from its votes by `rule` (pure: the outcome goes to `rep`). A sample's round votes
    come first, then each re-label set's in order, each a correction of the decision before it. A box project's
    rule (BoxIoU) may decide a label no annotator drew verbatim (the median of matched boxes)."""
    now = None
    current = dict(current)
    # Open answers are compared normalised ("Seven." and "seven" agree) and stored verbatim: the winning answer as
    # its most common spelling.
    same = _open_key if open_answers else (lambda x: x)
    for (sid, _), rows in sorted(votes.items(), key=lambda kv: kv[0][1]):  # stable: round votes keep file order
        if open_answers:
            spelled = Counter(r.label for r in rows)
            for r in rows:
                r.label = max((a for a in spelled if same(a) == same(r.label)), key=lambda a: (spelled[a], a))
        winner = _settle(sid, rows, rep, round_index, rule)
        if winner is None:
            continue
        prev = current.get(sid)
        if prev is not None and same(prev["label"]) == same(winner):
            rep.unchanged.append(sid)
            continue
        who = sorted({r.annotator for r in rows if r.label == winner}) or sorted({r.annotator for r in rows})
        first = next((r for r in rows if r.label == winner), rows[0])
        entry = make_entry(
            sid, winner,
            annotator=",".join(who),
            round_index=round_index,
            source_file=rep.file,
            source_digest=rep.digest,
            supersedes=prev,
            votes=[{"annotator": r.annotator, "label": r.label} for r in rows] if len(rows) > 1 else None,
            matched_by=first.matched_by,
            matched_key=first.matched_key,
            now=now,
        )
        now = entry["time"]  # one timestamp per import
        rep.accepted.append(entry)
        current[sid] = entry  # a later re-label set of this file corrects this entry


def _settle(sid: str, rows: list[LabelRow], rep: ImportReport, round_index: int,
            rule: Callable[[Sequence[str]], Decision] = Majority.decide_one) -> str | None:
    """The decision of one sample's votes by `rule` (consensus.py), its votes and times booked in `rep`; None on a
    tie."""
    # The file's own decision is the per-file part's (majority; box_iou for boxes): a fitted method, when
    # configured, is derived afterwards from every raw vote (apply_consensus), and these votes go to its log.
    decision = rule([r.label for r in rows])
    one_annotator = len({r.annotator for r in rows}) == 1
    times = [{"sample_id": sid, "annotator": r.annotator, "seconds": r.seconds, "round": round_index,
              "source_digest": rep.digest, **_counted(sid, r)} for r in rows if r.seconds is not None]
    if decision.outcome != "agreed":
        tie = decision.label is None
        rep.conflicts.append(Conflict(sid, decision.votes, decision.outcome, decision.label))
        if not one_annotator:
            rep.votes += [_vote_row(sid, r, round_index, rep.digest) for r in rows]
            if tie:  # rejected as a label, still a vote that cost its annotator the time (accepted ones below)
                rep.times += times
        if tie:
            for r in rows:
                _reject(rep, r, f"conflicting answers for {sid} from {rows[0].annotator}: {decision.votes}; keep "
                        "one row" if one_annotator else
                        f"annotators tie on {sid}: {decision.votes}; add a deciding annotation")
            return None
    else:
        rep.votes += [_vote_row(sid, r, round_index, rep.digest) for r in rows]
    rep.accepted_rows += len(rows)
    for r in rows:
        rep.matched_by[r.matched_by or "sample_id"] = rep.matched_by.get(r.matched_by or "sample_id", 0) + 1
    # Every accepted vote cost its annotator time, outvoted or repeating the current label alike.
    rep.times += times
    return decision.label


def _apply(
    lf: LabelFile,
    *,
    index: SampleIndex,
    answers: Sequence[str] | None,
    ledger: Ledger,
    round_index: int,
    rejections_dir: Path,
    strict: bool,
    dry_run: bool = False,
    skip: Collection[int] = (),
    aliases: Mapping[str, str] | None = None,
    boxes: bool = False,
) -> ImportReport:
    """Validate the rows → decide each sample's label (no I/O: the outcome is `rep`) → commit it (unless dry_run).
    `boxes`: the labels are box labels (LabelKeys.box_labels)."""
    name = str(lf.path)
    rep = ImportReport(file=name, digest=lf.digest, format=lf.format, rows_read=len(lf.rows),
                       unlabeled_tasks=lf.unlabeled_tasks, dry_run=dry_run, answer_column=lf.answer_column)
    closed = ClosedAnswers.of(answers, aliases) if answers else None
    votes = _validate(lf, rep, index=index, closed=closed, skip=set(skip))
    # Box labels are decided by boxes matched on IoU, not by equal text: two
    # annotators never draw the same pixels.
    _decide(votes, rep, current=ledger.current(), open_answers=closed is None, round_index=round_index,
            rule=BoxIoU().decide_one if boxes else Majority.decide_one)
    # Times and votes an earlier file already booked (the same CSV half-written, an earlier cumulative export) are
    # not booked again: they are facts of the annotation, not of the file (pipeline/annotation/counted.py).
    rep.times = new_rows(rep.times, read_jsonl(ledger.times_path))
    rep.votes = new_rows(rep.votes, read_jsonl(votes_path(ledger.path.parent)))
    if not rep.accounted:  # a bug, not bad input: never write a ledger batch that lost rows
        raise AssertionError(f"{name}: row accounting broken: {rep.summary()}")

    if not dry_run:
        _commit(rep, ledger, rejections_dir=rejections_dir, strict=strict, round_index=round_index)
    return rep  # the caller reports rep.summary() once: the CLI prints it, the round logs it


def _commit(rep: ImportReport, ledger: Ledger, *, rejections_dir: Path, strict: bool, round_index: int) -> None:
    """Write what `rep` decided: the rejection report, then (unless strict and anything was rejected) the times,
    the votes and the ledger entries."""
    if rep.rejected:
        out = write_rejections(rejections_dir, rep.digest, [asdict(x) for x in rep.rejected], round_index=round_index)
        rep.rejections_file = str(out)
        if strict:
            first_rows = "\n".join(f"  {x.where}: {x.reason}" for x in rep.rejected[:5])
            more = f"\n  … and {len(rep.rejected) - 5} more" if len(rep.rejected) > 5 else ""
            raise LabelImportError(
                f"{rep.file}: {len(rep.rejected)} of {rep.rows_read} label rows rejected, nothing imported (strict):\n"
                f"{first_rows}{more}\nfull list: {out}"
            )
    # Times and votes first: a crash before the ledger write re-imports the file, and both logs drop repeated rows.
    ledger.append_times(rep.times)
    if rep.votes:
        append_jsonl(votes_path(ledger.path.parent), rep.votes)
    ledger.append(rep.accepted)


def import_labels(
    path: str | os.PathLike[str],
    *,
    known_ids: SampleIndex | set[str],
    answers: Sequence[str] | None,
    ledger: Ledger,
    round_index: int,
    rejections_dir: str | os.PathLike[str],
    strict: bool = False,
    keys: LabelKeys | None = None,
    dry_run: bool = False,
    aliases: Mapping[str, str] | None = None,
) -> ImportReport:
    """Validate one label file and append its accepted labels to the ledger in one write.

    `known_ids`: the samples labels may name (a SampleIndex matches the user's IDs and image paths too).
    `answers`, `aliases`: data.answers and data.answer_aliases (a label names an answer as ClosedAnswers.match says).
    `dry_run`: everything but the writes; the report says what would land.
    """
    path = Path(path)
    if path.is_file():
        digest = digest_bytes(path.read_bytes())
        if digest in ledger.imported_digests():
            return ImportReport(file=str(path), digest=digest, already_imported=True, dry_run=dry_run)
    index = SampleIndex.of(known_ids)
    lf = _prepared_file(path, index, keys)
    known = taken(ledger.path)
    rep = _apply(lf, index=index, answers=answers, ledger=ledger, round_index=round_index,
                 rejections_dir=Path(rejections_dir), strict=strict, dry_run=dry_run,
                 skip=already_taken(lf.rows, known), aliases=aliases, boxes=bool(keys and keys.box_labels))
    if not dry_run:  # after the ledger's write: a crash in between re-reads these tasks, never loses one
        # A rejected annotation is not taken: the next export of the task (fixed, or judged by a fixed config: an
        # answer alias) is read again, its sample back among the candidates meanwhile (rejections.py).
        refused = {x.where for x in rep.rejected}
        remember(ledger.path, (r for r in lf.rows if r.resolved and r.where not in refused), source_file=rep.file,
                 source_digest=rep.digest, known=known)
    return rep


def _prepared_file(path: Path, index: SampleIndex, keys: LabelKeys | None) -> LabelFile:
    lf = read_label_file(path, keys)
    for r in lf.rows:
        index.resolve(r)
    _check_project(lf, index)
    return lf


PREPARE_LATEST = Path("prepare") / "latest.json"  # pipeline.preprocess.record_latest: the last prepared dataset
INGEST_LATEST = Path("ingest") / "latest.json"  # pipeline.data.ingest.record_latest: the last ingested dataset


def latest_dataset(artifacts: Path) -> Path | None:
    """The project's last prepared dataset, else its last ingested one: both hold every sample's IDs and paths."""
    for pointer, key in ((PREPARE_LATEST, "prepare"), (INGEST_LATEST, None)):
        try:
            refs = json.loads((artifacts / pointer).read_text(encoding="utf-8"))
            folder = Path(refs[key]["dir"] if key else refs["dir"]) / "dataset"
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if folder.is_dir():
            return folder
    return None


def project_index(artifacts: str | os.PathLike[str], dataset: str | os.PathLike[str] | None = None) -> SampleIndex:
    """Every sample a label file may name: `dataset` (a saved dataset) or else the project's last prepared (or, before
    any prepare, ingested) dataset, plus every sample exported for labeling. Without any, only the exported samples,
    and the scope says so."""
    import datasets

    from pipeline.annotation.export import exported_sample_ids
    from pipeline.errors import DataError

    artifacts = Path(artifacts)
    exported = exported_sample_ids(artifacts)
    folder = Path(dataset) if dataset is not None else latest_dataset(artifacts)
    if folder is None:
        return SampleIndex(sorted(exported), scope=(
            f"the {len(exported)} samples exported for labeling (no ingested dataset in {artifacts}: run "
            "`tamis ingest`, or pass --dataset, to label any sample of the project)"))
    try:
        ds = datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError) as exc:
        raise DataError(f"{folder}: not a saved tamis dataset ({exc})") from None
    if "sample_id" not in ds.column_names:
        raise DataError(f"{folder}: not a saved tamis dataset (no sample_id column)")
    ds = ds.select_columns([c for c in ("sample_id", "external_id", "image_path") if c in ds.column_names])
    index = SampleIndex.from_dataset(ds)
    extra = sorted(s for s in exported if s not in index)
    if extra:  # exported from an older dataset version: still labelable by sample_id
        index.add(extra)
        index.scope = f"this project's {len(index)} samples"
    return index
