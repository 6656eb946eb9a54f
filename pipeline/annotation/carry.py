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


def _facts(ds: Any, ids: list[str]) -> list[ImageFacts]:
    """The facts of `ids` in dataset `ds` (the rows it has)."""
    from pipeline.idindex import IdIndex

    at = [int(i) for i in IdIndex.of_dataset(ds).rows(ids) if i >= 0]
    if not at:
        return []
    rows = ds.select(sorted(at)).select_columns([c for c in FACT_COLUMNS if c in ds.column_names])
    return [ImageFacts(r["sample_id"], r.get("image_path") or "", r.get("question") or "", pixel_digest(r["image"]),
                       None if (look := look_of(r["image"])) is None else look.encode())
            for r in rows]


def _record(artifacts: Path, facts: Iterable[ImageFacts], known: dict[str, ImageFacts]) -> None:
    new = [f for f in facts if known.get(f.sample_id) != f]  # a newer record (with its look) supersedes an older
    if new:
        append_jsonl(record_path(artifacts), [asdict(f) for f in new])
        known.update((f.sample_id, f) for f in new)


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
        found.update((f.sample_id, f) for f in _facts(ds, wanted))
    return [found.get(s) or ImageFacts(s, "", "", None) for s in ids]


@dataclass(frozen=True)
class Carry:
    orphan: str
    successor: str
    why: str


def successors(orphans: Iterable[ImageFacts], ds: Any, taken: set[str]) -> list[Carry]:
    """Each orphan's successor in dataset `ds` (pure but for decoding candidates): same question and pixels, at the
    same path, else under the same file name elsewhere; a sample already labeled (`taken`) never is one."""
    orphans = [f for f in orphans if f.pixels is not None]
    if not orphans:
        return []
    paths = arrow_column(ds, "image_path").to_pylist()
    sids = arrow_column(ds, "sample_id").to_pylist()
    by_path: dict[str, list[str]] = {}
    by_name: dict[str, list[str]] = {}
    wanted = {f.path for f in orphans} | {PurePath(f.path).stem for f in orphans}
    for sid, path in zip(sids, paths, strict=True):
        if path and sid not in taken:
            if path in wanted:
                by_path.setdefault(path, []).append(sid)
            if (stem := PurePath(path).stem) in wanted:
                by_name.setdefault(stem, []).append(sid)
    candidates = {s for f in orphans for s in by_path.get(f.path, []) + by_name.get(PurePath(f.path).stem, [])}
    facts = {f.sample_id: f for f in _facts(ds, sorted(candidates))}
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


def _pool_hashes(artifacts: Path, ds: Any, ids: list[str]) -> dict[str, tuple[int, int, int] | None]:
    """sample_id → (pHash, width, height) of `ids` in `ds` (None: no decodable image), from the cache beside the
    ledger, the missing ones computed and cached (a sample ID names its image's bytes: an entry never goes stale)."""
    from pipeline.idindex import IdIndex

    path = Path(artifacts) / HASHES_NAME
    cached = {r["sample_id"]: (None if r["phash"] is None else (int(r["phash"], 16), r["width"], r["height"]))
              for r in read_jsonl(path)}
    missing = [s for s in ids if s not in cached]
    at = sorted(int(i) for i in IdIndex.of_dataset(ds).rows(missing) if i >= 0)
    new = []
    for r in ds.select(at).select_columns(["sample_id", "image"]) if at else []:
        look = look_of(r["image"])
        new.append({"sample_id": r["sample_id"], "phash": None if look is None else f"{look.phash:016x}",
                    "width": look and look.width, "height": look and look.height})
        cached[r["sample_id"]] = None if look is None else (look.phash, look.width, look.height)
    if new:
        append_jsonl(path, new)
    return {s: cached.get(s) for s in ids}


def look_alikes(orphans: Iterable[ImageFacts], ds: Any, taken: set[str], artifacts: Path) -> list[Carry]:
    """Each orphan's successor by its look (pipeline/annotation/perceptual.py), for orphans the same pixels did not
    find: a pool sample with the same question showing the same picture, the match unique and mutual; a sample already
    labeled (`taken`) never is one, and still makes a match ambiguous."""
    orphans = [f for f in orphans if f.look]
    if not orphans:
        return []
    sids = arrow_column(ds, "sample_id").to_pylist()
    questions = arrow_column(ds, "question").to_pylist() if "question" in ds.column_names else [""] * len(sids)
    asked = {f.question for f in orphans}
    pool = [(s, q or "") for s, q in zip(sids, questions, strict=True) if (q or "") in asked]
    hashes = _pool_hashes(artifacts, ds, [s for s, _ in pool])
    pool = [(s, q) for s, q in pool if hashes[s] is not None]
    looks = {f.sample_id: Look.decode(f.look) for f in orphans}
    close = {f.sample_id: near(looks[f.sample_id], [hashes[s] for s, q in pool if q == f.question],
                               [s for s, q in pool if q == f.question]) for f in orphans}
    cands = {f.sample_id: f for f in _facts(ds, sorted({s for c in close.values() for s in c})) if f.look}
    found = {s: Look.decode(f.look) for s, f in cands.items()}
    matches = {o: {s for s in c if s in found and same_picture(looks[o], found[s])} for o, c in close.items()}
    out, paths = [], {f.sample_id: f.path for f in orphans}
    for o, s in sorted(mutual_matches(matches, taken).items()):
        out.append(Carry(o, s, f"same picture re-encoded ({paths[o]} → {cands[s].path}; pHash "
                               f"{hash_bits(looks[o].phash, found[s].phash)}/64 bits apart, thumbnail within "
                               f"{thumb_diff(looks[o], found[s])}/255)"))
        taken.add(s)
    return out


def _add_looks(artifacts: Path, facts: dict[str, ImageFacts], orphans: list[str]) -> None:
    """Orphans recorded before looks were recorded: their look from the ingest shards, looked for once."""
    old = [s for s in orphans if s in facts and facts[s].look is None and facts[s].pixels is not None]
    if not old:
        return
    found = {f.sample_id: f for f in _from_shards(artifacts, old) if f.look}
    rows = [found.get(s) or replace(facts[s], look="") for s in old]  # "": looked for, not found
    append_jsonl(record_path(artifacts), [asdict(f) for f in rows])
    facts.update((f.sample_id, f) for f in rows)


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


def follow_images(artifacts: str | os.PathLike[str], prepared_dir: str | os.PathLike[str], index: Any, *,
                  round_index: int) -> dict[str, str]:
    """Carry labels over to the samples their images became (module docstring), then the ledger's labels.

    `index`: the pool's SampleIndex (pipeline.annotation.matching); `prepared_dir`: the prepare stage's folder."""
    from pipeline.preprocess import load_prepared

    artifacts = Path(artifacts)
    ledger = Ledger(ledger_path(artifacts))
    current = ledger.current()
    ids = list(current)
    known_rows = index.knows(ids)
    facts = recorded(artifacts)
    ds = None
    # Records written before looks were get theirs while the sample is still in the pool (once: undecodable
    # images have neither pixels nor a look).
    missing = [s for s, k in zip(ids, known_rows, strict=True)
               if k and (s not in facts or (facts[s].look is None and facts[s].pixels is not None))]
    if missing:
        ds = load_prepared(prepared_dir)
        _record(artifacts, _facts(ds, missing), facts)
    orphans = orphans_of(current, known_rows, ids)
    unrecorded = [s for s in orphans if s not in facts]
    if unrecorded:
        _record(artifacts, _from_shards(artifacts, unrecorded), facts)
    if orphans:
        ds = ds if ds is not None else load_prepared(prepared_dir)
        taken = {s for s, k in zip(ids, known_rows, strict=True) if k}
        carries = successors([facts[s] for s in orphans], ds, taken)
        done = {c.orphan for c in carries}
        if len(done) < len(orphans):  # the same picture under other pixels: a lossy re-encode, maybe renamed
            _add_looks(artifacts, facts, [s for s in orphans if s not in done])
            carries += look_alikes([facts[s] for s in orphans if s not in done], ds, taken, artifacts)
        if carries:
            ledger.append([carry_entry(c, current[c.orphan], round_index=round_index) for c in carries])
            for c in carries:
                log.info("label of %s carried over to %s: %s", c.orphan, c.successor, c.why)
        left = len(orphans) - len(carries)
        if left:
            log.warning("%d labels match no sample of the dataset any more (their images changed or were removed); "
                        "`tamis labels orphans` lists them", left)
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
