"""Round bookkeeping: which round comes next, what was already sent out, when to stop."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.config import ProjectConfig

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


def labeled_rows(prepared: Any, labels: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Training rows: the prepared image and question of each labeled sample, with its label as the answer."""
    by_id = {r["sample_id"]: r["label"] for r in labels}
    index = {sid: i for i, sid in enumerate(prepared["sample_id"])}
    missing = [s for s in by_id if s not in index]
    if missing:
        raise KeyError(f"{len(missing)} labeled samples are not in the prepared dataset (first: {missing[0]})")
    sub = prepared.select_columns(["sample_id", "prepared", "question"]).select(sorted(index[s] for s in by_id))
    return [{**row, "answer": by_id[row["sample_id"]]} for row in sub]


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
