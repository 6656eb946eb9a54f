"""Knowing, before any flow starts, that a round has nothing to do.

An unchanged `tamis round` replays the last round from the cache: every stage key matches, no stage body runs, and
the state it returns is the one already in rounds/NNN/round.json. Learning that through the flow costs Prefect's
temporary server (7-20 s here), the imports of every stage's libraries and a walk of every stage's cache. So each
round records a digest of everything it read that a user can change (`round_inputs`: the config, tamis' code, the
sources through the file index — a stat per image —, the label files and the inbox, the model folder, a bring-your-own
embeddings file, the ground truth), taken when it started and again when it ended (the sources only at the start:
record_round_inputs says why). When the round left its inputs as it found them (it imported no labels, no simulated
annotator answered) and they are still the same now, running it again could only replay it: `unchanged_round`
returns its state and the CLI prints it without starting a flow.

Never skipped: a live Label Studio project (its labels live on a server), a simulated annotator (answering changes
the labels), a round that changed its own inputs (the next run is the one that sees them), outputs the round
recorded that are gone, and `tamis round --full`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.annotation.consensus import VOTES_NAME
from pipeline.annotation.inbox import inbox_dir
from pipeline.annotation.ledger import LEDGER_NAME, TIMES_NAME
from pipeline.config import (
    AnnotateConfig,
    DataConfig,
    ModelConfig,
    PreprocessConfig,
    ProjectConfig,
    QualityConfig,
    RoundsConfig,
)
from pipeline.errors import TamisError
from pipeline.round.simulate import simulated
from pipeline.round_state import ROUNDS_DIR, RoundState, completed_rounds
from pipeline.store import atomic_write_json, digest_json

log = logging.getLogger(__name__)

INPUTS_FILE = "round_inputs.json"  # under artifacts/rounds/
_CODE_ROOTS = ("pipeline", "flows")
# Append-only, written by label imports only; consensus.json and the redundancy table are derived from them by every
# run (rewritten even when nothing changed), so they are not inputs.
_LABEL_FILES = (LEDGER_NAME, TIMES_NAME, VOTES_NAME)


def code_digest(root: str | os.PathLike[str] | None = None) -> str:
    """sha256 over tamis' Python sources (pipeline/ and flows/ under `root`, default: this checkout or install)."""
    base = Path(root) if root is not None else Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for top in _CODE_ROOTS:
        for p in sorted((base / top).rglob("*.py")):
            h.update(str(p.relative_to(base)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _stat(path: Path | None) -> list[Any] | None:
    """(size, mtime_ns, inode) of a file; None when it does not exist (so its appearance changes the digest)."""
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _listing(folder: Path | None) -> list[Any] | None:
    """Every file under `folder` with its stat, sorted; None without a folder to look at. A missing folder lists
    as an empty one: a round makes the inbox it reads, and that alone changes nothing."""
    if folder is None:
        return None
    if not folder.is_dir():
        return []
    return sorted([str(p.relative_to(folder)), _stat(p)] for p in folder.rglob("*") if p.is_file())


@dataclass(frozen=True)
class RoundInputs:
    """What a round reads, digested (None when it cannot be read now), and the sources' digest within it: the ingest
    key's own input, handed to the ingest stage so a round walks its sources once at the start, not twice."""

    digest: str | None
    sources: str | None


def round_inputs(cfg: ProjectConfig, *, sources: str | None = None) -> RoundInputs:
    """Digest of what a round reads that can change between runs (module docstring), or RoundInputs(None, None)
    when they cannot be read now (the flow then reports why, stage by stage). The whole project config is one of
    those inputs. `sources`: the sources' digest when the caller has it (a round's record after it ran), else the
    sources are walked (a stat per image)."""
    from pipeline.data.ingest import (
        source_digest,  # the ingest key's own input: a stat per image under verify=stat
    )
    from pipeline.model.identity import library_versions

    art = Path(cfg.artifacts)
    try:
        model = Path(cfg.model.name_or_path)
        parts = {
            "config": cfg.model_dump(mode="json"),
            "code": code_digest(),
            "sources": sources if sources is not None else source_digest(cfg.data, art),
            "labels": {name: _stat(art / name) for name in _LABEL_FILES},
            "inbox": _listing(inbox_dir(art)),
            "model": _listing(model) if model.is_dir() else str(model),
            "libraries": library_versions(),  # an upgraded torch / transformers / peft / bitsandbytes retrains
            "embeddings_file": _stat(cfg.select.embeddings.path),
            "ground_truth": _stat(cfg.data.ground_truth),
        }
    except (OSError, TamisError) as exc:
        log.debug("round inputs unreadable (%s); the next run goes through the flow", exc)
        return RoundInputs(None, None)
    return RoundInputs(digest_json(parts), parts["sources"])


def _skip_reason(rounds_cfg: RoundsConfig, annotate: AnnotateConfig, simulate: bool | None) -> str | None:
    if simulated(rounds_cfg, simulate):
        return "the simulated annotator answers every round"
    if annotate.label_studio is not None:
        return "annotate.label_studio: new labels may be waiting on the server"
    return None


def record_round_inputs(artifacts: str | os.PathLike[str], state: RoundState, before: RoundInputs,
                        after: RoundInputs) -> None:
    """After a round: what it read when it started (`before`) and what is there now, with the outputs it reports.

    The sources are not walked again: a round never writes them, and its stages are keyed by the sources as they
    were when it started (`before.sources`), so that is what its outputs answer for. Images added or changed while it
    ran make the next `tamis round`'s walk differ from this record, so that run goes through the flow; a second walk
    here would only find the same (a stat per image: ~20 s at 10⁶ images, every round)."""
    outputs = [state.export_dir, state.relabel_dir, (state.adapter or {}).get("adapter_dir")]
    atomic_write_json(Path(artifacts) / ROUNDS_DIR / INPUTS_FILE, {
        "round": state.round, "before": before.digest, "after": after.digest,
        "outputs": [p for p in outputs if p],
    })


def unchanged_round(rounds_cfg: RoundsConfig, annotate: AnnotateConfig, artifacts: str | os.PathLike[str], *,
                    inputs: Callable[[], RoundInputs], simulate: bool | None = None) -> RoundState | None:
    """The last round's state when running the round again could only replay it (module docstring), else None.
    `inputs()`: round_inputs on the project now, called last (it walks the sources)."""
    reason = _skip_reason(rounds_cfg, annotate, simulate)
    if reason:
        log.debug("tamis round goes through the flow: %s", reason)
        return None
    path = Path(artifacts) / ROUNDS_DIR / INPUTS_FILE
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not rec.get("before") or rec.get("before") != rec.get("after"):
        return None
    states = completed_rounds(artifacts)
    if not states or states[-1].round != rec.get("round"):
        return None
    if not all(Path(p).exists() for p in rec.get("outputs", [])):
        return None
    return states[-1] if inputs().digest == rec["after"] else None


def unchanged_ingest(artifacts: str | os.PathLike[str], data: DataConfig, digest: str) -> dict[str, Any] | None:
    """The ingest stage's ref when its output for the sources as they are now (`digest`: source_digest) is on disk
    and verifies: `tamis ingest` then has nothing to run and needs no flow (the flow would reuse that folder)."""
    from pipeline.data.ingest import ingest_cached, record_latest

    ref = ingest_cached(artifacts, digest, data.model_dump(mode="json"))
    if ref is not None:
        record_latest(artifacts, ref)
    return ref


def unchanged_prepare(artifacts: str | os.PathLike[str], digest: str, *, data: DataConfig,
                      preprocess: PreprocessConfig, model: ModelConfig,
                      quality: QualityConfig) -> dict[str, Any] | None:
    """prepare_flow's refs ({"ingest", "prepare", "quality"}) when every one of its stages' outputs for the sources
    as they are now is on disk and verifies, else None (the flow runs what is missing)."""
    from pipeline import preprocess as prep
    from pipeline import quality as qual
    from pipeline.data.ingest import ingest_cached

    ingest = ingest_cached(artifacts, digest, data.model_dump(mode="json"))
    prepared = ingest and prep.preprocess_cached(prep.preprocess_params(
        artifacts, ingest, preprocess, model, data.max_image_pixels))
    checked = prepared and qual.quality_cached(qual.quality_params(artifacts, prepared, quality))
    if not checked:
        return None
    refs = {"prepare": prepared, "quality": checked}
    prep.record_latest(artifacts, refs)
    return {"ingest": ingest, **refs}
