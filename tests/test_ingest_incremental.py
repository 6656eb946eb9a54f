"""Incremental ingest: the file index answers unchanged files with a stat, and new rows go to new shards."""

import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_digits

from pipeline.config import parse_config
from pipeline.data.file_index import INDEX_NAME, FileIndex, open_index
from pipeline.data.ingest import ingest, load_ingested, source_digest
from pipeline.schema import sample_id_for
from pipeline.store import digest_bytes, read_jsonl, read_manifest

_OPENED: list[list[str]] = []


def _audit(event: str, args: tuple) -> None:
    # An audit hook cannot be removed, so it only records while a test listens (see `opened`).
    if event == "open" and _OPENED and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED[-1].append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@contextlib.contextmanager
def opened(folder: Path):
    """The files under `folder` opened (for reading or writing) inside the block."""
    _OPENED.append([])
    seen: list[str] = []
    try:
        yield seen
    finally:
        seen.extend(p for p in _OPENED.pop() if Path(p).resolve().is_relative_to(folder.resolve()))


DIGITS = load_digits()
PAST = time.time() - 3600  # older than the racy window: the index trusts these files' stats


def digit_png(i: int) -> bytes:
    pixels = (DIGITS.images[i % len(DIGITS.images)] * 16).clip(0, 255).astype(np.uint8)
    pixels[0, 0] = i % 256  # distinct files even when the digit repeats
    pixels[0, 1] = i // 256 % 256
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def write_pool(root: Path, ids, *, when: float = PAST) -> None:
    for i in ids:
        p = root / str(DIGITS.target[i % len(DIGITS.target)]) / f"{i:05d}.png"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(digit_png(i))
        os.utime(p, (when, when))


def project(tmp_path, sources=None, **data):
    sources = sources or [{"kind": "folder", "path": str(tmp_path / "pool")}]
    return parse_config({"data": {"sources": sources, "answers": [str(d) for d in range(10)], **data},
                         "paths": {"artifacts": str(tmp_path / "art")}})


def index_reads(cfg) -> int:
    files = open_index(cfg.artifacts, cfg.data.verify)
    source_digest_with(cfg, files)
    return files.reads


def source_digest_with(cfg, files):
    from pipeline.data.ingest import _digest_parts, _walk

    return _digest_parts(_walk(cfg.data, files))


def pngs(paths) -> list[str]:
    return [p for p in paths if p.endswith(".png")]


def test_stat_mode_reads_no_image_of_an_unchanged_pool_and_keys_like_content_mode(tmp_path):
    pool = tmp_path / "pool"
    write_pool(pool, range(30))
    cfg = project(tmp_path, verify="stat")  # every file looked up each run (the listing check: test_ingest_listing)
    with opened(pool) as first:
        key = source_digest(cfg.data, cfg.artifacts)
    assert len(pngs(first)) == 30  # nothing indexed yet: every image is read once
    with opened(pool) as again:
        assert source_digest(cfg.data, cfg.artifacts) == key
    assert pngs(again) == []  # a stat per file, not a read

    content = project(tmp_path, verify="content")
    with opened(pool) as reread:
        assert source_digest(content.data, content.artifacts) == key
    assert len(pngs(reread)) == 30  # content mode re-reads every file
    assert source_digest(cfg.data) == key  # no index at all (today's full read): the same key

    ingest(cfg.data, cfg.artifacts, tmp_path / "out1", digest=key)
    with opened(pool) as body:
        m = ingest(cfg.data, cfg.artifacts, tmp_path / "out2")
    assert pngs(body) == [] and m.info["rows_read"] == 0 and m.info["shards_reused"] == 1
    assert m.inputs["sources"] == key


def test_touch_without_change_keeps_the_key_and_a_change_moves_it(tmp_path):
    pool = tmp_path / "pool"
    write_pool(pool, range(20))
    cfg = project(tmp_path, verify="stat")  # a rewrite in place: the listing check sees it only at its sweep
    key = source_digest(cfg.data, cfg.artifacts)
    target = next(pool.rglob("00007.png"))
    os.utime(target, (PAST + 60, PAST + 60))  # touched: stat changed, bytes did not
    with opened(pool) as seen:
        assert source_digest(cfg.data, cfg.artifacts) == key
    assert pngs(seen) == [str(target)]  # only the touched file is read again
    assert index_reads(cfg) == 0  # and the index now trusts it again

    target.write_bytes(digit_png(1000))  # same size class, other content
    os.utime(target, (PAST + 120, PAST + 120))
    with opened(pool) as seen:
        changed = source_digest(cfg.data, cfg.artifacts)
    assert changed != key and pngs(seen) == [str(target)]


def test_a_recently_written_file_is_read_again_until_its_mtime_is_safely_past(tmp_path):
    pool = tmp_path / "pool"
    write_pool(pool, range(3), when=time.time())  # within the mtime granularity of "now": racy
    cfg = project(tmp_path)
    source_digest(cfg.data, cfg.artifacts)
    assert index_reads(cfg) == 3


def test_added_files_go_to_one_new_shard_and_old_shards_are_reused(tmp_path):
    pool = tmp_path / "pool"
    write_pool(pool, range(40))
    cfg = project(tmp_path)
    first = ingest(cfg.data, cfg.artifacts, tmp_path / "out1")
    assert first.info["shards"] == 1 and first.info["rows_read"] == 40
    old = json.loads((tmp_path / "out1" / "shards.json").read_text())

    write_pool(pool, range(40, 55))
    (pool / "3" / "dup.png").write_bytes(digit_png(5))  # an exact copy of a row already ingested
    with opened(pool) as seen:
        m = ingest(cfg.data, cfg.artifacts, tmp_path / "out2")
    # Only the new files were read: once to digest them for the index, once (from the page cache) to decode them.
    assert sorted(set(pngs(seen))) == sorted(str(p) for p in pool.rglob("*.png") if p.name >= "00040" or
                                             p.name == "dup.png")
    assert len(pngs(seen)) == 2 * 16
    shards = json.loads((tmp_path / "out2" / "shards.json").read_text())
    assert shards[0] == old[0] and len(shards) == 2 and shards[1]["rows"] == 15
    assert m.info["counts"] == {"read": 56, "ingested": 55, "quarantined": 0, "duplicates": 1}
    ds = load_ingested(tmp_path / "out2")
    question = cfg.data.question
    assert ds["sample_id"] == [sample_id_for(digit_png(i), question) for i in sorted(
        range(55), key=lambda i: (i >= 40, str(DIGITS.target[i % 1797]), i))]  # old shard first, then the new
    [dup] = read_jsonl(tmp_path / "out2" / "duplicates.jsonl")
    assert dup["sample_id"] == sample_id_for(digit_png(5), question) and dup["kept"].endswith("00005.png")

    # The same pool ingested from scratch keeps the same samples and the same accounting.
    fresh = project(tmp_path / "fresh", sources=cfg.model_dump(mode="json")["data"]["sources"])
    scratch = ingest(fresh.data, fresh.artifacts, tmp_path / "fresh-out")
    assert scratch.info["counts"] == m.info["counts"]
    assert sorted(load_ingested(tmp_path / "fresh-out")["sample_id"]) == sorted(ds["sample_id"])


def test_a_deleted_file_leaves_the_pool_and_its_shard_is_rebuilt_from_the_rest(tmp_path):
    pool = tmp_path / "pool"
    write_pool(pool, range(12))
    cfg = project(tmp_path)
    ingest(cfg.data, cfg.artifacts, tmp_path / "out1")
    gone = next(pool.rglob("00004.png"))
    gone_id = sample_id_for(gone.read_bytes(), cfg.data.question)
    gone.unlink()
    m = ingest(cfg.data, cfg.artifacts, tmp_path / "out2")
    assert m.info["shards_reused"] == 0 and m.info["rows_read"] == 11
    assert m.info["counts"]["ingested"] == 11
    ds = load_ingested(tmp_path / "out2")
    assert gone_id not in ds["sample_id"]
    # A label the ledger holds for the deleted sample stays there, but no round trains on it any more.
    from pipeline.round.plan import PoolData, round_labels

    kept_id = ds["sample_id"][0]
    labels = round_labels(PoolData.of(ds), {gone_id: "4", kept_id: "9"})
    assert gone_id not in labels and labels[kept_id] == "9"
    # Its index entry is dropped with it.
    index = FileIndex(cfg.artifacts / "ingest" / INDEX_NAME)
    assert index.entry(gone.resolve()) is None and len(index) == 11
    assert index.entry(next(pool.rglob("00005.png")).resolve()) is not None


def test_manifest_sources_are_always_read_and_their_images_are_indexed(tmp_path):
    pool = tmp_path / "pool"
    write_pool(pool, range(6))
    manifest = tmp_path / "pool" / "m.jsonl"
    rows = [{"image": str(p.relative_to(pool)), "answer": p.parent.name} for p in sorted(pool.rglob("*.png"))]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = project(tmp_path, sources=[{"kind": "jsonl", "path": str(manifest)}])
    key = source_digest(cfg.data, cfg.artifacts)
    ingest(cfg.data, cfg.artifacts, tmp_path / "out1", digest=key)
    with opened(pool) as seen:
        assert source_digest(cfg.data, cfg.artifacts) == key
    assert pngs(seen) == [] and str(manifest) in seen
    manifest.write_text("".join(json.dumps({**r, "answer": "1"}) + "\n" for r in rows[:3]))  # relabels, drops 3
    m = ingest(cfg.data, cfg.artifacts, tmp_path / "out2")
    assert m.info["counts"]["ingested"] == 3 and set(load_ingested(tmp_path / "out2")["answer"]) == {"1"}


def test_a_corrupt_image_is_quarantined_once_and_its_verdict_reused(tmp_path):
    pool = tmp_path / "pool"
    write_pool(pool, range(5))
    bad = pool / "0" / "bad.png"
    bad.write_bytes(b"\x89PNG not really")
    os.utime(bad, (PAST, PAST))
    cfg = project(tmp_path)
    first = ingest(cfg.data, cfg.artifacts, tmp_path / "out1")
    with opened(pool) as seen:
        again = ingest(cfg.data, cfg.artifacts, tmp_path / "out2")
    assert pngs(seen) == [] and again.info["counts"] == first.info["counts"]
    assert again.info["counts"]["quarantined"] == 1
    assert read_jsonl(tmp_path / "out2" / "quarantine.jsonl") == read_jsonl(tmp_path / "out1" / "quarantine.jsonl")


def test_a_damaged_index_costs_a_read_not_a_wrong_key(tmp_path):
    pool = tmp_path / "pool"
    write_pool(pool, range(4))
    cfg = project(tmp_path)
    key = source_digest(cfg.data, cfg.artifacts)
    (cfg.artifacts / "ingest" / INDEX_NAME).write_bytes(b"PK\x03\x04 not a zip")
    assert source_digest(cfg.data, cfg.artifacts) == key
    assert index_reads(cfg) == 0


@pytest.mark.parametrize("verify", ["stat", "content"])
def test_index_digest_is_the_sha256_of_the_file(tmp_path, verify):
    p = tmp_path / "x.bin"
    p.write_bytes(b"abc" * 1000)
    assert FileIndex(None, verify).digest(str(p)) == digest_bytes(p.read_bytes())


def test_adding_files_prepares_and_assesses_only_the_new_shard_as_a_whole_run_would(tmp_path):
    from pipeline import preprocess as prep
    from pipeline.data.ingest import ingest_params, ingest_stage
    pool = tmp_path / "pool"
    write_pool(pool, range(30))
    cfg = parse_config({"data": {"sources": [{"kind": "folder", "path": str(pool)}],
                                 "answers": [str(d) for d in range(10)]},
                        "preprocess": {"size": 16, "pad": "square"}, "paths": {"artifacts": str(tmp_path / "art")}})

    def prepare():
        key = source_digest(cfg.data, cfg.artifacts)
        ref = ingest_stage(ingest_params(cfg.data, cfg.artifacts, key))
        params = prep.preprocess_params(cfg.artifacts, ref, cfg.preprocess, cfg.model, cfg.data.max_image_pixels)
        return ref, prep.preprocess_stage(params)

    def shard_runs(ref):
        return [s["dir"] for s in json.loads((Path(ref["dir"]) / "shards.json").read_text()) if s["prepared"]]

    _, first = prepare()
    assert len(shard_runs(first)) == 1 and first["info"]["rows"] == 30
    write_pool(pool, range(30, 42))
    ref, second = prepare()
    assert shard_runs(second) not in ([], shard_runs(first))  # the old shard was re-used, only the new one prepared
    assert second["info"]["shards"] == 2 and second["info"]["shards_prepared"] == 1
    stamp = (Path(second["dir"]) / "manifest.json").stat().st_mtime_ns
    assert prepare()[1] == second  # nothing new: the verified stage folder is re-used, nothing written
    assert (Path(second["dir"]) / "manifest.json").stat().st_mtime_ns == stamp

    # The same rows, in the same order, as preparing the whole ingested dataset at once.
    whole = prep.preprocess_dataset(load_ingested(ref["dir"]), cfg.preprocess, tmp_path / "whole", size=16,
                                    max_pixels=cfg.data.max_image_pixels)
    a, b = prep.load_prepared(second["dir"]), prep.load_prepared(tmp_path / "whole")
    assert whole.info["rows"] == 42 and a["sample_id"] == b["sample_id"] and a["prepared"] == b["prepared"]

    # Quality: features only for the new shard, flags over all rows (duplicates of old rows found), as a whole run.
    from pipeline import quality as qual

    quality = cfg.quality.model_copy(update={"exclude": ["exact_duplicate", "near_duplicate"]})

    def assess(prepared):
        return qual.quality_stage(qual.quality_params(cfg.artifacts, prepared, quality))

    assess(first)
    q = assess(second)
    qual.assess_quality(b, quality, tmp_path / "whole-quality")
    assert q["info"]["shards"] == 2 and q["info"]["shards_computed"] == 1
    assert q["info"]["shards_judged"] == 1  # the old shard's flags are kept: only the new rows are judged
    assert qual.excluded_ids(q["dir"]) == qual.excluded_ids(tmp_path / "whole-quality") != set()
    assert qual.load_quality(q["dir"]) == qual.load_quality(tmp_path / "whole-quality")
    assert any("near_duplicate" in r["flags"] for r in qual.load_quality(q["dir"])[30:])  # new rows vs old ones


def test_a_saved_dataset_source_adds_rows_incrementally(tmp_path):
    import datasets

    def save(n):
        datasets.Dataset.from_dict({"image": [digit_png(i) for i in range(n)],
                                    "answer": [str(DIGITS.target[i]) for i in range(n)]}).save_to_disk(
            str(tmp_path / "hf"))

    save(8)
    cfg = project(tmp_path, sources=[{"kind": "hf", "path": str(tmp_path / "hf")}])
    first = ingest(cfg.data, cfg.artifacts, tmp_path / "out1")
    save(11)  # rewritten with three more rows: the first eight keep their descriptions
    m = ingest(cfg.data, cfg.artifacts, tmp_path / "out2")
    assert first.info["rows_read"] == 8 and m.info["rows_read"] == 3 and m.info["shards_reused"] == 1
    ds = load_ingested(tmp_path / "out2")
    assert ds["image"] == [digit_png(i) for i in range(11)]


def test_added_images_embed_only_their_shard_in_the_kept_fit_until_the_pool_doubles(tmp_path):
    from pipeline import embeddings as emb
    from pipeline import preprocess as prep
    from pipeline.data.ingest import ingest_params, ingest_stage

    pool = tmp_path / "pool"
    write_pool(pool, range(30))
    cfg = parse_config({"data": {"sources": [{"kind": "folder", "path": str(pool), "default_split": "pool"}],
                                 "answers": [str(d) for d in range(10)]},
                        "preprocess": {"size": 16, "pad": "square"}, "paths": {"artifacts": str(tmp_path / "art")},
                        "select": {"embeddings": {"source": "pixels", "pca_dim": 8}}})

    def embed():
        key = source_digest(cfg.data, cfg.artifacts)
        ref = ingest_stage(ingest_params(cfg.data, cfg.artifacts, key))
        prepared = prep.preprocess_stage(prep.preprocess_params(cfg.artifacts, ref, cfg.preprocess, cfg.model,
                                                                  cfg.data.max_image_pixels))
        out = emb.embeddings_stage(emb.embeddings_params(cfg, prepared))
        ids, vectors = emb.load_selection_embeddings(out["dir"])
        return prepared, read_manifest(Path(out["dir"])).info, ids, np.asarray(vectors)

    first, info, ids1, v1 = embed()
    assert info["shards"] == info["shards_computed"] == 1 and info["fitted_now"] and info["fit_pool"] == 30
    # One shard: the vectors of the whole-dataset stage, bit for bit.
    emb.compute_selection_embeddings(emb.embeddings_spec(cfg), prep.load_prepared(first["dir"]), tmp_path / "whole", inputs={})
    w_ids, w_vec = emb.load_selection_embeddings(tmp_path / "whole")
    assert w_ids == ids1 and np.array_equal(np.asarray(w_vec), v1)

    write_pool(pool, range(30, 42))  # 42 ≤ 2 × 30: the fit is kept, only the new shard is embedded
    _, info, ids2, v2 = embed()
    assert info["shards"] == 2 and info["shards_computed"] == 1 and not info["fitted_now"]
    assert ids2[:30] == ids1 and np.array_equal(v2[:30], v1) and len(ids2) == 42 and np.isfinite(v2).all()

    write_pool(pool, range(42, 70))  # 70 > 2 × 30: the pool's space is fitted again, every shard embedded in it
    _, info, ids3, v3 = embed()
    assert info["fitted_now"] and info["fit_pool"] == 70 and info["shards_computed"] == info["shards"] == 3
    assert ids3[:42] == ids2 and not np.allclose(v3[:30], v1)


def test_an_index_of_the_earlier_json_format_is_converted_without_reading_any_image(tmp_path):
    pool = tmp_path / "pool"
    write_pool(pool, range(6))
    cfg = project(tmp_path)
    key = source_digest(cfg.data, cfg.artifacts)
    new = cfg.artifacts / "ingest" / INDEX_NAME
    index = FileIndex(new)
    entries = {}
    for p in pool.rglob("*.png"):
        sig, digest, racy = index.entry(p.resolve())
        entries[str(p.resolve())] = [*sig, digest, int(racy)]
    assert len(entries) == 6
    # What tamis wrote before the columnar index: {path: [size, mtime_ns, inode, sha256, racy]} as JSON.
    legacy = new.with_name("file_index.json")
    legacy.write_text(json.dumps({"format": 1, "entries": entries}))
    new.unlink()
    with opened(pool) as seen:
        assert source_digest(cfg.data, cfg.artifacts) == key
    assert pngs(seen) == [] and new.is_file() and not legacy.exists()


def test_shards_judged_by_other_ingest_code_are_not_reused(tmp_path, monkeypatch):
    import pipeline.data.shards as shards
    from pipeline.codeversion import stage_version

    assert shards.SHARD_VERSION == stage_version("2", "pipeline.data.ingest")  # derived from ingest's code
    pool = tmp_path / "pool"
    write_pool(pool, range(12))
    cfg = project(tmp_path)
    ingest(cfg.data, cfg.artifacts, tmp_path / "out1")
    assert ingest(cfg.data, cfg.artifacts, tmp_path / "out2").info["shards_reused"] == 1
    # What an upgrade that edits validation or de-duplication does to the key: every row is judged again.
    monkeypatch.setattr(shards, "SHARD_VERSION", shards.SHARD_VERSION + "-edited")
    m = ingest(cfg.data, cfg.artifacts, tmp_path / "out3")
    assert m.info["shards_reused"] == 0 and m.info["rows_read"] == 12
