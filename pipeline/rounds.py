"""Round bookkeeping: which round comes next, what was already sent out, when to stop."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.config import ProjectConfig
from pipeline.errors import DataError
from pipeline.store import atomic_dir, atomic_write_text

ROUND_FILE = "round.json"


def completed_rounds(artifacts: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """States of finished rounds (round.json is written last), in round order."""
    rounds = Path(artifacts) / "rounds"
    states = []
    for p in sorted(rounds.glob(f"[0-9][0-9][0-9]/{ROUND_FILE}")) if rounds.is_dir() else []:
        try:
            states.append(json.loads(p.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue  # an unreadable state is an unfinished round: it will be run again
    return sorted(states, key=lambda s: s["round"])


def next_round_index(artifacts: str | os.PathLike[str], labeled_digest: str | None) -> int:
    """The last round again when the labeled set is unchanged (a re-run), else the round after it."""
    done = completed_rounds(artifacts)
    if not done:
        return 0
    last = done[-1]
    return last["round"] if labeled_digest is not None and last.get("labeled_digest") == labeled_digest else last["round"] + 1


def exported_before(artifacts: str | os.PathLike[str], round_index: int) -> set[str]:
    """Samples sent to annotators in rounds before `round_index` (exported but maybe not labeled yet)."""
    from pipeline.annotation.export import TASKS_FILE

    ids: set[str] = set()
    for r in range(round_index):
        tasks = Path(artifacts) / "rounds" / f"{r:03d}" / "export" / TASKS_FILE
        if tasks.is_file():
            ids.update(t["data"]["sample_id"] for t in json.loads(tasks.read_text(encoding="utf-8")))
    return ids


def save_labeled_set(prepared: Any, labels: Mapping[str, str], out_dir: str | os.PathLike[str], *,
                     digest: str) -> dict[str, str]:
    """The labeled training set: prepared rows of the labeled samples with their current label as the answer.

    Saved as a dataset (what augmentation and training read); returns {"dataset": path, "digest": digest}. The
    folder is rebuilt only when its recorded digest differs, so a re-run leaves it alone.
    """
    out_dir = Path(out_dir)
    stamp = out_dir / "digest.txt"
    if stamp.is_file() and stamp.read_text(encoding="utf-8") == digest:
        return {"dataset": str(out_dir / "dataset"), "digest": digest}
    index = {sid: i for i, sid in enumerate(prepared["sample_id"])}
    missing = sorted(s for s in labels if s not in index)
    if missing:
        raise DataError(f"{len(missing)} labeled samples are not in the prepared dataset (first: {missing[0]}); "
                        "were they labeled for another dataset?")
    sub = prepared.select(sorted(index[s] for s in labels))
    # keep_in_memory: a cache file would land inside the prepare stage's folder and break its digest.
    sub = sub.map(lambda sid: {"answer": labels[sid], "split": "train"}, input_columns=["sample_id"],
                  keep_in_memory=True)
    with atomic_dir(out_dir / "dataset") as tmp:
        sub.save_to_disk(str(tmp))
    atomic_write_text(stamp, digest)
    return {"dataset": str(out_dir / "dataset"), "digest": digest}


def stop_reason(cfg: ProjectConfig, round_index: int, n_labels: int, metrics: Sequence[Mapping[str, Any]],
                pool_left: int) -> str | None:
    """Why no further batch should be selected, or None: max rounds, label budget, target metric, plateau, empty pool."""
    rc = cfg.rounds
    if round_index + 1 >= rc.max_rounds:
        return f"rounds.max_rounds = {rc.max_rounds} reached (this is round {round_index})"
    if rc.label_budget is not None and n_labels >= rc.label_budget:
        return f"label budget spent: {n_labels} labels ≥ rounds.label_budget = {rc.label_budget}"
    main = "accuracy" if cfg.data.answers else "token_f1"
    curve = [m["value"] for m in sorted(metrics, key=lambda m: m["round"]) if m["metric"] == main]
    if rc.target_metric is not None and curve and curve[-1] >= rc.target_metric:
        return f"target reached: {main} = {curve[-1]:.4f} ≥ rounds.target_metric = {rc.target_metric}"
    if rc.plateau_rounds is not None and len(curve) > rc.plateau_rounds:
        best_before = max(curve[: -rc.plateau_rounds])
        if max(curve[-rc.plateau_rounds:]) <= best_before + 0.005:
            return f"plateau: {main} has not improved by 0.005 over the last {rc.plateau_rounds} rounds"
    if pool_left == 0:
        return "pool exhausted: no unlabeled samples left to select"
    return None


def receive_labels(artifacts: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """Put the annotators' export file into the inbox (a copy; the original stays where it is) → the inbox path.

    A file whose content is already in the inbox is not copied twice; a different file with the same name gets a
    numbered name, so nothing in the inbox is overwritten.
    """
    from pipeline.store import atomic_write_bytes, digest_file

    src = Path(path).expanduser()
    if not src.is_file():
        raise DataError(f"labels file {src} does not exist or is not a file; give the path of the annotators' export "
                        "(Label Studio JSON, or CSV / JSONL with sample_id,label) as the worker's machine sees it")
    from pipeline.annotation.labels import INBOX_SUFFIXES

    if src.suffix.lower() not in INBOX_SUFFIXES:
        raise DataError(f"labels file {src}: the inbox reads only {', '.join(sorted(INBOX_SUFFIXES))} files; export "
                        "the labels in one of those formats")
    inbox = Path(artifacts) / "inbox"
    digest = digest_file(src)
    for existing in sorted(inbox.iterdir()) if inbox.is_dir() else []:
        if existing.is_file() and digest_file(existing) == digest:
            return existing
    dest, n = inbox / src.name, 1
    while dest.exists():
        dest, n = inbox / f"{src.stem}-{n}{src.suffix}", n + 1
    return atomic_write_bytes(dest, src.read_bytes())


def should_wait(cfg: ProjectConfig, state: Mapping[str, Any], *, deployed: bool) -> bool:
    """Whether a finished round waits for its annotators: rounds.wait_for_labels, a batch was exported, and the run
    can be suspended and resumed later (only a deployment's run can: its worker starts it again)."""
    return bool(cfg.rounds.wait_for_labels and deployed and state.get("export_dir") and not state.get("stopped"))
