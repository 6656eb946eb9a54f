import io
import json

import numpy as np
import pytest
from PIL import Image

from pipeline.config import parse_config
from pipeline.data.ingest import ingest, load_ingested, source_digest
from pipeline.errors import ArtifactError, DataError
from pipeline.schema import INGEST_COLUMNS, sample_id_for
from pipeline.store import digest_dir, read_jsonl, read_manifest


def encode(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def png(color: int = 0, size: tuple[int, int] = (4, 3)) -> bytes:
    return encode(Image.new("L", size, color))


def write_manifest(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def config(tmp_path, sources, **data):
    return parse_config({"data": {"sources": sources, **data}, "paths": {"artifacts": str(tmp_path / "art")}})


def counts_of(m) -> dict:
    c = m.info["counts"]
    assert c["ingested"] + c["quarantined"] + c["duplicates"] == c["read"]
    return c


def test_bad_image_zoo(tmp_path):
    root = tmp_path / "src"
    (root / "imgs").mkdir(parents=True)
    noise = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    good = encode(Image.fromarray(noise))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90°, so a 40×20 stored image is shown 20×40
    palette = Image.new("P", (7, 7), 3)
    palette.putpalette([i % 256 for i in range(768)])
    files = {
        "zero.png": b"",
        "truncated.png": good[: len(good) // 2],
        "garbage.png": b"this is not an image at all" * 10,
        "wrong_ext.jpg": png(77, (5, 5)),
        "cmyk.jpg": encode(Image.new("CMYK", (6, 6), (10, 20, 30, 40)), "JPEG"),
        "16bit.png": encode(Image.new("I;16", (5, 4), 40000)),
        "palette.png": encode(palette),
        "rgba.png": encode(Image.new("RGBA", (3, 3), (1, 2, 3, 128))),
        "rotated.jpg": encode(Image.new("RGB", (40, 20), (200, 10, 10)), "JPEG", exif=exif.tobytes()),
        "bomb.png": encode(Image.new("L", (200, 200), 1)),
    }
    for name, data in files.items():
        (root / "imgs" / name).write_bytes(data)
    (root / "imgs" / "dir.png").mkdir()
    (root / "imgs" / "dangling.png").symlink_to(root / "imgs" / "gone.png")
    names = [*files, "missing.png", "dir.png", "dangling.png"]
    write_manifest(root / "m.jsonl", [{"image": f"imgs/{n}", "answer": n} for n in names])
    before = digest_dir(root)

    cfg = config(tmp_path, [{"kind": "jsonl", "path": str(root / "m.jsonl")}], max_image_pixels=10_000)
    m = ingest(cfg.data, cfg.artifacts, tmp_path / "out")

    quarantined = {q["source"]: q for q in read_jsonl(tmp_path / "out" / "quarantine.jsonl")}
    reason = {names[int(src.rsplit(":", 1)[1]) - 1]: q["reason"] for src, q in quarantined.items()}
    expected = {
        "zero.png": "empty file", "truncated.png": "truncated", "garbage.png": "not a decodable image",
        "bomb.png": "exceeds data.max_image_pixels = 10,000", "missing.png": "file not found",
        "dir.png": "is a directory", "dangling.png": "broken symlink",
    }
    assert set(reason) == set(expected)
    for name, words in expected.items():
        assert words in reason[name], (name, reason[name])
    assert all(q["path"] for q in quarantined.values())

    ds = load_ingested(tmp_path / "out")
    assert tuple(ds.column_names) == INGEST_COLUMNS
    rows = {r["answer"]: r for r in ds}
    assert set(rows) == set(names) - set(expected)
    assert {n: rows[n]["mode"] for n in rows} == {
        "wrong_ext.jpg": "L", "cmyk.jpg": "CMYK", "16bit.png": "I;16", "palette.png": "P", "rgba.png": "RGBA",
        "rotated.jpg": "RGB",
    }
    assert (rows["rotated.jpg"]["width"], rows["rotated.jpg"]["height"]) == (20, 40)
    assert rows["cmyk.jpg"]["image"] == files["cmyk.jpg"]  # original bytes kept, not re-encoded
    assert counts_of(m) == {"read": len(names), "ingested": len(rows), "quarantined": len(expected), "duplicates": 0}
    assert digest_dir(root) == before  # nothing in the user's sources is touched


def test_accounting_duplicates_and_splits_across_sources(tmp_path):
    folder = tmp_path / "folder"
    (folder / "3").mkdir(parents=True)
    (folder / "3" / "a.png").write_bytes(png(3))
    (folder / "3" / "b.png").write_bytes(png(33))
    (folder / "7").mkdir()
    (folder / "7" / "c.png").write_bytes(png(7))
    (folder / "x").mkdir()
    (folder / "x" / "d.png").write_bytes(png(99))  # "x" is not in data.answers
    man = tmp_path / "man"
    man.mkdir()
    (man / "a_copy.png").write_bytes(png(3))
    (man / "e.png").write_bytes(png(50))
    (man / "f.png").write_bytes(png(51))
    q = "Which digit?"
    write_manifest(man / "m.jsonl", [
        {"image": "a_copy.png", "question": q, "answer": "5"},      # dup of folder/3/a.png, conflicting answer
        {"image": "e.png", "question": q},                         # unlabeled → pool
        {"image": "e.png", "question": q},                         # exact dup within the same source
        {"image": "e.png", "question": "Another question?"},       # same image, other text: a different sample
        {"image": "f.png", "question": q, "split": "validation"},  # unknown split
        {"image": "f.png", "question": q, "split": "train"},       # train needs an answer
        {"image": "../escape.png", "question": q},
    ])
    (tmp_path / "man.csv").write_text(f"image,question,answer,split\nman/f.png,{q},7,test\n")
    sources = [
        {"kind": "folder", "path": str(folder), "question": q},
        {"kind": "jsonl", "path": str(man / "m.jsonl")},
        {"kind": "csv", "path": str(tmp_path / "man.csv")},
    ]
    cfg = config(tmp_path, sources, answers=[str(i) for i in range(10)])
    m = ingest(cfg.data, cfg.artifacts, tmp_path / "out")

    assert counts_of(m) == {"read": 4 + 7 + 1, "ingested": 6, "quarantined": 4, "duplicates": 2}
    ds = load_ingested(tmp_path / "out")
    by_id = {r["sample_id"]: r for r in ds}
    a = by_id[sample_id_for(png(3), q)]
    assert a["answer"] == "3" and a["split"] == "train"  # first occurrence wins
    assert a["sources"] == [str(folder / "3" / "a.png"), f"{man / 'm.jsonl'}:1"]
    e = by_id[sample_id_for(png(50), q)]
    assert e["split"] == "pool" and e["answer"] is None and len(e["sources"]) == 2
    assert by_id[sample_id_for(png(50), "Another question?")]["split"] == "pool"
    f = by_id[sample_id_for(png(51), q)]
    assert (f["answer"], f["split"], f["source"]) == ("7", "test", f"{tmp_path / 'man.csv'}:2")
    assert m.info["splits"] == {"train": 3, "pool": 2, "test": 1}

    dups = read_jsonl(tmp_path / "out" / "duplicates.jsonl")
    conflict = next(d for d in dups if d["sample_id"] == a["sample_id"])
    assert conflict["duplicate"] == f"{man / 'm.jsonl'}:1" and "answer '3' kept, '5' dropped" in conflict["conflict"]
    reasons = " | ".join(r["reason"] for r in read_jsonl(tmp_path / "out" / "quarantine.jsonl"))
    for words in ("answer 'x' is not in data.answers", "split 'validation' is not one of",
                  "split 'train' needs an answer", "escapes the dataset root"):
        assert words in reasons


def test_default_split_of_a_source_applies_to_rows_without_one(tmp_path):
    (tmp_path / "a.png").write_bytes(png(1))
    (tmp_path / "b.png").write_bytes(png(2))
    write_manifest(tmp_path / "m.jsonl", [{"image": "a.png", "answer": "1"}, {"image": "b.png", "answer": "2",
                                                                             "split": "train"}])
    cfg = config(tmp_path, [{"kind": "jsonl", "path": str(tmp_path / "m.jsonl"), "default_split": "test"}])
    ingest(cfg.data, cfg.artifacts, tmp_path / "out")
    assert sorted(load_ingested(tmp_path / "out")["split"]) == ["test", "train"]


def test_load_ingested_refuses_a_corrupted_dataset(tmp_path):
    (tmp_path / "a.png").write_bytes(png(1))
    write_manifest(tmp_path / "m.jsonl", [{"image": "a.png"}])
    cfg = config(tmp_path, [{"kind": "jsonl", "path": str(tmp_path / "m.jsonl")}])
    ingest(cfg.data, cfg.artifacts, tmp_path / "out")
    assert read_manifest(tmp_path / "out").config["sources"][0]["kind"] == "jsonl"
    arrow = next((tmp_path / "out" / "dataset").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:-10])
    with pytest.raises(ArtifactError, match="corrupt"):
        load_ingested(tmp_path / "out")


def test_everything_quarantined_still_writes_an_empty_dataset(tmp_path):
    write_manifest(tmp_path / "m.jsonl", [{"image": "nope.png"}])
    cfg = config(tmp_path, [{"kind": "jsonl", "path": str(tmp_path / "m.jsonl")}])
    m = ingest(cfg.data, cfg.artifacts, tmp_path / "out")
    assert counts_of(m) == {"read": 1, "ingested": 0, "quarantined": 1, "duplicates": 0}
    assert len(load_ingested(tmp_path / "out")) == 0


def test_source_digest_follows_content_not_timestamps(tmp_path):
    (tmp_path / "a.png").write_bytes(png(1))
    write_manifest(tmp_path / "m.jsonl", [{"image": "a.png"}])
    cfg = config(tmp_path, [{"kind": "jsonl", "path": str(tmp_path / "m.jsonl")}]).data
    d1 = source_digest(cfg)
    (tmp_path / "a.png").write_bytes(png(1))  # rewritten, same bytes
    assert source_digest(cfg) == d1
    (tmp_path / "a.png").write_bytes(png(2))
    assert source_digest(cfg) != d1
    with pytest.raises(DataError, match="data.sources is empty"):
        source_digest(config(tmp_path, []).data)
