"""Content-keyed shards of the ingested dataset: what is already ingested is never read or decoded again.

A shard (artifacts/ingest/shards/<key>/) holds the rows one ingest run kept (a datasets Arrow folder, `dataset/`)
and `rows.jsonl`, one record per source row it judged: kept (with its sample ID), quarantined (with the entry) or a
duplicate (of a sample ID). Rows are identified by a digest of what the source says about them (location, image
path, image content digest, question, answer, split, external ID), so a record stays true for as long as a row with
the same description is in the sources.

A later ingest with the same validation settings re-uses every shard of the previous one whose kept rows are all
still in the sources (a shard that lost a row, because its file was deleted or changed, is dropped and its other rows
are read again: at most SHARD_ROWS per shard), and writes the rows no re-used shard knows into new shards. The
ingested dataset is the concatenation of the shards in lineage order (re-used ones first, new ones after), put
together from hard links to the shards' Arrow files: no image byte is copied.

Shards no lineage names any more are left on disk; delete artifacts/ingest/shards/ to reclaim them (the next ingest
then reads everything once).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.codeversion import stage_version
from pipeline.config import DataConfig
from pipeline.data.multi import has_more
from pipeline.errors import ArtifactError
from pipeline.store import (
    atomic_dir,
    atomic_write_json,
    atomic_write_jsonl,
    column,
    digest_json,
    read_jsonl,
    read_manifest,
    save_dataset,
    stage_key,
    write_manifest,
)

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

SHARD_STAGE = "ingest-shard"
# A shard's records are ingest's judgements (validation, de-duplication, the readers' row descriptions): keyed by the
# code closure of pipeline.data.ingest, so an upgrade that changes them re-reads the rows instead of re-using them.
SHARD_VERSION = stage_version("2", "pipeline.data.ingest")
# Rows kept per shard at most: a file deleted from a shard costs a re-read of at most this many rows.
SHARD_ROWS = 10_000
_BATCH = 256


def shard_config(data: DataConfig) -> dict[str, Any]:
    """The settings a shard's judgements depend on beyond the rows' own descriptions (which carry question, answer,
    split and paths): the answer set and the pixel guard. Sources may be added or removed without losing shards."""
    # The columns too, where a conversation source adds some (a one-image project's lineage file keeps its name).
    more = {"columns": "more_images+context"} if has_more(data) else {}
    return {"answers": data.answers, "max_image_pixels": data.max_image_pixels, **more}


def shards_root(artifacts: str | os.PathLike[str]) -> Path:
    return Path(artifacts) / "ingest" / "shards"


def _lineage_path(artifacts: str | os.PathLike[str], data: DataConfig) -> Path:
    return shards_root(artifacts) / f"lineage-{digest_json(shard_config(data))[:16]}.json"


@dataclass
class Shard:
    key: str
    folder: Path
    records: list[dict[str, Any]]
    rows: int  # kept rows in its dataset

    def ref(self) -> dict[str, Any]:
        return {"key": self.key, "dir": str(self.folder), "rows": self.rows}


def reusable_shards(artifacts: str | os.PathLike[str], data: DataConfig, present: set[str]) -> list[Shard]:
    """The previous ingest's shards (same settings) whose kept rows are all in `present` (row descriptions), in
    lineage order; a shard whose files no longer verify is not re-used (its rows are read again)."""
    path = _lineage_path(artifacts, data)
    if not path.is_file():
        return []
    try:
        keys = json.loads(path.read_text(encoding="utf-8"))["shards"]
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("%s: unreadable shard lineage (%s); every row is ingested again", path, exc)
        return []
    out = []
    for key in keys:
        folder = shards_root(artifacts) / key[:16]
        try:
            m = read_manifest(folder)
        except ArtifactError as exc:
            log.warning("ingest: shard %s not re-used: %s", folder, exc)
            continue
        if m.stage != SHARD_STAGE or m.key != key or m.stage_version != SHARD_VERSION:
            continue
        records = read_jsonl(folder / "rows.jsonl")
        lost = sum(r["outcome"] == "kept" and r["desc"] not in present for r in records)
        if lost:
            log.info("ingest: shard %s not re-used: %d of its rows left the sources or changed", key[:16], lost)
            continue
        out.append(Shard(key, folder, records, m.info["rows"]))
    return out


def save_lineage(artifacts: str | os.PathLike[str], data: DataConfig, shards: list[Shard]) -> None:
    atomic_write_json(_lineage_path(artifacts, data), {"shards": [s.key for s in shards]})


class ShardWriter:
    """New shards for one ingest run: kept rows stream to Arrow files on disk (memory stays flat); the shards are
    written at `finish`, once every duplicate (and so every row's `sources`) is known."""

    def __init__(self, artifacts: str | os.PathLike[str], data: DataConfig, features: datasets.Features,
                 work: Path, parents: list[Shard]):
        self.root, self.config, self.features, self.work = shards_root(artifacts), shard_config(data), features, work
        self.parents = [s.key for s in parents]
        self._chunks: list[dict[str, Any]] = []
        self._batch: list[dict[str, Any]] = []
        self._writer = self._sink = None

    def _open_chunk(self) -> None:
        import pyarrow as pa

        path = self.work / f".shard-{os.getpid()}-{len(self._chunks)}.arrow"
        self._sink = pa.OSFile(str(path), "wb")
        self._writer = pa.ipc.new_stream(self._sink, self.features.arrow_schema)
        self._chunks.append({"path": path, "records": [], "kept": 0})

    def _flush(self) -> None:
        import pyarrow as pa

        if self._batch:
            self._writer.write_batch(pa.RecordBatch.from_pylist(self._batch, schema=self.features.arrow_schema))
            self._batch.clear()

    def _close_chunk(self) -> None:
        if self._writer is not None:
            self._flush()
            self._writer.close()
            self._sink.close()
            self._writer = self._sink = None

    def record(self, desc: str, outcome: str, **extra: Any) -> None:
        if not self._chunks or (outcome == "kept" and self._chunks[-1]["kept"] >= SHARD_ROWS):
            self._close_chunk()
            self._open_chunk()
        self._chunks[-1]["records"].append({"desc": desc, "outcome": outcome, **extra})

    def keep(self, desc: str, rec: dict[str, Any], kept: dict[str, Any]) -> None:
        """`kept`: what de-duplication compares later rows with (source, answer, split), kept in the record."""
        self.record(desc, "kept", sample_id=rec["sample_id"], kept=kept)
        self._chunks[-1]["kept"] += 1
        self._batch.append({**rec, "sources": []})  # filled in at `finish`, once all duplicates are known
        if len(self._batch) >= _BATCH:
            self._flush()

    def finish(self, sources_of: Callable[[str], list[str]], columns: list[str]) -> list[Shard]:
        import datasets

        self._close_chunk()
        out = []
        try:
            for chunk in self._chunks:
                inputs = {"parents": digest_json(self.parents), "records": digest_json(chunk["records"])}
                key = stage_key(SHARD_STAGE, SHARD_VERSION, inputs, self.config)
                folder = self.root / key[:16]
                try:
                    m = read_manifest(folder)
                    if m.key == key:  # the same rows judged the same way before (a re-run after a crash)
                        out.append(Shard(key, folder, chunk["records"], m.info["rows"]))
                        continue
                except ArtifactError:
                    pass
                ds = datasets.Dataset.from_file(str(chunk["path"]))
                ds = ds.remove_columns("sources").add_column(
                    "sources", [sources_of(s) for s in column(ds, "sample_id")], feature=self.features["sources"])
                with atomic_dir(folder / "dataset") as tmp:
                    # An empty dataset otherwise saves as zero files, which load_from_disk cannot read back.
                    save_dataset(ds.select_columns(columns), tmp, num_shards=1)
                n = len(ds)
                del ds
                atomic_write_jsonl(folder / "rows.jsonl", chunk["records"])
                write_manifest(folder, stage=SHARD_STAGE, stage_version=SHARD_VERSION, inputs=inputs,
                               config=self.config, outputs={"dataset": "dataset", "rows": "rows.jsonl"},
                               info={"rows": n})
                out.append(Shard(key, folder, chunk["records"], n))
        finally:
            for chunk in self._chunks:
                chunk["path"].unlink(missing_ok=True)
        return out


def link_datasets(parts: list[tuple[str, Path]], dest: Path, empty: Callable[[Path], None]) -> None:
    """`dest` = one saved dataset whose data files are hard links to the Arrow files of the saved datasets in
    `parts` ((tag, folder), in order; a copy where the filesystem has no hard links). `datasets.load_from_disk(dest)`
    reads their concatenation; no row is copied. `empty(tmp)` writes the dataset when `parts` is empty."""
    with atomic_dir(dest) as tmp:
        files, state = [], None
        for i, (tag, src) in enumerate(parts):
            state = json.loads((src / "state.json").read_text(encoding="utf-8"))
            for f in state["_data_files"]:
                name = f"{i:05d}-{tag}-{f['filename']}"
                try:
                    os.link(src / f["filename"], tmp / name)
                except OSError:
                    shutil.copyfile(src / f["filename"], tmp / name)
                files.append({"filename": name})
        if state is None:
            empty(tmp)
            return
        shutil.copyfile(parts[0][1] / "dataset_info.json", tmp / "dataset_info.json")
        state["_data_files"] = files
        state["_fingerprint"] = digest_json([tag for tag, _ in parts])[:16]
        (tmp / "state.json").write_text(json.dumps(state, indent=2), encoding="utf-8")


def assemble(shards: list[Shard], dest: Path, features: datasets.Features, columns: list[str]) -> None:
    """The ingested dataset at `dest`: the non-empty shards' rows, in shard order, linked (see link_datasets)."""
    import datasets

    def empty(tmp: Path) -> None:
        # An empty dataset otherwise saves as zero files, which load_from_disk cannot read back.
        datasets.Dataset.from_dict({c: [] for c in columns}, features=features).select_columns(
            columns).save_to_disk(str(tmp), num_shards=1)

    link_datasets([(s.key[:16], s.folder / "dataset") for s in shards if s.rows], dest, empty)


SHARDS_FILE = "shards.json"  # beside an ingested dataset: the shards it is the concatenation of


def dataset_shards(dataset: str | os.PathLike[str]) -> list[tuple[str, Path, str]] | None:
    """(shard key, dataset folder, content digest) of each shard an ingested `dataset` folder concatenates, in order;
    None for a dataset that is not made of shards (ingested by an older tamis, or any other saved dataset)."""
    listing = Path(dataset).parent / SHARDS_FILE
    if Path(dataset).name != "dataset" or not listing.is_file():
        return None
    out = []
    for ref in json.loads(listing.read_text(encoding="utf-8")):
        folder = Path(ref["dir"])
        m = read_manifest(folder, verify=False)  # verified when the ingest that lists it ran or was re-used
        out.append((ref["key"], folder / m.outputs["dataset"].path, m.outputs["dataset"].digest))
    return out
