"""Labels follow their images: a labeled image whose bytes change but not its pixels keeps its label.

A sample's ID is a digest of its image's bytes and question (pipeline/schema.py), so a PNG re-saved with another
compression level, or an image re-encoded losslessly and moved, becomes a new sample: its paid label stopped
counting and it re-entered the pool unlabeled. At each round's import step (`follow_images`):

- every labeled sample of the pool has its image facts recorded once (labeled_images.jsonl beside the ledger:
  image path, question, a digest of its decoded pixels);
- a label whose sample is no longer in the pool (an orphan) looks for its successor: a pool sample with the same
  question, the same decoded pixels (EXIF-transposed, as RGBA) and the same image path, or the same file name in
  another folder (a move). Exactly one → a "carry" ledger entry for the successor, naming the orphan, and a log line;
- an orphan that has no record yet is looked up once in the ingest shards still on disk (pipeline/data/shards.py:
  earlier ingests' rows stay there until deleted);
- the rest stay orphans: counted by `tamis status`, listed by `tamis labels orphans`, never dropped from the ledger.

- an orphan left then looks for the same picture under other pixels (a lossy re-encode, PNG → JPEG, a resize; in
  place, moved or renamed): a pool sample with the same question whose perceptual look (pipeline/annotation/
  perceptual.py: shape, pHash, thumbnail, with the thresholds stated there) matches the orphan's, the match unique
  and mutual (the orphan looks like that one image only, labeled ones included, and no other orphan looks like it).
  The pool's hashes are cached by sample ID (image_hashes.jsonl beside the ledger: an ID names its bytes).

What is not recognised: a picture changed beyond those thresholds (a crop, an edit, a tiny image re-encoded with
loss) or ambiguous; those are listed as orphans with their old path, so a person can relabel or map them.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path, PurePath
from typing import Any

from pipeline.annotation.ledger import Ledger, ledger_path, make_entry
from pipeline.annotation.perceptual import (
    Look,
    decoded,
    hash_bits,
    look_of,
    mutual_matches,
    near,
    same_picture,
    thumb_diff,
)
from pipeline.idindex import IdIndex
from pipeline.store import append_jsonl, arrow_column, digest_json, read_jsonl

log = logging.getLogger(__name__)

RECORD_NAME = "labeled_images.jsonl"  # beside the ledger: what each labeled sample's image was
HASHES_NAME = "image_hashes.jsonl"  # beside the ledger: the pool's perceptual hashes, by sample ID
FACT_COLUMNS = ("sample_id", "image", "image_path", "question")


@dataclass(frozen=True)
class ImageFacts:
    """What a labeled sample's image was: enough to recognise it under another sample ID."""

    sample_id: str
    path: str
    question: str
    pixels: str | None  # None: recorded as not found (the orphan's row is nowhere on disk any more)
    look: str | None = None  # perceptual.Look, encoded; None: recorded before looks were (or not decodable)


def pixel_digest(image: bytes) -> str | None:
    """sha256 of the decoded pixels (EXIF-transposed, RGBA, with the size): equal for a lossless re-save."""
    rgba = decoded(image, "RGBA")
    if rgba is None:
        return None
    return hashlib.sha256(f"{rgba.width}x{rgba.height}\0".encode() + rgba.tobytes()).hexdigest()


def record_path(artifacts: str | os.PathLike[str]) -> Path:
    return Path(artifacts) / RECORD_NAME


def recorded(artifacts: str | os.PathLike[str]) -> dict[str, ImageFacts]:
    return {r["sample_id"]: ImageFacts(**r) for r in read_jsonl(record_path(artifacts))}


class _Rows:
    """The prepared dataset (or an ingest shard) as the matching reads it, each part read once and only when first
    asked: the ID index, and the columns a successor is looked up by."""

    def __init__(self, ds: Any):
        self.ds = ds

    @cached_property
    def index(self) -> IdIndex:
        return IdIndex.of_dataset(self.ds)

    @cached_property
    def columns(self) -> dict[str, list[Any]]:
        """sample_id, image_path and question of every row ("" where the dataset has no such column)."""
        names, sids = self.ds.column_names, arrow_column(self.ds, "sample_id").to_pylist()
        return {"sample_id": sids, **{c: arrow_column(self.ds, c).to_pylist() if c in names else [""] * len(sids)
                                      for c in ("image_path", "question")}}

    def facts(self, ids: list[str]) -> list[ImageFacts]:
        """The facts of `ids` (the rows it has)."""
        at = [int(i) for i in self.index.rows(ids) if i >= 0]
        if not at:
            return []
        rows = self.ds.select(sorted(at)).select_columns([c for c in FACT_COLUMNS if c in self.ds.column_names])
        return [ImageFacts(r["sample_id"], r.get("image_path") or "", r.get("question") or "",
                           pixel_digest(r["image"]), None if (look := look_of(r["image"])) is None else look.encode())
                for r in rows]

    def images(self, ids: list[str]) -> Iterable[tuple[str, Any]]:
        """(sample_id, image bytes) of the rows of `ids` it has."""
        at = sorted(int(i) for i in self.index.rows(ids) if i >= 0)
        return ((r["sample_id"], r["image"]) for r in (self.ds.select(at).select_columns(["sample_id", "image"])
                                                        if at else []))


class _Known:
    """What the matching reads from beside the ledger, and what it learns to record there: the image facts of
    labeled samples (RECORD_NAME) and the pool's perceptual hashes (HASHES_NAME, read only when a look is matched),
    each written once at the end."""

    def __init__(self, artifacts: Path):
        self.artifacts, self.facts = artifacts, recorded(artifacts)
        self.new_facts: list[ImageFacts] = []
        self.new_hashes: list[dict[str, Any]] = []

    @cached_property
    def hashes(self) -> dict[str, tuple[int, int, int] | None]:
        return {r["sample_id"]: None if r["phash"] is None else (int(r["phash"], 16), r["width"], r["height"])
                for r in read_jsonl(self.artifacts / HASHES_NAME)}

    def record(self, facts: Iterable[ImageFacts]) -> None:
        new = [f for f in facts if self.facts.get(f.sample_id) != f]  # a newer record (with its look) supersedes
        self.new_facts += new
        self.facts.update((f.sample_id, f) for f in new)

    def pool_hashes(self, rows: _Rows, ids: list[str]) -> dict[str, tuple[int, int, int] | None]:
        """sample_id → (pHash, width, height) of `ids` (None: no decodable image), the missing ones computed (a
        sample ID names its image's bytes: a cached entry never goes stale)."""
        for sid, image in rows.images([s for s in ids if s not in self.hashes]):
            look = look_of(image)
            self.new_hashes.append({"sample_id": sid, "phash": None if look is None else f"{look.phash:016x}",
                                    "width": look and look.width, "height": look and look.height})
            self.hashes[sid] = None if look is None else (look.phash, look.width, look.height)
        return {s: self.hashes.get(s) for s in ids}

    def write(self) -> None:
        if self.new_facts:
            append_jsonl(record_path(self.artifacts), [asdict(f) for f in self.new_facts])
        if self.new_hashes:
            append_jsonl(self.artifacts / HASHES_NAME, self.new_hashes)


def _from_shards(artifacts: Path, ids: list[str]) -> list[ImageFacts]:
    """Facts of `ids` from the ingest shards still on disk (their rows outlive a changed source)."""
    import datasets

    from pipeline.data.shards import shards_root

    found: dict[str, ImageFacts] = {}
    for folder in sorted(shards_root(artifacts).glob("*/dataset")):
        wanted = [s for s in ids if s not in found]
        if not wanted:
            break
        try:
            ds = datasets.load_from_disk(str(folder))
        except (FileNotFoundError, ValueError):
            continue
        found.update((f.sample_id, f) for f in _Rows(ds).facts(wanted))
    return [found.get(s) or ImageFacts(s, "", "", None) for s in ids]


@dataclass(frozen=True)
class Carry:
    orphan: str
    successor: str
    why: str


def successors(orphans: Iterable[ImageFacts], rows: _Rows, taken: set[str]) -> list[Carry]:
    """Each orphan's successor among `rows` (pure but for decoding candidates): same question and pixels, at the
    same path, else under the same file name elsewhere; a sample already labeled (`taken`) never is one."""
    orphans = [f for f in orphans if f.pixels is not None]
    if not orphans:
        return []
    by_path: dict[str, list[str]] = {}
    by_name: dict[str, list[str]] = {}
    wanted = {f.path for f in orphans} | {PurePath(f.path).stem for f in orphans}
    for sid, path in zip(rows.columns["sample_id"], rows.columns["image_path"], strict=True):
        if path and sid not in taken:
            if path in wanted:
                by_path.setdefault(path, []).append(sid)
            if (stem := PurePath(path).stem) in wanted:
                by_name.setdefault(stem, []).append(sid)
    candidates = {s for f in orphans for s in by_path.get(f.path, []) + by_name.get(PurePath(f.path).stem, [])}
    facts = {f.sample_id: f for f in rows.facts(sorted(candidates))}
    out = []
    for f in orphans:
        for where, pool in (("at the same path", by_path.get(f.path, [])),
                            ("moved", by_name.get(PurePath(f.path).stem, []))):
            same = [s for s in pool if facts[s].pixels == f.pixels and facts[s].question == f.question]
            if len(same) == 1 and same[0] != f.sample_id:
                new = facts[same[0]]
                why = (f"same pixels {where}" + (f" ({f.path} → {new.path})" if where == "moved" else f" ({f.path})"))
                out.append(Carry(f.sample_id, same[0], why))
                taken.add(same[0])
                break
    return out


def look_alikes(orphans: Iterable[ImageFacts], rows: _Rows, taken: set[str], known: _Known) -> list[Carry]:
    """Each orphan's successor by its look (pipeline/annotation/perceptual.py), for orphans the same pixels did not
    find: a pool sample with the same question showing the same picture, the match unique and mutual; a sample already
    labeled (`taken`) never is one, and still makes a match ambiguous."""
    orphans = [f for f in orphans if f.look]
    if not orphans:
        return []
    asked = {f.question for f in orphans}
    pool = [(s, q or "") for s, q in zip(rows.columns["sample_id"], rows.columns["question"], strict=True)
            if (q or "") in asked]
    hashes = known.pool_hashes(rows, [s for s, _ in pool])
    pool = [(s, q) for s, q in pool if hashes[s] is not None]
    looks = {f.sample_id: Look.decode(f.look) for f in orphans}
    close = {f.sample_id: near(looks[f.sample_id], [hashes[s] for s, q in pool if q == f.question],
                               [s for s, q in pool if q == f.question]) for f in orphans}
    cands = {f.sample_id: f for f in rows.facts(sorted({s for c in close.values() for s in c})) if f.look}
    found = {s: Look.decode(f.look) for s, f in cands.items()}
    matches = {o: {s for s in c if s in found and same_picture(looks[o], found[s])} for o, c in close.items()}
    out, paths = [], {f.sample_id: f.path for f in orphans}
    for o, s in sorted(mutual_matches(matches, taken).items()):
        out.append(Carry(o, s, f"same picture re-encoded ({paths[o]} → {cands[s].path}; pHash "
                               f"{hash_bits(looks[o].phash, found[s].phash)}/64 bits apart, thumbnail within "
                               f"{thumb_diff(looks[o], found[s])}/255)"))
        taken.add(s)
    return out


def _add_looks(artifacts: Path, known: _Known, orphans: list[str]) -> None:
    """Orphans recorded before looks were recorded: their look from the ingest shards, looked for once."""
    old = [s for s in orphans if s in known.facts and known.facts[s].look is None and known.facts[s].pixels is not None]
    if not old:
        return
    found = {f.sample_id: f for f in _from_shards(artifacts, old) if f.look}
    rows = [found.get(s) or replace(known.facts[s], look="") for s in old]  # "": looked for, not found
    known.new_facts += rows  # written even where unchanged: the "" marks the look as looked for
    known.facts.update((f.sample_id, f) for f in rows)


def carry_entry(c: Carry, label_entry: Mapping[str, Any], *, round_index: int) -> dict[str, Any]:
    """The ledger entry that gives the successor the orphan's label (kind "carry", naming both)."""
    e = make_entry(c.successor, label_entry["label"], annotator=label_entry["annotator"], round_index=round_index,
                   source_file=label_entry["source_file"], source_digest=f"carry:{label_entry['entry_id']}")
    del e["entry_id"]
    e.update(kind="carry", carried_from=c.orphan, carried_entry=label_entry["entry_id"], reason=c.why)
    e["entry_id"] = digest_json(e)[:16]
    return e


def orphans_of(current: Mapping[str, Mapping[str, Any]], known: Iterable[bool], ids: list[str]) -> list[str]:
    """Labeled samples not in the dataset whose label no carry entry passed on."""
    carried = {e.get("carried_from") for e in current.values() if e.get("kind") == "carry"}
    return [s for s, k in zip(ids, known, strict=True) if not k and s not in carried]


def _carries(artifacts: Path, known: _Known, rows: _Rows, orphans: list[str], taken: set[str]) -> list[Carry]:
    """The orphans' successors: by the same pixels first, then (a lossy re-encode, maybe renamed) by their look."""
    carries = successors([known.facts[s] for s in orphans], rows, taken)
    done = {c.orphan for c in carries}
    if len(done) < len(orphans):
        _add_looks(artifacts, known, [s for s in orphans if s not in done])
        carries += look_alikes([known.facts[s] for s in orphans if s not in done], rows, taken, known)
    for c in carries:
        log.info("label of %s carried over to %s: %s", c.orphan, c.successor, c.why)
    if left := len(orphans) - len(carries):
        log.warning("%d labels match no sample of the dataset any more (their images changed or were removed); "
                    "`tamis labels orphans` lists them", left)
    return carries


def follow_images(artifacts: str | os.PathLike[str], prepared: Any, index: Any, *, round_index: int) -> dict[str, str]:
    """Carry labels over to the samples their images became (module docstring), then the ledger's labels.

    `prepared`: the prepared dataset, loaded (its rows are read only when a record or an orphan asks);
    `index`: the pool's SampleIndex (pipeline.annotation.matching). Reads first, writes once at the end."""
    artifacts = Path(artifacts)
    ledger, known, rows = Ledger(ledger_path(artifacts)), _Known(artifacts), _Rows(prepared)
    current = ledger.current()
    ids = list(current)
    known_rows = index.knows(ids)
    # Records written before looks were get theirs while the sample is still in the pool (once: undecodable
    # images have neither pixels nor a look).
    missing = [s for s, k in zip(ids, known_rows, strict=True) if k and (
        s not in known.facts or (known.facts[s].look is None and known.facts[s].pixels is not None))]
    if missing:
        known.record(rows.facts(missing))
    orphans = orphans_of(current, known_rows, ids)
    if unrecorded := [s for s in orphans if s not in known.facts]:
        known.record(_from_shards(artifacts, unrecorded))
    taken = {s for s, k in zip(ids, known_rows, strict=True) if k}
    carries = _carries(artifacts, known, rows, orphans, taken) if orphans else []
    known.write()
    if carries:
        ledger.append([carry_entry(c, current[c.orphan], round_index=round_index) for c in carries])
    return ledger.labels()


def orphan_labels(artifacts: str | os.PathLike[str]) -> list[dict[str, Any]] | None:
    """The labels matching no sample of the project's last prepared (or ingested) dataset, with what their image
    was; None before any dataset exists."""
    import datasets

    from pipeline.annotation.labels import latest_dataset
    from pipeline.annotation.matching import SampleIndex

    folder = latest_dataset(Path(artifacts))
    if folder is None:
        return None
    current = Ledger(ledger_path(artifacts)).current()
    ids = list(current)
    index = SampleIndex.from_dataset(datasets.load_from_disk(str(folder)).select_columns(["sample_id"]))
    facts = recorded(artifacts)
    return [{"sample_id": s, "label": current[s]["label"], "annotator": current[s]["annotator"],
             "round": current[s]["round"], "source_file": current[s]["source_file"],
             "image_path": facts[s].path if s in facts else None}
            for s in orphans_of(current, index.knows(ids), ids)]
