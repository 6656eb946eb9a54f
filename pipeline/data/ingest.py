"""Ingestion: every source → one validated Arrow dataset, with every rejected row quarantined and every exact duplicate
collapsed (and reported), so that  ingested + quarantined + duplicates == read  always holds.

Rows stream through an Arrow file on disk, so memory stays flat however large the pool; only the small per-row
`sources` lists are kept until the end.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.boxes.answer import label_problem
from pipeline.codeversion import stage_version
from pipeline.config import DataConfig, SourceConfig
from pipeline.data.file_index import FileIndex, open_index
from pipeline.data.images import ImageRejected, open_image
from pipeline.data.listing import Listings, open_listings, source_files
from pipeline.data.multi import add_more_features, has_more, more_columns, row_key_more
from pipeline.data.readers import READERS, RawRow, Rejected
from pipeline.data.shards import SHARDS_FILE, Shard, ShardWriter, assemble, reusable_shards, save_lineage
from pipeline.errors import DataError
from pipeline.fields.answers import check_label
from pipeline.schema import INGEST_COLUMNS, MAX_QUESTION_CHARS, MORE_COLUMNS, SPLITS, sample_id_of
from pipeline.store import (
    Manifest,
    atomic_write_json,
    atomic_write_jsonl,
    canonical_json,
    digest_json,
    digest_path,
    find_valid_manifest,
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


def ingest_features() -> datasets.Features:
    from datasets import Features, List, Value

    s = Value("string")
    return Features({
        "sample_id": s, "image": Value("binary"), "image_path": s, "question": s, "answer": s, "split": s,
        "source": s, "sources": List(s), "width": Value("int32"), "height": Value("int32"), "mode": s,
        "external_id": s,
    })


# How changes are found, not what the rows are (every mode gives the same digests): not in the ingest key, so
# switching them re-uses every output.
_HOW_CHANGES_ARE_FOUND = ("verify", "sweep_every")


def ingest_key_config(data_config: dict[str, Any]) -> dict[str, Any]:
    """The `data` section as the ingest stage is keyed on it: without `verify` and `sweep_every`."""
    return {k: v for k, v in data_config.items() if k not in _HOW_CHANGES_ARE_FOUND}


def _row_key(item: RawRow | Rejected) -> list[Any]:
    if isinstance(item, RawRow):
        return [item.source, item.image_path, item.image_digest, item.question, item.answer, item.split,
                item.external_id, *row_key_more(item)]
    return [item.source, item.path, item.reason]


def _items(src: SourceConfig, cfg: DataConfig, files: FileIndex) -> Iterator[RawRow | Rejected]:
    """A source's rows located through `files`: image files are stat'ed (read only when new or changed), so the
    rows carry digests, not bytes. Bytes a source holds itself (saved datasets) are dropped once digested."""
    for item in READERS[src.kind]().rows(src, cfg, files):
        if isinstance(item, RawRow) and item.image:
            item = replace(item, image=b"", digest=item.image_digest)
        yield item


Parts = list[tuple[SourceConfig, list[RawRow | Rejected], list[str | None]]]


def _walk(cfg: DataConfig, files: FileIndex) -> Parts:
    """Every source's rows (_items), held, with each row's description (_desc; None for a rejected row), computed
    once: what an ingest that runs judges."""
    parts = []
    for src in cfg.sources:
        items = list(_items(src, cfg, files))
        parts.append((src, items, [_desc(i) if isinstance(i, RawRow) else None for i in items]))
    return parts


def _source_entry(src: SourceConfig, items: Iterable[RawRow | Rejected]) -> dict[str, Any]:
    """What the ingest key says of one source: its file (manifests are small and always read) and a digest of its
    rows' descriptions that does not depend on their order. Each row is folded into 32 bytes as it comes, so a
    source of 10⁶ images costs 32 MB here, not its rows (~2 KB each) held and sorted as JSON."""
    import numpy as np

    file = digest_path(src.path) if src.kind in ("jsonl", "csv", "label_studio", "coco") else None
    folded = bytearray()  # 32 bytes a row, no object per row: 10⁶ bytes objects in a list were ~70 MB more
    for i in items:
        folded += hashlib.sha256(canonical_json(_row_key(i)).encode("utf-8")).digest()
    rows = np.sort(np.frombuffer(bytes(folded), dtype="V32"), kind="stable") if folded else np.zeros(0, "V32")
    # The rows' digests sorted and concatenated: the same bytes the earlier per-row loop fed to sha256.
    return {"kind": src.kind, "path": str(src.path), "file": file, "rows": hashlib.sha256(rows.tobytes()).hexdigest(),
            "count": len(rows)}


def _digest_parts(parts: Parts) -> str:
    return digest_json([_source_entry(src, items) for src, items, _ in parts])


def source_digest(cfg: DataConfig, artifacts: str | os.PathLike[str] | None = None) -> str:
    """Content digest of every source file and every image (and text) its rows reference: the ingest cache input.

    With `artifacts`, a source whose folders' listings did not move since its last walk is answered by the entry that
    walk recorded (`data.verify: listing`, pipeline/data/listing.py: a stat per folder); any other source is walked,
    its image digests coming from the project's file index (artifacts/ingest/file_index.npz): an unchanged file costs
    a stat, not a read, unless `data.verify: content` re-reads every file. The digest is the same in every mode (and
    the same as without artifacts, which reads everything). A source that cannot be read at all fails here, before
    any flow starts. Rows are streamed: memory does not grow with the pool.
    """
    if not cfg.sources:
        raise DataError("data.sources is empty; add at least one source (kind + path) to the config")
    files = open_index(artifacts, cfg.verify)
    listings = open_listings(artifacts)
    # Every sweep_every-th run looks up every file: a file rewritten in place leaves its folder's mtime as it was.
    sweep = cfg.verify != "listing" or listings.runs >= cfg.sweep_every
    keys = [_listing_key(src, cfg) for src in cfg.sources]
    entries = [_listed_entry(src, cfg, key, files, listings, sweep) for src, key in zip(cfg.sources, keys, strict=True)]
    if listings.answered:
        files.keep_unseen()  # the answered sources' files were not looked up, and are still there
    files.save()
    listings.save(set(keys))
    # The file lookups first: they are what a run costs (the listing only says how many it spared).
    log.info("ingest: %d image files looked up, %d read (new, changed or verify=content), %d answered by the file "
             "index; %d of %d source(s) answered by their folder listing (verify=%s%s)", files.hits + files.reads,
             files.reads, files.hits, listings.answered, len(keys), cfg.verify,
             ", every file swept this run" if sweep and cfg.verify == "listing" else "")
    return digest_json(entries)


def _listing_key(src: SourceConfig, cfg: DataConfig) -> str:
    """What a source's entry depends on besides its files: its config (its path resolved: a relative one names
    another folder from another working directory), the data section's and the ingest code."""
    data = ingest_key_config(cfg.model_dump(mode="json", exclude={"sources"}))
    return digest_json([INGEST_VERSION, src.model_dump(mode="json"), str(Path(src.path).resolve()), data])


def _listed_entry(src: SourceConfig, cfg: DataConfig, key: str, files: FileIndex, listings: Listings,
                  sweep: bool) -> dict[str, Any]:
    """The source's entry (_source_entry): the recorded one when its listing did not move and no sweep is due, else
    from a walk through the file index, whose listing is then recorded for the next run."""
    if not sweep and (entry := listings.answer(key)) is not None:
        return entry
    start, racy = time.time_ns(), files.racy
    files.folders.clear()
    entry = _source_entry(src, _items(src, cfg, files))
    listings.record(key, entry, files.folders | set(source_files(src)), start, racy_files=files.racy > racy)
    return entry


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
    if len(row.question) > MAX_QUESTION_CHARS:
        acc.reject(row.source, f"question is {len(row.question):,} characters, over the {MAX_QUESTION_CHARS:,} a "
                   "prompt holds; shorten it in the source (a question, not a document)", row.image_path)
        return None
    split = row.split or ("train" if row.answer is not None else "pool")
    if split not in SPLITS:
        acc.reject(row.source, f"split {split!r} is not one of {list(SPLITS)}; fix the split value in the source",
                   row.image_path)
        return None
    if split in ("train", "test") and row.answer is None:
        acc.reject(row.source, f"split {split!r} needs an answer but the row has none; add the answer or use split "
                   "'pool'", row.image_path)
        return None
    if row.answer is not None and cfg.scored_answers is not None and row.answer not in cfg.scored_answers:
        acc.reject(row.source, f"answer {row.answer!r} is not in data.answers {cfg.answers}; fix the label or add it "
                   "to data.answers", row.image_path)
        return None
    if row.answer is not None and cfg.box_labels is not None and (why := label_problem(row.answer, cfg.box_labels)):
        acc.reject(row.source, f"{why}; fix the boxes or add the classes to data.answers", row.image_path)
        return None
    answer = row.answer
    if answer is not None and (schema := cfg.schema) is not None:
        checked = check_label(answer, schema)  # stored as its canonical text: the training target
        if checked.canonical is None:
            acc.reject(row.source, str(checked.problem), row.image_path, fields=list(checked.fields))
            return None
        answer = checked.canonical
    more = more_columns(row, cfg.max_image_pixels) if has_more(cfg) else {}
    if isinstance(more, str):
        acc.reject(row.source, more, row.image_path)
        return None
    sid = sample_id_of([row.image, *(m.image for m in row.more)], row.question, row.context)
    return {
        "sample_id": sid, "image": row.image, "image_path": row.image_path,
        "question": row.question, "answer": answer, "split": split, "source": row.source,
        "width": width, "height": height, "mode": mode, "external_id": row.external_id, **more,
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


def _desc(item: RawRow) -> str:
    """A row's identity for shard records: everything the source says about it, with the image as its digest."""
    return digest_json(_row_key(item))[:32]


def _embedded_bytes(cfg: DataConfig, parts: Parts, needed: set[str]) -> dict[str, bytes]:
    """Image bytes held inside a source (saved datasets), for the rows in `needed` (by location) only."""
    out: dict[str, bytes] = {}
    for src, items, _ in parts:
        if any(isinstance(i, RawRow) and i.source in needed for i in items):
            for item in READERS[src.kind]().rows(src, cfg):
                if isinstance(item, RawRow) and item.source in needed and not item.image_path:
                    out[item.source] = item.image
    return out


def _read_new(item: RawRow, embedded: dict[str, bytes]) -> RawRow | Rejected:
    """The row with its image bytes, for validation; the walk only stat'ed the file."""
    if not item.image_path:
        return replace(item, image=embedded[item.source], digest=None)
    more = []
    for one in (item, *item.more):
        try:
            more.append(replace(one, image=Path(one.image_path).read_bytes(), digest=None))
        except OSError as exc:
            return Rejected(item.source, f"cannot read {one.image_path}: {exc.strerror}; fix the file and ingest "
                            "again", one.image_path)
    return replace(more[0], more=tuple(more[1:]))


def _judge(cfg: DataConfig, parts: Parts, acc: _Accounting, reused: list[Shard], writer: ShardWriter) -> int:
    """Account for every row read, in source order; rows no re-used shard knows are read, validated, de-duplicated
    (against everything kept so far, re-used rows first: the first ingested wins) and written to new shards.
    Returns how many rows were read from disk."""
    known: dict[str, dict[str, Any]] = {}
    for shard in reused:
        for r in shard.records:
            known[r["desc"]] = r
            if r["outcome"] == "kept":
                acc.kept[r["sample_id"]] = {**r["kept"], "sources": []}
    reused_ids = set(acc.kept)
    needed = {i.source for _, items, descs in parts for i, d in zip(items, descs, strict=True)
              if d is not None and d not in known and not i.image_path}
    embedded = _embedded_bytes(cfg, parts, needed) if needed else {}
    fresh = 0
    for _, items, descs in parts:
        for item, desc in zip(items, descs, strict=True):
            acc.read += 1
            if isinstance(item, Rejected):
                acc.reject(item.source, item.reason, item.path)
                continue
            r = known.get(desc)
            if r is not None and (r["outcome"] == "quarantined" or r["sample_id"] in reused_ids):
                if r["outcome"] == "quarantined":
                    acc.quarantine.append(r["entry"])
                elif r["outcome"] == "duplicate":
                    acc.duplicates.append(r["entry"])
                if r["outcome"] != "quarantined" and item.note:
                    acc.warnings.append({"source": item.source, "path": item.image_path, "warning": item.note})
                continue
            fresh += 1
            full = _read_new(item, embedded)
            if isinstance(full, Rejected):  # vanished or unreadable since the walk: not judged, not recorded
                acc.reject(full.source, full.reason, full.path)
                continue
            before = len(acc.quarantine)
            rec = _validate(full, cfg, acc)
            if rec is None:
                writer.record(desc, "quarantined", entry=acc.quarantine[before])
                continue
            if item.note:
                acc.warnings.append({"source": item.source, "path": item.image_path, "warning": item.note})
            if _dedupe(rec, acc):
                writer.keep(desc, rec, {k: rec[k] for k in ("source", "answer", "split")})
            else:
                writer.record(desc, "duplicate", sample_id=rec["sample_id"], entry=acc.duplicates[-1])
            if fresh % 1000 == 0:
                log.info("ingest: %d new rows read, %d kept in all, %d quarantined", fresh, len(acc.kept),
                         len(acc.quarantine))
    return fresh


def ingest(data: DataConfig, artifacts: str | os.PathLike[str], out_dir: Path, *,
           digest: str | None = None) -> Manifest:
    """Read every source of `data` into `out_dir` (dataset/, shards.json, quarantine.jsonl, duplicates.jsonl,
    warnings.jsonl, manifest.json); `artifacts` holds the file index, the shards and their lineage.

    Rows already ingested by the previous run (same answer set and pixel guard) come from its shards without being
    read; only new or changed rows are read, validated and written to new shards (pipeline/data/shards.py). `digest`
    is `source_digest(data, artifacts)` when the caller already computed it (the flow does, for its cache key).
    """
    out_dir, artifacts = Path(out_dir), Path(artifacts)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = open_index(artifacts, data.verify)
    if not data.sources:
        raise DataError("data.sources is empty; add at least one source (kind + path) to the config")
    parts = _walk(data, files)
    files.save()
    digest = digest or _digest_parts(parts)
    present = {d for _, _, descs in parts for d in descs if d is not None}
    reused = reusable_shards(artifacts, data, present)
    acc = _Accounting()
    features, columns = ingest_features(), list(INGEST_COLUMNS)
    if has_more(data):  # pipeline/schema.py: only a project with a conversation source has these columns
        features, columns = add_more_features(features), [*columns, *MORE_COLUMNS]
    writer = ShardWriter(artifacts, data, features, out_dir, reused)
    fresh = _judge(data, parts, acc, reused, writer)
    shards = reused + writer.finish(lambda sid: acc.kept[sid]["sources"], columns)
    save_lineage(artifacts, data, shards)
    assemble(shards, out_dir / "dataset", features, columns)
    atomic_write_json(out_dir / SHARDS_FILE, [s.ref() for s in shards])
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
    log.info("ingest: %s; %d rows read from disk, %d shards re-used, %d new", counts, fresh, len(reused),
             len(shards) - len(reused))
    return write_manifest(
        out_dir,
        stage=STAGE,
        stage_version=INGEST_VERSION,
        inputs={"sources": digest},
        config=ingest_key_config(data.model_dump(mode="json")),
        outputs={"dataset": "dataset", "shards": SHARDS_FILE, "quarantine": "quarantine.jsonl",
                 "duplicates": "duplicates.jsonl", "warnings": "warnings.jsonl"},
        info={"counts": counts, "splits": {s: splits.get(s, 0) for s in SPLITS}, "duplicate_conflicts": conflicts,
              "warnings": len(acc.warnings), "rows_read": fresh, "shards": len(shards),
              "shards_reused": len(reused)},
    )


def load_ingested(folder: str | os.PathLike[str]) -> datasets.Dataset:
    """The ingested dataset in `folder`, after checking every output against the digests its manifest recorded."""
    return load_stage_dataset(folder, STAGE)


def ingest_dir(artifacts: str | os.PathLike[str], digest: str, data_config: dict[str, Any]) -> Path:
    key = stage_key(STAGE, INGEST_VERSION, {"sources": digest}, ingest_key_config(data_config))
    return Path(artifacts) / STAGE / key[:16]


@dataclass(frozen=True)
class IngestParams:
    """The ingest stage's parameters, built by ingest_params; its cache key is their `asdict()`."""

    artifacts: str
    source_digest: str  # source_digest: the sources' content, computed with the configured verify mode
    data_config: dict[str, Any]  # the data section as the stage is keyed on it (ingest_key_config)
    out_dir: str


def ingest_params(data: DataConfig, artifacts: str | os.PathLike[str], digest: str | None = None) -> IngestParams:
    """The ingest stage's parameters for the sources of `data` whose content digest is `digest` (source_digest's, when
    the caller has not computed it already)."""
    digest = digest or source_digest(data, artifacts)
    data_config = ingest_key_config(data.model_dump(mode="json"))
    return IngestParams(artifacts=str(artifacts), source_digest=digest, data_config=data_config,
                        out_dir=str(ingest_dir(artifacts, digest, data_config)))


def ingest_stage(params: IngestParams) -> dict[str, Any]:
    """The ingest stage: the sources of the data section ingested into `params.out_dir` (or the verified folder
    already there). Returns {"dir", "digest", "counts"}.

    The key leaves out `verify` and `sweep_every`: the caller computed `source_digest` (with the configured mode) just
    before, which refreshed the file index of any source it walked, so the body's own walk trusts it (stat)."""
    data_config, out_dir = ingest_key_config(params.data_config), params.out_dir
    key = stage_key(STAGE, INGEST_VERSION, {"sources": params.source_digest}, data_config)
    data = DataConfig.model_validate({**data_config, "verify": "stat"})
    m = reuse_or_compute(out_dir, key, lambda: ingest(data, params.artifacts, Path(out_dir),
                                                      digest=params.source_digest))
    return {"dir": str(out_dir), "digest": m.key, "counts": m.info["counts"]}


def ingest_cached(artifacts: str | os.PathLike[str], source_digest: str,
                  data_config: dict[str, Any]) -> dict[str, Any] | None:
    """The ingest stage's ref when its verified output for these sources is already on disk, else None: what lets
    `tamis ingest` answer "nothing changed" without starting Prefect (the stage would only reuse that folder)."""
    data_config = ingest_key_config(data_config)
    key = stage_key(STAGE, INGEST_VERSION, {"sources": source_digest}, data_config)
    out = ingest_dir(artifacts, source_digest, data_config)
    m = find_valid_manifest(out, key)
    return None if m is None else {"dir": str(out), "digest": m.key, "counts": m.info["counts"]}


LATEST = "latest.json"  # artifacts/ingest/latest.json: the ref of the last ingest run


def record_latest(artifacts: str | os.PathLike[str], ref: dict[str, Any]) -> None:
    """Keep the ref of the last ingest run: labels can be imported before any round (pipeline.annotation.labels)."""
    from pipeline.store import atomic_write_json

    atomic_write_json(Path(artifacts) / STAGE / LATEST, ref)
