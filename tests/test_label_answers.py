"""Closed labels as annotators type them (issue 47): case, width and spaces ignored, aliases declared beside the
answers, the mapping reported once per import; answers that read the same are a config error."""

import pytest
import yaml

from pipeline.annotation.labels import import_labels
from pipeline.annotation.ledger import Ledger
from pipeline.config import DataConfig, load_config
from pipeline.errors import ConfigError

IDS = {f"s{i:03d}" for i in range(12)}


def test_closed_labels_match_ignoring_case_width_and_spaces_and_through_aliases(tmp_path):
    led = Ledger(tmp_path / "artifacts" / "labels.jsonl")
    data = DataConfig(answers=["H", "I", "hot dog"], answer_aliases={"hotdog": "hot dog"})
    f = tmp_path / "labels.csv"
    f.write_text("sample_id,label\ns000,h\ns001,h\ns002,\uff28\ns003,I\ns004,hotdog\ns005, Hot   DOG \ns006,x\n",
                 encoding="utf-8")
    rep = import_labels(f, known_ids=IDS, answers=data.answers, aliases=data.answer_aliases, ledger=led,
                        round_index=1, rejections_dir=tmp_path / "artifacts" / "rejections")
    assert led.labels() == {"s000": "H", "s001": "H", "s002": "H", "s003": "I", "s004": "hot dog", "s005": "hot dog"}
    # Once per import, the most frequent first (then in file order).
    assert ("mapped 5 labels: 'h' → 'H' (2), 'Ｈ' → 'H' (1), 'hotdog' → 'hot dog' (1), 'Hot   DOG' → 'hot dog' (1)"
            in rep.summary())
    [bad] = rep.rejected
    assert bad.where.endswith("labels.csv:8") and "'x' is not in the answer set [H, I, hot dog]" in bad.reason
    assert "data.answer_aliases" in bad.reason


@pytest.mark.parametrize(("data", "message"), [
    ({"answers": ["Cat", "cat "]}, r"data.answers 'Cat' and 'cat ' are one answer .* keep one of them"),
    ({"answers": ["A", "B"], "answer_aliases": {"b": "A"}}, r"'b' → 'A' collides with 'B'"),
    ({"answers": ["A", "B"], "answer_aliases": {"c": "D"}}, r"'c' → 'D' names no answer of data.answers \[A, B\]"),
    ({"answer_aliases": {"c": "D"}}, r"data.answers is not set"),
])
def test_answers_that_read_the_same_are_a_config_error_naming_both(tmp_path, data, message):
    path = tmp_path / "tamis.yaml"
    path.write_text(yaml.safe_dump({"data": data}))
    with pytest.raises(ConfigError, match=message):
        load_config(path, root=tmp_path)


def test_without_aliases_the_data_section_dumps_as_before():
    # The ingest stage is keyed on the data section's dump: existing projects keep their keys.
    assert "answer_aliases" not in DataConfig(answers=["A", "B"]).model_dump(mode="json")
    assert DataConfig(answers=["A", "B"], answer_aliases={"a.": "A"}).model_dump()["answer_aliases"] == {"a.": "A"}


def _letters(root, n=4):
    """Images a_00.png … and a test-style CSV `file,letter` naming them, the way `tamis init --test` reads one."""
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    rows = ["file,letter"]
    for i in range(n):
        Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(root / f"a_{i:02d}.png")
        rows.append(f"a_{i:02d}.png,{'ab'[i % 2]}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    return root / "labels.csv"


def test_a_label_file_without_a_label_column_reads_the_answer_column_init_would(tmp_path):
    from pipeline.annotation.label_files import LabelKeys, read_label_file
    from pipeline.annotation.matching import SampleIndex
    from pipeline.project_init.detect import detect_test

    table = _letters(tmp_path / "test")
    assert detect_test(table, tmp_path / "pool").source["answer_column"] == "letter"  # what init reads
    data = DataConfig(sources=[{"kind": "csv", "path": table, "image_column": "file", "answer_column": "letter"}],
                      answers=["A", "B"])
    index = SampleIndex([f"s{i}" for i in range(4)], image_paths=[str(tmp_path / f"pool/a_{i:02d}.png")
                                                                   for i in range(4)])
    assert read_label_file(table, LabelKeys.from_config(data)).answer_column == "letter"
    rep = import_labels(table, known_ids=index, answers=data.answers, ledger=Ledger(tmp_path / "art/labels.jsonl"),
                        round_index=1, rejections_dir=tmp_path / "art/rejections", keys=LabelKeys.from_config(data))
    assert len(rep.accepted) == 4 and not rep.rejected
    assert "answers read from column 'letter' (no `label` column)" in rep.summary()
    assert "mapped 4 labels: 'a' → 'A' (2), 'b' → 'B' (2)" in rep.summary()


@pytest.mark.parametrize(("text", "keys", "found"), [
    ("sample_id,annotator,category\ns000,x,3\n", {}, "category"),  # named like an answer
    ("sample_id,seconds,letter\ns000,4,3\n", {}, "letter"),  # the only candidate
    ("sample_id,letter,notes\ns000,3,hm\n", {"answer_columns": ("letter",)}, "letter"),  # a source's answer_column
    # tamis's own export (annotate.csv) with its label column renamed: its other columns are never the answer
    ("sample_id,image,original_image,text,model_answer,confidence,letter\ns000,i.png,o.png,q,3,0.5,3\n", {}, "letter"),
    ('{"sample_id": "s000", "category": "3"}\n', {}, "category"),
])
def test_the_answer_column_of_a_label_table(tmp_path, text, keys, found):
    from pipeline.annotation.label_files import LabelKeys, read_label_file

    f = tmp_path / ("labels.jsonl" if text.startswith("{") else "labels.csv")
    f.write_text(text)
    lf = read_label_file(f, LabelKeys(**keys))
    assert lf.answer_column == found and lf.rows[0].label == "3"


def test_an_ambiguous_answer_column_is_an_error_listing_the_candidates_and_the_fix(tmp_path):
    from pipeline.annotation.label_files import read_label_file
    from pipeline.errors import LabelImportError

    f = tmp_path / "labels.csv"
    f.write_text("sample_id,letter,notes\ns000,3,hm\n")
    with pytest.raises(LabelImportError, match=r"labels.csv:1: no `label` column, and 2 columns could each hold the "
                                               r"answers: letter, notes; rename the answer column to `label`"):
        read_label_file(f)
