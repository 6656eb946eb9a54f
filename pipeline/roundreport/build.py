"""Build a round's report: gather what it shows, draw the pictures, write report.html (and the batch's contact sheet
and the confusion matrix as PNGs, for the Prefect UI's round summary) into the round's folder."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline import __version__
from pipeline.errors import ArtifactError, DataError
from pipeline.report import candidates_line, metrics_text, time_text
from pipeline.round_state import RoundState, round_dir
from pipeline.roundreport import gather, pictures, poolmap
from pipeline.roundreport.page import render_page
from pipeline.roundreport.sources import ReportSources
from pipeline.stage_ref import PreparedRefs
from pipeline.store import atomic_write_bytes, atomic_write_text

log = logging.getLogger(__name__)

REPORT_FILE = "report.html"
BATCH_PNG = "batch.png"  # the contact sheet (first pictures.SHEET_MAX picks)
CONFUSION_PNG = "confusion.png"


@dataclass(frozen=True)
class RoundReport:
    """What a build wrote: the page, and the pictures the Prefect UI's summary shows (None where the round has none)."""

    html: Path
    batch_png: Path | None
    confusion_png: Path | None
    bytes: int
    seconds: float


Draw = Callable[[dict[str, bytes]], dict[str, bytes]]  # pictures → the same pictures with a box project's boxes


def _thumbs(ids: Sequence[str], images: gather.Images, draw: Draw | None = None) -> dict[str, dict[str, Any]]:
    pngs = images.png(list(dict.fromkeys(ids)))
    out = {}
    for sid, png in (draw(pngs) if draw else pngs).items():
        data, mime, (w, h) = pictures.thumbnail(png)
        out[sid] = {"uri": pictures.data_uri(data, mime), "w": w, "h": h}
    return out


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def _header(state: RoundState, sources: ReportSources) -> dict[str, Any]:
    phase = state.phase or {}
    return {"round": state.round, "labeled": state.labeled, "pool": state.pool, "selected": state.selected_count,
            "strategy": state.strategy, "phase": phase.get("phase"), "phase_reason": phase.get("reason"),
            "metrics": metrics_text(state.metrics), "stopped": state.stopped, "at_chance": state.at_chance, "round_dir": sources.round_dir}


def _box_drawer(sources: ReportSources, images: gather.Images, labels: Mapping[str, str],
                batch: Sequence[gather.BatchItem], wrong: Sequence[Mapping[str, Any]]) -> Draw | None:
    """A box project's pictures get their labeled boxes and the model's boxes drawn (None: one-answer projects)."""
    if not sources.box_codec:
        return None
    from pipeline.roundreport.box_pictures import overlay

    codec = sources.box_codec
    answers = {**{b.sample_id: b.answer for b in batch}, **{w["sample_id"]: w.get("prediction") for w in wrong}}
    truth = {**labels, **{w["sample_id"]: w["answer"] for w in wrong}}
    return lambda pngs: overlay(pngs, images.geometry(list(pngs)), truth, answers, codec)


def _test_errors(sources: ReportSources, images: gather.Images) -> list[dict[str, Any]]:
    """The error gallery's test rows: a box project's by box errors (box_pictures.box_errors), else the most
    confident answers that differ from the label."""
    if not sources.eval_dir:
        return []
    if sources.box_codec:
        from pipeline.roundreport.box_pictures import box_errors
        from pipeline.store import read_jsonl

        rows = read_jsonl(Path(sources.eval_dir) / "predictions.jsonl")
        found = box_errors(rows, images.geometry([str(r["sample_id"]) for r in rows]), sources.box_codec,
                           gather.EXAMPLES)
        if found is not None:
            return found
    return gather.confident_errors(sources.eval_dir)


def build_report(sources: ReportSources, state: RoundState, curve: bytes | None) -> RoundReport:
    """Write report.html (and batch.png, confusion.png) for the round `state` from `sources`; `curve`: the learning
    curve as it stood after the round (pipeline.metrics.round_curve_png), None before any metric."""
    start = time.perf_counter()
    rd = Path(sources.round_dir)
    labels = gather.labeled_answers(rd)
    batch = gather.read_batch(sources, state)
    pool_map = poolmap.pool_map_points(sources, state, [b.sample_id for b in batch], labels)
    pc = gather.per_class_metrics(sources.eval_dir, sources.answers) if sources.eval_dir else None
    images = gather.Images(sources.prepared_dir)
    wrong = _test_errors(sources, images)
    issues, check_message = gather.label_errors(sources.labelcheck_dir)
    flags, checked = gather.quality_flags(sources.quality_dir)
    draw = _box_drawer(sources, images, labels, batch, wrong)
    batch_png = images.png([b.sample_id for b in batch[:pictures.SHEET_MAX]])
    batch_png = draw(batch_png) if draw else batch_png
    shown = [b.sample_id for b in batch] + [w["sample_id"] for w in wrong] + [i["sample_id"] for i in issues]
    thumbs = _thumbs(shown + [f.example for f in flags if f.example], images, draw)
    # The user's file names: what the cards are headed by.
    names = images.names(list(dict.fromkeys(shown + [f.example for f in flags if f.example])))
    for b in batch:
        b.name = names[b.sample_id]
    sheet = pictures.contact_sheet(batch, batch_png)
    confusion = pictures.confusion_png(pc, sources.eval_dir) if pc else None
    balance = gather.class_balance(labels, sources.answers)
    c = state.candidates
    view = {
        "r": _header(state, sources), "version": __version__,
        "candidates": c and _sentence(candidates_line(c)),
        "batch": [{**asdict(b), "thumb": thumbs.get(b.sample_id)} for b in batch],
        "pool_map": pool_map and pictures.data_uri(pictures.pool_map_png(pool_map)),
        "map_note": pool_map and (
            f"{pool_map.sampled:,} of {pool_map.total:,} points drawn (seed {sources.seed}): every selected sample, "
            f"at most {poolmap.MAP_EXTRA:,} labeled and outliers, {poolmap.MAP_POINTS:,} at random; projected by a PCA "
            f"fitted on them. " + ", ".join(f"{pool_map.kind.count(k)} {k}" for k in poolmap.KINDS)),
        "pc": pc, "confusion": confusion and pictures.data_uri(confusion), "evaluated": bool(sources.eval_dir),
        "wrong": [{"sample_id": w["sample_id"], "name": names[w["sample_id"]], "answer": w["answer"], "prediction": w.get("prediction"),
                   "confidence": w.get("confidence"), "thumb": thumbs.get(w["sample_id"]), "errors": w.get("errors")}
                  for w in wrong],
        "boxes": bool(sources.box_codec), "box_pc": gather.box_per_class(sources.eval_dir),
        "issues": [{"sample_id": i["sample_id"], "name": names[i["sample_id"]], "given_label": i.get("given_label"),
                    "suggested_label": i.get("suggested_label"), "confidence": i.get("confidence"),
                    "annotators": i.get("annotators") or [], "thumb": thumbs.get(i["sample_id"])} for i in issues],
        "check_message": check_message,
        "flags": [{**asdict(f), "thumb": thumbs.get(f.example) if f.example else None,
                   "name": names.get(f.example) if f.example else None} for f in flags],
        "checked": checked, "curve": curve and pictures.data_uri(curve), "balance": balance,
        "balance_max": max([n for _, n in balance] or [1]) or 1, "time": time_text(state.annotation_time),
        "annotators": state.consensus, "seconds": time.perf_counter() - start,
    }
    html = atomic_write_text(rd / REPORT_FILE, render_page(view))
    sheet_path = atomic_write_bytes(rd / BATCH_PNG, sheet) if sheet else None
    confusion_path = atomic_write_bytes(rd / CONFUSION_PNG, confusion) if confusion else None
    return RoundReport(html, sheet_path, confusion_path, html.stat().st_size, time.perf_counter() - start)


def write_round_report(sources: ReportSources, state: RoundState, curve: bytes | None) -> RoundReport:
    """A finished round's report: its sources kept in report_sources.json (for later rebuilds), then built."""
    sources.save()
    return build_report(sources, state, curve)


def try_round_report(resolve: Callable[[], ReportSources], state: RoundState,
                     curve: bytes | None) -> RoundReport | None:
    """write_round_report at the end of a round, its sources resolved by `resolve()` (resolve_sources). The report
    is a view of a round whose round.json is already written: a failure to resolve or draw it is logged with the
    command that retries it, and never fails the round (a failed round would be re-run with the same labels, and
    fail the same way, instead of going on to the next)."""
    try:
        return write_round_report(resolve(), state, curve)
    except Exception as exc:  # noqa: BLE001 - any failure of a view; the round itself is done
        log.warning("round %d: report.html not built (%s: %s); retry with `tamis report --round %d --debug`",
                    state.round, type(exc).__name__, exc, state.round)
        return None


def rebuild_report(artifacts: str | os.PathLike[str], round_index: int | None = None, *,
                   resolve: Callable[[RoundState, PreparedRefs | None], ReportSources]) -> RoundReport:
    """`tamis report`: the report of round `round_index` (default: the last finished one) rebuilt from the sources
    its round kept, or, for a round finished before reports existed, resolved from the project's latest data by
    `resolve(state, prepared refs or None)` (resolve_sources on the project)."""
    from pipeline.metrics import read_metrics, round_curve_png
    from pipeline.preprocess import latest_refs
    from pipeline.round_state import ROUND_FILE, completed_rounds
    from pipeline.roundreport.sources import SOURCES_FILE, check_sources

    art = Path(artifacts)
    states = {s.round: s for s in completed_rounds(art)}
    if not states:
        raise DataError(f"no finished round in {art}/rounds (a round is finished once its {ROUND_FILE} is "
                        "written); run `tamis round` first")
    r = max(states) if round_index is None else round_index
    if r not in states:
        raise DataError(f"round {r} is not a finished round in {art}/rounds; finished: "
                        f"{', '.join(map(str, sorted(states)))}")
    rd = round_dir(art, r)
    if (rd / SOURCES_FILE).is_file():
        sources = ReportSources.load(rd)
        check_sources(sources, str(rd / SOURCES_FILE))
    else:
        try:
            prepared = PreparedRefs.of(latest_refs(art))
        except ArtifactError:
            prepared = None  # no prepared data: the report shows what the round's own files hold
        sources = resolve(states[r], prepared)
        check_sources(sources, f"the round's {ROUND_FILE} and the last `tamis prepare`")
    return write_round_report(sources, states[r], round_curve_png(read_metrics(art), r, answers=sources.answers))
