"""The inbox: where annotators' exports land (artifacts/inbox/), and the one policy that imports them.

Each file is imported on its own: a corrupt file is rejected (reported with its line) and the others still go in;
a file the ledger already holds is a no-op, so the inbox can keep every file it ever received.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.annotation.label_files import LabelKeys
from pipeline.annotation.labels import import_labels
from pipeline.annotation.ledger import Ledger, ledger_path
from pipeline.annotation.matching import SampleIndex
from pipeline.errors import DataError, LabelImportError
from pipeline.store import atomic_write_bytes, digest_file

log = logging.getLogger(__name__)
INBOX = "inbox"
INBOX_SUFFIXES = (".json", ".csv", ".jsonl")


def inbox_dir(artifacts: str | os.PathLike[str]) -> Path:
    return Path(artifacts) / INBOX


def inbox_files(inbox: str | os.PathLike[str]) -> list[Path]:
    d = Path(inbox)
    if not d.is_dir():
        return []
    # Hidden names are temp files of an atomic write still in progress.
    return sorted(p for p in d.iterdir() if p.is_file() and p.suffix.lower() in INBOX_SUFFIXES
                  and not p.name.startswith("."))


def import_inbox(artifacts: str | os.PathLike[str], *, index: SampleIndex | set[str], answers: Sequence[str] | None,
                 round_index: int, keys: LabelKeys | None = None,
                 aliases: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Import every inbox file (sorted by name) into the ledger; one report dict per file, in that order. The inbox
    folder is made on the way: from round 0 on, the folder every message tells the annotators to use exists (a file
    copied to a missing `inbox/` would become a file named inbox)."""
    inbox_dir(artifacts).mkdir(parents=True, exist_ok=True)
    ledger = Ledger(ledger_path(artifacts))
    index = SampleIndex.of(index)
    reports = []
    for path in inbox_files(inbox_dir(artifacts)):
        try:
            rep = import_labels(path, known_ids=index, answers=answers, ledger=ledger, round_index=round_index,
                                rejections_dir=Path(artifacts) / "rejections", keys=keys, aliases=aliases)
        except LabelImportError as exc:
            log.error("label file rejected, nothing imported from it: %s", exc)
            reports.append({"file": str(path), "error": str(exc)})
            continue
        if not rep.already_imported:
            log.info(rep.summary())
        reports.append(rep.record())
    return reports


def receive_labels(artifacts: str | os.PathLike[str], path: str | os.PathLike[str], *,
                   labels_from: str | os.PathLike[str] | None = None) -> Path:
    """Put the annotators' export file into the inbox (a copy; the original stays where it is) → the inbox path.

    The file must lie inside the artifacts folder or `labels_from` (rounds.labels_from), links resolved: a resumed
    run's form names it, and anyone who reaches the Prefect API can fill that in. A file whose content is already in
    the inbox is not copied twice; a different file with the same name gets a numbered name, so nothing in the inbox
    is overwritten.
    """
    src = Path(path).expanduser()
    roots = [Path(r).resolve() for r in (artifacts, labels_from) if r is not None]
    if not any(src.resolve().is_relative_to(r) for r in roots):
        raise DataError(f"labels file {src} lies outside the folders a resumed round may read labels from "
                        f"({', '.join(map(str, roots))}); move it into one of them, or set rounds.labels_from to the "
                        "folder your annotators' exports land in")
    if not src.is_file():
        raise DataError(f"labels file {src} does not exist or is not a file; give the path of the annotators' export "
                        "(Label Studio JSON, or CSV / JSONL with sample_id,label) as the worker's machine sees it")
    if src.suffix.lower() not in INBOX_SUFFIXES:
        raise DataError(f"labels file {src}: the inbox reads only {', '.join(sorted(INBOX_SUFFIXES))} files; export "
                        "the labels in one of those formats")
    inbox = inbox_dir(artifacts)
    digest = digest_file(src)
    for existing in sorted(inbox.iterdir()) if inbox.is_dir() else []:
        if existing.is_file() and digest_file(existing) == digest:
            return existing
    dest, n = inbox / src.name, 1
    while dest.exists():
        dest, n = inbox / f"{src.stem}-{n}{src.suffix}", n + 1
    return atomic_write_bytes(dest, src.read_bytes())
