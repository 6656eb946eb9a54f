"""Ingestion: every source → one validated Arrow dataset, with every rejected row quarantined and every exact duplicate
collapsed (and reported), so that  ingested + quarantined + duplicates == read  always holds.

Rows stream through an Arrow file on disk, so memory stays flat however large the pool; only the small per-row
`sources` lists are kept until the end.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.codeversion import stage_version
from pipeline.config import DataConfig, ProjectConfig, StageConfig
from pipeline.data.images import ImageRejected, open_image
from pipeline.data.readers import READERS, RawRow, Rejected
from pipeline.errors import DataError
from pipeline.schema import INGEST_COLUMNS, SPLITS, sample_id_for
from pipeline.store import (
    Manifest,
    atomic_dir,
    atomic_write_jsonl,
    canonical_json,
    digest_bytes,
    digest_json,
    digest_path,
    load_stage_dataset,
    reuse_or_compute,
    stage_key,
    write_manifest,
)

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

STAGE = "ingest"
# Bump when the library's ingestion output changes for the same inputs (Prefect cannot see edits in pipeline/).
INGEST_VERSION = stage_version("2", "pipeline.data.ingest")  # 2: the external_id column, warnings.jsonl
_BATCH = 256


def ingest_features() -> datasets.Features:
    from datasets import Features, List, Value

    s = Value("string")
    return Features({
        "sample_id": s, "image": Value("binary"), "image_path": s, "question": s, "answer": s, "split": s,
        "source": s, "sources": List(s), "width": Value("int32"), "height": Value("int32"), "mode": s,
        "external_id": s,
    })


def source_digest(cfg: DataConfig) -> str:
    """Content digest of every source file and every image (and text) its rows reference: the ingest cache input.

    It reads every source, so a source that cannot be read at all fails here, before any flow starts.
    """
    if not cfg.sources:
        raise DataError("data.sources is empty; add at least one source (kind + path) to the config")
    parts = []
    for src in cfg.sources:
        rows = []
        for item in READERS[src.kind]().rows(src, cfg):
            if isinstance(item, RawRow):
                rows.append([item.source, item.image_path, digest_bytes(item.image), item.question, item.answer,
                             item.split, item.external_id])
            else:
                rows.append([item.source, item.path, item.reason])
        # Manifests are small; a folder or saved dataset is fully covered by its rows' content.
        file = digest_path(src.path) if src.kind in ("jsonl", "csv", "label_studio") else None
        parts.append({"kind": src.kind, "path": str(src.path), "file": file, "rows": sorted(rows, key=canonical_json)})
    return digest_json(parts)


class _Accounting:
    """Collects what happened to each row read; owns the invariant the manifest reports."""

    def __init__(self) -> None:
        self.read = 0
        self.quarantine: list[dict[str, Any]] = []
        self.duplicates: list[dict[str, Any]] = []
        self.warnings: list[dict[str, Any]] = []  # rows kept, with something a person should know
        self.kept: dict[str, dict[str, Any]] = {}  # sample_id → {source, answer, split, sources}

    def reject(self, source: str, reason: str, path: str = "", **extra: Any) -> None:
        self.quarantine.append({"source": source, "path": path, "reason": reason, **extra})

    def counts(self) -> dict[str, int]:
        c = {"read": self.read, "ingested": len(self.kept), "quarantined": len(self.quarantine),
             "duplicates": len(self.duplicates)}
        assert c["ingested"] + c["quarantined"] + c["duplicates"] == c["read"], c
        return c


def _validate(row: RawRow, cfg: DataConfig, acc: _Accounting) -> dict[str, Any] | None:
    """A complete dataset row, or None after quarantining it with the reason."""
    try:
        img = open_image(row.image, max_pixels=cfg.max_image_pixels)
    except ImageRejected as exc:
        acc.reject(row.source, f"{exc.reason}; replace or remove the image", row.image_path)
        return None
    width, height, mode = img.width, img.height, img.mode
    img.close()
    split = row.split or ("train" if row.answer is not None else "pool")
    if split not in SPLITS:
        acc.reject(row.source, f"split {split!r} is not one of {list(SPLITS)}; fix the split value in the source",
                   row.image_path)
        return None
    if split in ("train", "test") and row.answer is None:
        acc.reject(row.source, f"split {split!r} needs an answer but the row has none; add the answer or use split "
                   "'pool'", row.image_path)
        return None
    if row.answer is not None and cfg.answers is not None and row.answer not in cfg.answers:
        acc.reject(row.source, f"answer {row.answer!r} is not in data.answers {cfg.answers}; fix the label or add it "
                   "to data.answers", row.image_path)
        return None
    return {
        "sample_id": sample_id_for(row.image, row.question), "image": row.image, "image_path": row.image_path,
        "question": row.question, "answer": row.answer, "split": split, "source": row.source,
        "width": width, "height": height, "mode": mode, "external_id": row.external_id,
    }


def _dedupe(rec: dict[str, Any], acc: _Accounting) -> bool:
    """True if `rec` is new; an exact duplicate is folded into the first row with the same ID (first one wins)."""
    kept = acc.kept.get(rec["sample_id"])
    if kept is None:
        acc.kept[rec["sample_id"]] = {"source": rec["source"], "answer": rec["answer"], "split": rec["split"],
                                      "sources": [rec["source"]]}
        return True
    kept["sources"].append(rec["source"])
    entry = {"sample_id": rec["sample_id"], "kept": kept["source"], "duplicate": rec["source"],
             "path": rec["image_path"]}
    conflicts = [f"{k} {kept[k]!r} kept, {rec[k]!r} dropped" for k in ("answer", "split") if kept[k] != rec[k]]
    if conflicts:
        entry["conflict"] = "; ".join(conflicts)
    acc.duplicates.append(entry)
    return False


def _read_all(cfg: DataConfig, acc: _Accounting, arrow_path: Path) -> None:
    import pyarrow as pa

    schema = ingest_features().arrow_schema
    batch: list[dict[str, Any]] = []
    with pa.OSFile(str(arrow_path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        def flush() -> None:
            if batch:
                writer.write_batch(pa.RecordBatch.from_pylist(batch, schema=schema))
                batch.clear()

        for src in cfg.sources:
            log.info("ingest: reading %s source %s", src.kind, src.path)
            for item in READERS[src.kind]().rows(src, cfg):
                acc.read += 1
                if isinstance(item, Rejected):
                    acc.reject(item.source, item.reason, item.path)
                else:
                    rec = _validate(item, cfg, acc)
                    if rec is not None and item.note:
                        acc.warnings.append({"source": item.source, "path": item.image_path, "warning": item.note})
                    if rec is not None and _dedupe(rec, acc):
                        batch.append({**rec, "sources": []})  # filled in at the end, once all duplicates are known
                        if len(batch) >= _BATCH:
                            flush()
                if acc.read % 1000 == 0:
                    log.info("ingest: %d rows read, %d kept, %d quarantined", acc.read, len(acc.kept),
                             len(acc.quarantine))
        flush()


def ingest(cfg: ProjectConfig, out_dir: Path, *, digest: str | None = None) -> Manifest:
    """Read every source of `cfg.data` into `out_dir` (dataset/, quarantine.jsonl, duplicates.jsonl, manifest.json).

    `digest` is `source_digest(cfg.data)` when the caller already computed it (the flow does, for its cache key).
    """
    import datasets

    data = cfg.data
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    digest = digest or source_digest(data)
    acc = _Accounting()
    arrow_path = out_dir / f".rows-{os.getpid()}.arrow"
    try:
        _read_all(data, acc, arrow_path)
        with atomic_dir(out_dir / "dataset") as tmp:
            ds = datasets.Dataset.from_file(str(arrow_path))
            sources = [acc.kept[sid]["sources"] for sid in ds["sample_id"]]
            ds = ds.remove_columns("sources").add_column("sources", sources, feature=ingest_features()["sources"])
            # An empty dataset otherwise saves as zero shards, which load_from_disk cannot read back.
            ds.select_columns(list(INGEST_COLUMNS)).save_to_disk(str(tmp), num_shards=None if len(ds) else 1)
            del ds
    finally:
        arrow_path.unlink(missing_ok=True)
    atomic_write_jsonl(out_dir / "quarantine.jsonl", acc.quarantine)
    atomic_write_jsonl(out_dir / "duplicates.jsonl", acc.duplicates)
    atomic_write_jsonl(out_dir / "warnings.jsonl", acc.warnings)
    counts = acc.counts()
    splits = Counter(k["split"] for k in acc.kept.values())
    conflicts = sum("conflict" in d for d in acc.duplicates)
    if conflicts:
        log.warning("ingest: %d duplicate(s) disagree on answer or split with the row kept; see %s", conflicts,
                    out_dir / "duplicates.jsonl")
    if acc.warnings:
        log.warning("ingest: %d row(s) kept with a warning (e.g. %s: %s); see %s", len(acc.warnings),
                    acc.warnings[0]["source"], acc.warnings[0]["warning"], out_dir / "warnings.jsonl")
    if counts["quarantined"]:
        log.warning("ingest: %d of %d rows quarantined; reasons in %s", counts["quarantined"], counts["read"],
                    out_dir / "quarantine.jsonl")
    if not counts["ingested"]:
        log.warning("ingest: no usable rows in %d read; later stages have nothing to work on", counts["read"])
    log.info("ingest: %s", counts)
    return write_manifest(
        out_dir,
        stage=STAGE,
        stage_version=INGEST_VERSION,
        inputs={"sources": digest},
        config=cfg.section("data"),
        outputs={"dataset": "dataset", "quarantine": "quarantine.jsonl", "duplicates": "duplicates.jsonl",
                 "warnings": "warnings.jsonl"},
        info={"counts": counts, "splits": {s: splits.get(s, 0) for s in SPLITS}, "duplicate_conflicts": conflicts,
              "warnings": len(acc.warnings)},
    )


def load_ingested(folder: str | os.PathLike[str]) -> datasets.Dataset:
    """The ingested dataset in `folder`, after checking every output against the digests its manifest recorded."""
    return load_stage_dataset(folder, STAGE)


def ingest_dir(artifacts: str | os.PathLike[str], digest: str, data_config: dict[str, Any]) -> Path:
    key = stage_key(STAGE, INGEST_VERSION, {"sources": digest}, data_config)
    return Path(artifacts) / STAGE / key[:16]


def ingest_stage(artifacts: str | os.PathLike[str], source_digest: str, data_config: dict[str, Any],
                 out_dir: str) -> dict[str, Any]:
    """The ingest stage: the sources of `data_config` ingested into `out_dir` (or the verified folder already
    there). Returns {"dir", "digest", "counts"}."""
    key = stage_key(STAGE, INGEST_VERSION, {"sources": source_digest}, data_config)
    cfg = StageConfig({"data": data_config}, artifacts=artifacts)
    m = reuse_or_compute(out_dir, key, lambda: ingest(cfg, Path(out_dir), digest=source_digest))
    return {"dir": str(out_dir), "digest": m.key, "counts": m.info["counts"]}


LATEST = "latest.json"  # artifacts/ingest/latest.json: the ref of the last ingest run


def record_latest(artifacts: str | os.PathLike[str], ref: dict[str, Any]) -> None:
    """Keep the ref of the last ingest run: labels can be imported before any round (pipeline.annotation.labels)."""
    from pipeline.store import atomic_write_json

    atomic_write_json(Path(artifacts) / STAGE / LATEST, ref)
