"""`tamis export-data`: the labeled set as a training framework reads it (docs/formats.md).

    DIR/images/...       every exported image under its own name and folders (pipeline/dataexport/images.py)
    DIR/<format files>   the records (pipeline/dataexport/writers.py): train, and test with --include-test
    DIR/lineage.json     the labels behind it: the ledger's size and digest, each label's entry and votes, counts

The labels are those the next round would train on (pipeline/round/plan.py round_labels): the answers the data came with
on its train split, overridden by the ledger's current label of each sample, after the consensus of every raw vote
as `round` would settle it now (derived, not written: an export changes nothing in the project). The test split
(what every round evaluates on) stays out unless asked for, and then in its own file.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import AnnotateConfig, DataConfig
from pipeline.dataexport.images import SourceImage, common_root, own_name, place, write_images
from pipeline.dataexport.records import Sample, turns_of
from pipeline.dataexport.writers import get_writer
from pipeline.errors import DataError


@dataclass(frozen=True)
class CurrentLabels:
    """The labels an export holds, per split, and the ledger entries behind them."""

    train: dict[str, str]  # sample_id → answer
    test: dict[str, str]
    entries: dict[str, dict[str, Any]]  # sample_id → its ledger entry (or the consensus entry not yet written)
    pending: int  # labels the consensus changes that no round has written to the ledger yet
    not_in_dataset: int  # ledger labels of samples the dataset no longer holds (`tamis labels orphans`)


def ledger_with_consensus(artifacts: Path, annotate: AnnotateConfig,
                          answers: list[str] | None) -> tuple[dict[str, dict[str, Any]], int]:
    """(sample_id → current entry, how many come from a consensus no round wrote yet): the ledger's newest entries
    overlaid with the entries apply_consensus would append now."""
    from pipeline.annotation.consensus import derive_consensus
    from pipeline.annotation.ledger import Ledger, ledger_path
    from pipeline.annotation.redundancy import requeued_ids
    from pipeline.round.plan import import_round

    current = Ledger(ledger_path(artifacts)).current()
    _, pending = derive_consensus(artifacts, annotate, answers=answers, round_index=import_round(artifacts),
                                  requeued=requeued_ids(artifacts))
    return {**current, **{e["sample_id"]: e for e in pending}}, len(pending)


def current_labels(artifacts: Path, ds: Any, annotate: AnnotateConfig, answers: list[str] | None) -> CurrentLabels:
    """The next round's training labels (rounds.round_labels) and the labeled test split, from dataset `ds`. A test
    row never leaves as a training row, even with a ledger label: it would score the exported model on its own
    training data."""
    import pyarrow.compute as pc

    from pipeline.round.plan import PoolData, round_labels

    entries, pending = ledger_with_consensus(artifacts, annotate, answers)
    pool = PoolData.of(ds)
    test_ids = set(pc.filter(pool.ids, pc.equal(pool.splits, "test")).to_pylist())
    known = pool.index.knows(list(entries))
    train = {s: a for s, a in round_labels(pool, {s: e["label"] for s, e in entries.items()}).items()
             if s not in test_ids}
    return CurrentLabels(train, dict(pool.test_rows()), entries, pending,
                         sum(not k for k in known))


def project_dataset(artifacts: Path) -> tuple[Path, Any]:
    import datasets

    from pipeline.annotation.labels import latest_dataset

    folder = latest_dataset(artifacts)
    if folder is None:
        raise DataError(f"{artifacts}: no ingested dataset to export labels of; run `tamis ingest` (or a round) first")
    return folder, datasets.load_from_disk(str(folder))


ImageKey = tuple[str, int]  # (sample_id, the image's place in the sample: 0 the first)


def image_paths(ds: Any) -> list[str]:
    """Every image file of the dataset, the later images of several-image samples (`more_images`) included."""
    import pyarrow.compute as pc

    from pipeline.store import arrow_column

    paths = arrow_column(ds, "image_path").to_pylist()
    if "more_images" in ds.column_names:
        paths += pc.list_flatten(arrow_column(ds, "more_images")).field("image_path").to_pylist()
    return paths


def _pictures(r: Mapping[str, Any]) -> list[tuple[str, bytes]]:
    """(file, ingested bytes) of each image of an ingested row, in order."""
    return [(r["image_path"] or "", r["image"]),
            *((m["image_path"] or "", m["image"]) for m in r.get("more_images") or [])]


def build_samples(ds: Any, labels: Mapping[str, Mapping[str, str]]) -> tuple[dict[str, list[Sample]],
                                                                               dict[ImageKey, SourceImage],
                                                                               Callable[[ImageKey], bytes],
                                                                               list[dict[str, str]]]:
    """(split → samples sorted by image names, (sample_id, i) → its i-th source image, the same key → its ingested
    bytes, renamed files) for `labels` (split → sample_id → answer). The bytes are read again when written, never all
    held. A row's context (pipeline/schema.py) becomes its earlier turns."""
    from pipeline.idindex import IdIndex
    from pipeline.schema import MORE_COLUMNS
    from pipeline.store import digest_bytes

    root = common_root(image_paths(ds))
    wanted = sorted({s for split in labels.values() for s in split})
    at = IdIndex.of_dataset(ds).rows(wanted)
    more = [c for c in MORE_COLUMNS if c in ds.column_names]
    rows = ds.select(sorted(int(i) for i in at if i >= 0)).select_columns(
        ["sample_id", "image", "image_path", "question", *more])
    sources, texts, named, where = {}, {}, {}, {}
    for i, r in enumerate(rows):
        sid = r["sample_id"]
        for k, (path, data) in enumerate(_pictures(r)):
            sources[(sid, k)] = SourceImage(sid if k == 0 else f"{sid}_{k + 1}", path, digest_bytes(data))
            named[(sid, k)] = (own_name(sources[(sid, k)], root, data), sources[(sid, k)].digest)
        texts[sid], where[sid] = (r["question"], r.get("context") or []), i
    files, renamed = place(named)
    images: dict[str, tuple[str, ...]] = {}
    for (sid, _), f in sorted(files.items()):  # each sample's files in its images' order
        images[sid] = (*images.get(sid, ()), f)
    splits = {split: sorted((Sample(s, images[s], turns, split, system) for s, a in ids.items() if s in texts
                             for system, turns in [turns_of(texts[s][1], texts[s][0], a)]),
                            key=lambda x: (x.images, x.id))
              for split, ids in labels.items()}

    def read(key: ImageKey) -> bytes:
        return _pictures(rows[where[key[0]]])[key[1]][1]

    return splits, sources, read, renamed


@dataclass(frozen=True)
class DataExportResult:
    dir: Path
    format: str
    files: list[Path]
    counts: dict[str, int]  # train, test, images linked / copied / written
    lineage: Path


def data_lineage(artifacts: Path, labels: CurrentLabels, splits: Mapping[str, list[Sample]], *, fmt: str,
                 annotate: AnnotateConfig, dataset: Path, renamed: list[dict[str, str]]) -> dict[str, Any]:
    """lineage.json: the ledger (entries, digest) and every exported label traced as export-model traces its
    adapter's (export_model.trace_label), with its split and file; paths relative only."""
    from pipeline.annotation.ledger import Ledger, ledger_path
    from pipeline.export_model.provenance import annotators, logged_votes, shareable_path, trace_label
    from pipeline.round.plan import import_round
    from pipeline.round_state import completed_rounds
    from pipeline.store import digest_file

    ledger, nxt = ledger_path(artifacts), import_round(artifacts)
    logged = logged_votes(artifacts, nxt)
    # A test row's answer is the one the data came with (what the rounds evaluate on), whatever the ledger says.
    rows = [{**trace_label(s.id, s.answer, labels.entries.get(s.id) if split == "train" else None, logged,
                           artifacts), "split": split, "files": list(s.images)}
            for split, samples in splits.items() for s in samples]
    done = completed_rounds(artifacts)
    return {
        "format": fmt,
        "ledger": {"file": shareable_path(ledger, artifacts), "entries": len(Ledger(ledger).entries()),
                   "digest": digest_file(ledger) if ledger.is_file() else None},
        "round": nxt, "last_round": done[-1].round if done else None,
        "dataset": shareable_path(dataset, artifacts), "consensus": annotate.consensus,
        "annotators": annotators(rows),
        "counts": {**{split: len(samples) for split, samples in splits.items()},
                   "from_ledger": sum(r["source"] == "ledger" for r in rows),
                   "seed": sum(r["source"] == "seed" for r in rows), "consensus_not_yet_in_ledger": labels.pending,
                   "ledger_labels_not_in_dataset": labels.not_in_dataset},
        "renamed": renamed,
        "labels": rows,
    }


def export_data(out: str | os.PathLike[str], *, artifacts: str | os.PathLike[str], data: DataConfig,
                annotate: AnnotateConfig, fmt: str, include_test: bool = False,
                force: bool = False) -> DataExportResult:
    """Write DIR/images/, the format's files and DIR/lineage.json (module docstring). A DIR that is not empty needs
    `force` (export_model.check_out), one in the project's artifacts is refused."""
    from pipeline.export_model.files import check_out
    from pipeline.store import atomic_write_json

    artifacts, writer = Path(artifacts), get_writer(fmt)
    out = check_out(out, artifacts, force=force, names=(*writer.files, "images", "lineage.json"),
                    command=f"export-data --format {fmt}")
    folder, ds = project_dataset(artifacts)
    labels = current_labels(artifacts, ds, annotate, data.answers)
    if not labels.train:
        raise DataError(f"{artifacts}: no labeled training samples yet (no seed answers on the train split, no "
                        "ledger label); import labels (`tamis labels import`) or run a round first")
    wanted = {"train": labels.train, **({"test": labels.test} if include_test else {})}
    splits, sources, read, renamed = build_samples(ds, wanted)
    out.mkdir(parents=True, exist_ok=True)
    counts = write_images(out, {(s.id, k): f for rows in splits.values() for s in rows
                                for k, f in enumerate(s.images)}, sources, read)
    files = writer.write(splits, out)
    lin = atomic_write_json(out / "lineage.json", data_lineage(artifacts, labels, splits, fmt=fmt, annotate=annotate,
                                                               dataset=folder, renamed=renamed))
    return DataExportResult(out, fmt, files, {**{k: len(v) for k, v in splits.items()}, **counts}, lin)
