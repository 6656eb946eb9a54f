"""What a round's report shows, read from the round's files: the batch with the model's answers (the pool map is
poolmap.py's), the evaluation's per-class metrics and errors, the likely label errors, the quality flags.

Every reader is bounded by what it shows, not by the pool: the batch's score shards, a fixed number of map points, a
few examples per list, so a 10⁶-sample pool costs reading its ID files once."""

from __future__ import annotations

import bisect
import json
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import ArtifactError
from pipeline.report import candidates_line
from pipeline.round_state import RoundState
from pipeline.roundreport.sources import ReportSources
from pipeline.store import read_jsonl, read_manifest

log = logging.getLogger(__name__)

TOP_ANSWERS = 3  # the model's answers shown per batch sample
EXAMPLES = 12  # test errors and likely label errors shown


# ------------------------------------------------------------------------------------------------- images
def side_by_side(pngs: Sequence[bytes], gap: int = 4) -> bytes:
    """One PNG of a sample's pictures left to right, in order, a white gap between them, tops aligned."""
    import io

    from PIL import Image

    pics = [Image.open(io.BytesIO(p)).convert("RGB") for p in pngs]
    out = Image.new("RGB", (sum(p.width for p in pics) + gap * (len(pics) - 1), max(p.height for p in pics)), "white")
    x = 0
    for p in pics:
        out.paste(p, (x, 0))
        x += p.width + gap
    buf = io.BytesIO()
    out.save(buf, format="PNG")
    return buf.getvalue()


class Images:
    """Prepared images and the user's file names by sample ID, from the prepare stage (one indexed lookup per list,
    never the whole pool)."""

    def __init__(self, prepared_dir: str | None):
        self._dir, self._ds, self._index = prepared_dir, None, None

    def _rows(self, ids: Sequence[str], columns: Sequence[str]) -> dict[str, list[Any]]:
        """The `columns` (those the dataset has) of the samples `ids` it holds, as lists."""
        if self._ds is None:
            from pipeline.idindex import IdIndex
            from pipeline.preprocess import load_prepared

            self._ds = load_prepared(self._dir)
            self._index = IdIndex.of_dataset(self._ds)
        rows = self._index.rows(list(ids))
        found = sorted({int(r) for r in rows if r >= 0})
        if not found:
            return {}
        return self._ds.select(found).select_columns([c for c in columns if c in self._ds.column_names]).to_dict()

    def png(self, ids: Sequence[str]) -> dict[str, bytes]:
        """Each sample's prepared picture; a sample of several pictures: all of them side by side in one PNG, so
        the contact sheet and the thumbnails show every picture of it."""
        if not self._dir or not ids:
            return {}
        sub = self._rows(ids, ["sample_id", "prepared", "more_prepared"])
        more = sub.get("more_prepared") or [None] * len(sub.get("sample_id", []))
        return {sid: side_by_side([png, *m]) if m else png
                for sid, png, m in zip(sub.get("sample_id", []), sub.get("prepared", []), more, strict=True)}

    def geometry(self, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Where each sample's original image sits in its prepared picture (width, height, prep_box, prep_width,
        prep_height: pipeline.boxes.rows.row_geometry's row), for drawing a box project's boxes on it."""
        from pipeline.boxes.box import GEOMETRY_COLUMNS

        sub = self._rows(ids, ["sample_id", *GEOMETRY_COLUMNS]) if self._dir and ids else {}
        return {sid: {c: sub[c][k] for c in GEOMETRY_COLUMNS if c in sub}
                for k, sid in enumerate(sub.get("sample_id", []))}

    def names(self, ids: Sequence[str]) -> dict[str, str]:
        """The user's file name of each sample (schema.display_name; the sample ID where the dataset has none)."""
        from pipeline.schema import display_name

        sub = self._rows(ids, ["sample_id", "image_path", "source"]) if self._dir and ids else {}
        sids = sub.get("sample_id", [])
        paths, sources = sub.get("image_path", [None] * len(sids)), sub.get("source", [None] * len(sids))
        named = {sid: display_name(p, src, sid) for sid, p, src in zip(sids, paths, sources, strict=True)}
        return {s: named.get(s, s) for s in ids}


# ------------------------------------------------------------------------------------------------- the batch
@dataclass
class BatchItem:
    sample_id: str
    rank: int
    reason: str  # why it was picked
    score: float | None  # the selector's score (the heuristic's, for uncertainty)
    top: list[tuple[str, float]] = field(default_factory=list)  # the model's top answers and probabilities
    answer: str | None = None  # its answer (the top one, or the generated one for open answers)
    confidence: float | None = None
    entropy: float | None = None  # of the answer probabilities: the same uncertainty whatever the strategy
    name: str | None = None  # the user's file name (Images.names), what a person knows the sample by


def pick_reason(row: Mapping[str, Any], s: RoundState) -> str:
    """Why a selection row was picked, in the words of the round's phase: coverage of the selection space (no model
    score), or uncertainty (the heuristic's score) spread by the diversity selector."""
    from pipeline.strategies.candidates import picks_by_space
    from pipeline.strategies.registry import get_heuristic

    strategy, diversity = row.get("strategy", "random"), row.get("diversity", "top_k")
    if picks_by_space(strategy, diversity):
        why = f"coverage ({diversity})" + (" — cold start, no model yet" if not s.adapter else "")
    elif get_heuristic(strategy).input == "none":
        why = f"{strategy} draw" + (f", spread by {diversity}" if diversity != "top_k" else "")
    else:
        why = f"uncertainty ({strategy} {row.get('score', 0):.3f})" + (
            f", spread by {diversity}" if diversity != "top_k" else "")
    if c := s.candidates:  # restricted ({candidates, sources}) or all eligible scored (select.candidates)
        why += f"; {candidates_line(c, reason=False)}"
    return why


def shard_scores(shards: Sequence[tuple[str, str]], ids: Sequence[str]) -> dict[str, tuple[Any, str | None]]:
    """{sample ID: (probability row or None, generated answer or None)} from the shards holding `ids` (shards are
    sorted by their first ID, as plan_shards cuts them); a missing shard leaves its samples out, with a warning."""
    from pipeline.scoring import load_scores

    firsts = [f for f, _ in shards]
    wanted: dict[int, list[str]] = {}
    for sid in ids:
        if (k := bisect.bisect_right(firsts, sid) - 1) >= 0:
            wanted.setdefault(k, []).append(sid)
    out: dict[str, tuple[Any, str | None]] = {}
    for k, sids in wanted.items():
        try:
            s = load_scores(shards[k][1])
        except (ArtifactError, OSError) as exc:
            log.warning("report: score shard %s unreadable (%s); its samples show no model answers", shards[k][1], exc)
            continue
        at = {sid: i for i, sid in enumerate(s.sample_ids)}
        for sid in sids:
            if sid in at:
                i = at[sid]
                out[sid] = (None if s.probs is None else s.probs[i], s.answers[i] if s.answers else None)
    return out


def read_batch(sources: ReportSources, state: RoundState) -> list[BatchItem]:
    """The round's batch in pick order (selection/selection.jsonl) with the model's answers from its score shards."""
    rows = read_jsonl(Path(sources.round_dir) / "selection" / "selection.jsonl")
    scores = shard_scores(sources.shards, [r["sample_id"] for r in rows]) if sources.shards else {}
    items = []
    for r in rows:
        item = BatchItem(r["sample_id"], int(r.get("rank", len(items))), pick_reason(r, state), r.get("score"),
                         answer=r.get("prediction"), confidence=r.get("confidence"))
        probs, generated = scores.get(r["sample_id"], (None, None))
        if probs is not None and sources.answers:
            order = np.argsort(-probs)[:TOP_ANSWERS]
            item.top = [(sources.answers[i], float(probs[i])) for i in order]
            p = np.clip(probs.astype(np.float64), 1e-12, 1.0)
            item.entropy = float(-(p * np.log(p)).sum())
        item.answer = generated if generated is not None else item.answer
        items.append(item)
    return items


def labeled_answers(round_dir: str | Path) -> dict[str, str]:
    """The labels the round trained on (its labeled set; none before the first labels)."""
    folder = Path(round_dir) / "labeled" / "dataset"
    if not folder.is_dir():
        return {}
    import datasets

    ds = datasets.load_from_disk(str(folder)).select_columns(["sample_id", "answer"])
    return dict(zip(ds["sample_id"], ds["answer"], strict=True))


# ------------------------------------------------------------------------------------------------- the errors
def per_class_metrics(eval_dir: str | Path, answers: Sequence[str] | None) -> dict[str, Any] | None:
    """The per_class.json of an evaluate stage folder (pipeline.perclass); an evaluation written before it existed
    (EVAL_VERSION 1) gets the same report computed from its predictions.jsonl. None for open answers or without
    predictions."""
    from pipeline.perclass import PER_CLASS_FILE, per_class_report

    folder = Path(eval_dir)
    if (done := folder / PER_CLASS_FILE).is_file():
        return json.loads(done.read_text(encoding="utf-8"))
    rows = read_jsonl(folder / "predictions.jsonl")
    if not rows or not answers:
        return None
    return per_class_report([r["prediction"] for r in rows], [r["answer"] for r in rows], list(answers))


def box_per_class(eval_dir: str | Path | None) -> list[dict[str, Any]] | None:
    """A box evaluation's per-class AP (box_per_class.json: pipeline.boxes.evaluation.box_map's rows); None
    elsewhere."""
    from pipeline.perclass import BOX_PER_CLASS_FILE

    path = Path(eval_dir) / BOX_PER_CLASS_FILE if eval_dir else None
    return json.loads(path.read_text(encoding="utf-8")) if path is not None and path.is_file() else None


def confident_errors(eval_dir: str | Path, top: int = EXAMPLES) -> list[dict[str, Any]]:
    """Test rows the model got wrong, most confident first (rows without a recorded confidence last)."""
    rows = read_jsonl(Path(eval_dir) / "predictions.jsonl")
    wrong = [r for r in rows if str(r.get("prediction") or "").strip() != str(r["answer"]).strip()]
    return sorted(wrong, key=lambda r: -(r.get("confidence") if r.get("confidence") is not None else -1.0))[:top]


def label_errors(labelcheck_dir: str | None, top: int = EXAMPLES) -> tuple[list[dict[str, Any]], str]:
    """(the label check's likely label errors, most likely first; its verdict's sentence)."""
    if not labelcheck_dir or not Path(labelcheck_dir).is_dir():
        return [], "no label check this round"
    folder = Path(labelcheck_dir)
    verdict = folder / "verdict.json"
    message = json.loads(verdict.read_text(encoding="utf-8")).get("message", "") if verdict.is_file() else ""
    return read_jsonl(folder / "issues.jsonl")[:top], message


# ------------------------------------------------------------------------------------------------- quality
@dataclass
class FlagRow:
    flag: str
    count: int
    share: float
    example: str | None  # a sample ID carrying the flag
    reason: str


def quality_flags(quality_dir: str | None) -> tuple[list[FlagRow], int]:
    """(one row per flag with its share of the prepared pool and a first example, rows checked): counts from the
    stage's manifest; examples read in table order, stopping once every flag that occurs has one."""
    from pipeline.quality import FLAGS

    if not quality_dir or not Path(quality_dir).is_dir():
        return [], 0
    folder = Path(quality_dir)
    m = read_manifest(folder)
    counts, total = m.info.get("counts", {}), int(m.info.get("rows", 0))
    need = {f for f in FLAGS if counts.get(f)}
    examples: dict[str, tuple[str, str]] = {}
    tables = ([Path(p) / "quality.jsonl" for p in json.loads(m.path_of("parts", folder).read_text())]
              if "parts" in m.outputs else [m.path_of("table", folder)])
    for table in tables:
        if need <= set(examples):
            break
        with open(table, encoding="utf-8") as fh:
            for line in fh:
                if '"flags": []' in line:  # most rows carry no flag: skip them without parsing
                    continue
                row = json.loads(line)
                for f in row["flags"]:
                    examples.setdefault(f, (row["sample_id"], "; ".join(row.get("reasons", []))))
                if need <= set(examples):
                    break
    return [FlagRow(f, int(counts.get(f, 0)), counts.get(f, 0) / max(total, 1), *examples.get(f, (None, "")))
            for f in FLAGS], total


def class_balance(labels: Mapping[str, str], answers: Sequence[str] | None) -> list[tuple[str, int]]:
    """Labels per class: the answer set's order (every class, zeros included), else most common first."""
    counts = Counter(labels.values())
    if answers:
        return [(a, counts.get(a, 0)) for a in answers] + [(a, n) for a, n in counts.items() if a not in answers]
    return counts.most_common()
