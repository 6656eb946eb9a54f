import io
import json

import pytest
from PIL import Image

from pipeline.config import DataConfig, SourceConfig
from pipeline.data.readers import READERS, RawRow, Rejected
from pipeline.errors import DataError


def png(color: int = 0, size: tuple[int, int] = (4, 3)) -> bytes:
    buf = io.BytesIO()
    Image.new("L", size, color).save(buf, format="PNG")
    return buf.getvalue()


def read(kind: str, path, cfg: DataConfig | None = None, **src) -> list:
    source = SourceConfig(kind=kind, path=path, **src)
    return list(READERS[kind]().rows(source, cfg or DataConfig(sources=[source])))


def test_every_kind_has_a_reader():
    assert set(READERS) == set(SourceConfig.model_fields["kind"].annotation.__args__)


def test_folder_classes_sidecars_and_unlabeled_root(tmp_path):
    (tmp_path / "cat").mkdir()
    (tmp_path / "dog" / "indoor").mkdir(parents=True)
    (tmp_path / "cat" / "a.png").write_bytes(png(1))
    (tmp_path / "cat" / "a.txt").write_text("Is this a cat?\n")
    (tmp_path / "dog" / "indoor" / "b.jpg").write_bytes(png(2))  # wrong extension: the reader does not care
    (tmp_path / "loose.png").write_bytes(png(3))
    (tmp_path / "cat" / ".DS_Store").write_bytes(b"junk")
    rows = read("folder", tmp_path, question="What animal?")
    assert all(isinstance(r, RawRow) for r in rows)
    by_name = {r.image_path.rsplit("/", 1)[-1]: r for r in rows}
    assert set(by_name) == {"a.png", "b.jpg", "loose.png"}
    assert (by_name["a.png"].answer, by_name["a.png"].question) == ("cat", "Is this a cat?")
    assert (by_name["b.jpg"].answer, by_name["b.jpg"].question) == ("dog", "What animal?")
    assert by_name["loose.png"].answer is None
    assert by_name["a.png"].image == png(1)
    assert by_name["a.png"].source == str(tmp_path / "cat" / "a.png")


def test_folder_question_falls_back_to_data_question(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "i.png").write_bytes(png())
    cfg = DataConfig(question="Q?")
    [row] = read("folder", tmp_path, cfg)
    assert row.question == "Q?"


def test_folder_symlink_out_of_root_is_rejected_unread(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "cls").mkdir(parents=True)
    (outside / "deep").mkdir(parents=True)
    (outside / "secret.png").write_bytes(png(9))
    (outside / "deep" / "x.png").write_bytes(png(8))
    (root / "cls" / "link.png").symlink_to(outside / "secret.png")
    (root / "cls" / "linked_dir").symlink_to(outside / "deep")
    rows = read("folder", root)
    assert all(isinstance(r, Rejected) for r in rows) and len(rows) == 2
    reasons = " | ".join(r.reason for r in rows)
    assert "escapes the dataset root" in reasons and "symlink" in reasons and "not followed" in reasons


def test_folder_missing_root_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="not an existing folder"):
        read("folder", tmp_path / "nope")


def test_jsonl_paths_relative_to_manifest_and_bad_lines_rejected(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png(1))
    lines = [
        json.dumps({"img": "imgs/a.png", "q": "What?", "label": 7, "split": "test"}),
        "",
        "{not json",
        json.dumps(["a list"]),
        json.dumps({"q": "no image"}),
        json.dumps({"img": "imgs/a.png"}),
    ]
    m = tmp_path / "m.jsonl"
    m.write_text("\n".join(lines) + "\n")
    rows = read("jsonl", m, image_column="img", question_column="q", answer_column="label")
    assert len(rows) == 5  # the blank line is not a row
    ok, last = rows[0], rows[4]
    assert isinstance(ok, RawRow) and (ok.answer, ok.split, ok.question) == ("7", "test", "What?")
    assert ok.source == f"{m}:1" and ok.image_path == str((tmp_path / "imgs" / "a.png").resolve())
    assert isinstance(last, RawRow) and last.answer is None and last.question == DataConfig().question
    bad = rows[1:4]
    assert [r.source for r in bad] == [f"{m}:3", f"{m}:4", f"{m}:5"]
    assert "not valid JSON" in bad[0].reason
    assert "expected an object" in bad[1].reason
    assert "'img'" in bad[2].reason and "missing" in bad[2].reason


@pytest.mark.parametrize("ref", ["../../etc/passwd", "/etc/passwd", "sub/../../outside.png"])
def test_manifest_paths_escaping_the_root_are_rejected(tmp_path, ref):
    root = tmp_path / "data"
    root.mkdir()
    (tmp_path / "outside.png").write_bytes(png())
    m = root / "m.jsonl"
    m.write_text(json.dumps({"image": ref}) + "\n")
    [row] = read("jsonl", m)
    assert isinstance(row, Rejected) and "escapes the dataset root" in row.reason and "allowed_roots" in row.reason


def test_absolute_path_inside_allowed_roots_is_read(tmp_path):
    root, shared = tmp_path / "data", tmp_path / "shared"
    root.mkdir()
    shared.mkdir()
    (shared / "a.png").write_bytes(png(5))
    m = root / "m.jsonl"
    m.write_text(json.dumps({"image": str(shared / "a.png")}) + "\n")
    src = SourceConfig(kind="jsonl", path=m)
    [row] = list(READERS["jsonl"]().rows(src, DataConfig(sources=[src], allowed_roots=[shared])))
    assert isinstance(row, RawRow) and row.image == png(5)


def test_csv_bom_quoted_newlines_and_line_numbers(tmp_path):
    (tmp_path / "a.png").write_bytes(png(1))
    (tmp_path / "b.png").write_bytes(png(2))
    text = 'image,question,answer\r\na.png,"What is\nshown, here?",cat\r\nb.png,Plain?,\r\nmissing.png,Q,x\r\n'
    m = tmp_path / "m.csv"
    m.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    rows = read("csv", m)
    assert [r.source for r in rows] == [f"{m}:2", f"{m}:4", f"{m}:5"]
    assert rows[0].question == "What is\nshown, here?" and rows[0].answer == "cat"
    assert rows[1].answer is None and rows[1].image == png(2)
    assert isinstance(rows[2], Rejected) and "file not found" in rows[2].reason


def test_csv_not_utf8_names_the_line(tmp_path):
    m = tmp_path / "m.csv"
    m.write_bytes(b"image,question\na.png,ok\nb.png,caf\xe9\n")
    with pytest.raises(DataError, match=r"m\.csv:3: not UTF-8"):
        read("csv", m)


def test_csv_missing_columns_named_with_columns_found(tmp_path):
    m = tmp_path / "m.csv"
    m.write_text("picture,question\nx.png,q\n")
    with pytest.raises(DataError, match=r"\['image'\] not found; columns found: \['picture', 'question'\]"):
        read("csv", m)
    # A column the user named explicitly must exist; a default-named optional one may be absent.
    with pytest.raises(DataError, match=r"\['label'\] not found"):
        read("csv", m, image_column="picture", answer_column="label")
    [row] = read("csv", m, image_column="picture")
    assert isinstance(row, Rejected) and "file not found" in row.reason


def test_csv_row_with_too_many_cells_is_rejected(tmp_path):
    (tmp_path / "a.png").write_bytes(png())
    m = tmp_path / "m.csv"
    m.write_text("image,question\na.png,q,extra\n")
    [row] = read("csv", m)
    assert isinstance(row, Rejected) and "3 cells but the header has 2" in row.reason


def test_hf_dataset_image_feature_bytes_and_paths(tmp_path):
    import datasets

    (tmp_path / "p.png").write_bytes(png(3))
    feat = datasets.Features({"image": datasets.Image(), "question": datasets.Value("string"),
                              "answer": datasets.Value("string")})
    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": png(1), "path": None}, {"bytes": None, "path": str(tmp_path / "p.png")}],
         "question": ["q1", None], "answer": ["yes", None]},
        features=feat,
    )
    cfg = DataConfig(allowed_roots=[tmp_path])
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dd"))
    rows = read("hf", tmp_path / "dd", cfg)
    assert [type(r) for r in rows] == [RawRow, RawRow]
    assert rows[0].image == png(1) and rows[0].image_path == "" and rows[0].answer == "yes"
    assert rows[1].image == png(3) and rows[1].question == cfg.question and rows[1].answer is None
    assert rows[0].source == f"{tmp_path / 'dd'}:0"

    raw = datasets.Dataset.from_dict({"img": [png(4), b""], "split": ["test", "pool"]})
    raw.save_to_disk(str(tmp_path / "raw"))
    rows = read("hf", tmp_path / "raw", image_column="img")
    assert rows[0].image == png(4) and rows[0].split == "test"
    assert isinstance(rows[1], Rejected) and "empty" in rows[1].reason


def test_hf_datasetdict_needs_a_known_split(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"image": [png()]})
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"hf_split None not found; the dataset has splits \['train', 'test'\]"):
        read("hf", tmp_path / "dd")
    assert len(read("hf", tmp_path / "dd", hf_split="test")) == 1


def test_label_studio_export(tmp_path):
    (tmp_path / "imgs").mkdir()
    for i in range(4):
        (tmp_path / "imgs" / f"{i}.png").write_bytes(png(i))
    tasks = [
        {"id": 11, "data": {"image": "/data/local-files/?d=imgs/0.png", "text": "Digit?"},
         "annotations": [{"was_cancelled": False, "result": [{"type": "choices", "value": {"choices": ["3"]}}]}]},
        {"id": 12, "data": {"image": "imgs/1.png"},
         "annotations": [
             {"was_cancelled": False, "result": [{"type": "textarea", "value": {"text": ["a cat"]}}]},
             {"was_cancelled": True, "result": []},
         ]},
        {"id": 13, "data": {"image": "imgs/2.png"},
         "annotations": [{"was_cancelled": True, "result": [{"type": "choices", "value": {"choices": ["9"]}}]}]},
        {"id": 14, "data": {"image": "https://example.com/x.png"}},
        {"id": 15, "data": {"text": "no image"}},
        {"id": 16, "data": {"image": "/data/local-files/?d=../../etc/passwd"}},
    ]
    export = tmp_path / "export.json"
    export.write_text(json.dumps(tasks))
    rows = read("label_studio", export)
    assert [r.source for r in rows] == [f"{export}:task {i}" for i in range(11, 17)]
    assert (rows[0].answer, rows[0].question, rows[0].image) == ("3", "Digit?", png(0))
    assert rows[1].answer == "a cat" and rows[1].question == DataConfig().question
    assert rows[2].answer is None  # the only annotation was cancelled: unlabeled, not a label
    assert isinstance(rows[3], Rejected) and "not a local file" in rows[3].reason
    assert isinstance(rows[4], Rejected) and "data.image" in rows[4].reason
    assert isinstance(rows[5], Rejected) and "escapes the dataset root" in rows[5].reason


def test_label_studio_not_json_is_a_clear_error(tmp_path):
    export = tmp_path / "export.json"
    export.write_text("<html>")
    with pytest.raises(DataError, match="not a Label Studio JSON export"):
        read("label_studio", export)
