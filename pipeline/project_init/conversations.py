"""`tamis init` on conversation files: TRL, LLaMA-Factory sharegpt and ms-swift records (JSONL or one JSON list), told
apart by one record's shape (pipeline.data.conversations reads them)."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from pipeline.errors import DataError
from pipeline.project_init.found import SIZE_SAMPLE, Found, image_sizes
from pipeline.project_init.tables import _cell, _spread


def conversation_kind(rec: Any) -> str | None:
    """trl / sharegpt / swift from one record's shape (module docstring), None when it is no conversation."""
    if not isinstance(rec, dict):
        return None
    if isinstance(rec.get("conversations"), list):
        return "sharegpt"
    msgs = rec.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        return None
    return "trl" if any(isinstance(m.get("content"), list) for m in msgs) else "swift"


def _conversation_records(path: Path) -> list[Any] | None:
    """The records of a JSONL / JSON-list file when its first one is a conversation, else None (unreadable too: the
    other detectors say why)."""
    try:
        text = path.read_text(encoding="utf-8-sig")
        recs = json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines()
                                                                      if x.strip()]
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return recs if isinstance(recs, list) and recs and conversation_kind(recs[0]) else None


def _conversations(path: Path, recs: list[Any]) -> Found:
    from pipeline.data.conversations import Conversation, ShareGptColumns, parse, sharegpt_columns

    kind = conversation_kind(recs[0])
    assert kind is not None
    try:
        cols, named = sharegpt_columns(path) if kind == "sharegpt" else (ShareGptColumns(), None)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    parsed = [(r, parse(r, kind, cols)) for r in recs if isinstance(r, dict)]
    convs = [c for _, c in parsed if isinstance(c, Conversation)]
    answers = [_cell(c.answer) for c in convs if _cell(c.answer)]
    # Records whose split cell says test are the test split, as a manifest's rows are (the reader's split_column).
    tests = [_cell(c.answer) for r, c in parsed if isinstance(c, Conversation) and _cell(r.get("split")).lower() == "test"]
    files = [p for c in _spread(convs, SIZE_SAMPLE) if c.images
             for p in [path.resolve().parent / c.images[0]] if p.is_file()]
    many = sum(len(c.images) > 1 for c in convs)
    turns = sum(bool(c.context) for c in convs)
    what = (f"{kind} conversations: {len(recs):,} records" + (f" (columns from {named})" if named else "")
            + f" ({len(answers):,} ending on an answer"
            + (f", {many:,} with several images" if many else "") + (f", {turns:,} with earlier turns" if turns else "")
            + (f"; {len(recs) - len(convs):,} the readers quarantine with a reason" if len(convs) < len(recs) else "")
            + (f", {len(tests):,} in the test split" if tests else "") + ")")
    return Found({"kind": kind, "path": str(path)}, len(recs), len(answers), sorted(set(answers)), image_sizes(files),
                 what, counts=dict(Counter(answers)), free_text=True, test=len(tests),
                 test_counts=dict(Counter(a for a in tests if a)))


def _conversation_file(folder: Path) -> Path | None:
    names = sorted(e.name for e in os.scandir(folder) if e.is_file() and e.name.lower().endswith((".jsonl", ".json"))
                   and e.name != "dataset_info.json")
    found = [n for n in names if _conversation_records(folder / n) is not None]
    if len(found) > 1:
        train = [n for n in found if n.rsplit(".", 1)[0].lower() == "train"]
        if len(train) != 1:
            raise DataError(f"{folder}: several conversation files ({', '.join(found)}); point tamis init at the one "
                            "to read (add the others as sources afterwards, e.g. with default_split: test)")
        found = train
    return folder / found[0] if found else None
