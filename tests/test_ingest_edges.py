"""Ingestion edge cases from issue 15: messages a person can act on, short CSV rows, rows without a question, and
the source's own IDs kept for importing labels."""

import io
import json

from PIL import Image

from pipeline.config import DataConfig, SourceConfig, parse_config
from pipeline.data.ingest import ingest, load_ingested
from pipeline.data.readers import READERS, RawRow, Rejected
from pipeline.store import read_jsonl


def png(color: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (4, 3), color).save(buf, format="PNG")
    return buf.getvalue()


def read(kind: str, path, **src) -> list:
    source = SourceConfig(kind=kind, path=path, **src)
    return list(READERS[kind]().rows(source, DataConfig(sources=[source])))


def test_jsonl_image_field_messages(tmp_path):
    (tmp_path / "12345").write_bytes(png())  # a number must not become this file name
    m = tmp_path / "m.jsonl"
    m.write_text("\n".join([json.dumps({"image": 12345}), json.dumps({"image": None}), json.dumps({"image": " "}),
                            json.dumps({"picture": "a.png"}), '{"image": "a\tb.png"}']) + "\n")
    rows = read("jsonl", m)
    assert all(isinstance(r, Rejected) for r in rows)
    number, null, empty, missing, control = (r.reason for r in rows)
    assert "field 'image' holds a int (12345), not an image path" in number and "not found" not in number
    assert "field 'image' is null" in null and "fields present" not in null
    assert "field 'image' is empty" in empty
    assert "field 'image' is missing (fields present: ['picture'])" in missing
    assert "at at" not in control and "not valid JSON at column" in control and "Invalid control character" in control


def test_csv_short_row_is_quarantined_not_an_unlabeled_row(tmp_path):
    (tmp_path / "a.png").write_bytes(png())
    m = tmp_path / "m.csv"
    m.write_text("image,question,answer\na.png,q,cat\na.png\n")
    ok, short = read("csv", m)
    assert isinstance(ok, RawRow) and ok.answer == "cat"
    assert isinstance(short, Rejected) and short.source == f"{m}:3"
    assert "1 cells but the header has 3 (no 'question', 'answer')" in short.reason


def test_row_without_a_question_is_kept_with_a_warning(tmp_path):
    (tmp_path / "a.png").write_bytes(png(1))
    (tmp_path / "b.png").write_bytes(png(2))
    (tmp_path / "c.png").write_bytes(png(3))
    m = tmp_path / "m.csv"
    m.write_text("image,question\na.png,What digit?\nb.png,\n")
    j = tmp_path / "m.jsonl"
    j.write_text(json.dumps({"image": "c.png"}) + "\n")  # no question field at all: the default is the intent
    cfg = parse_config({"data": {"sources": [{"kind": "csv", "path": str(m)}, {"kind": "jsonl", "path": str(j)}]},
                        "paths": {"artifacts": str(tmp_path / "art")}})
    out = tmp_path / "art" / "ingest"
    man = ingest(cfg.data, cfg.artifacts, out)
    assert man.info["counts"]["ingested"] == 3 and man.info["warnings"] == 1
    [w] = read_jsonl(out / "warnings.jsonl")
    assert w["source"] == f"{m}:3" and "no question" in w["warning"] and "data.question" in w["warning"]


def test_external_ids_are_kept_in_the_dataset(tmp_path):
    (tmp_path / "a.png").write_bytes(png(1))
    (tmp_path / "b.png").write_bytes(png(2))
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"image": "a.png", "id": "cat-001"}) + "\n" + json.dumps({"image": "b.png", "key": 7})
                 + "\n")

    def ids(out, **src):
        cfg = parse_config({"data": {"sources": [{"kind": "jsonl", "path": str(m), **src}]},
                            "paths": {"artifacts": str(tmp_path / "art")}})
        ingest(cfg.data, cfg.artifacts, out)
        ds = load_ingested(out)
        return {p.rsplit("/", 1)[1]: x for p, x in zip(ds["image_path"], ds["external_id"], strict=True)}

    assert ids(tmp_path / "i1") == {"a.png": "cat-001", "b.png": None}
    assert ids(tmp_path / "i2", id_column="key") == {"a.png": None, "b.png": "7"}
