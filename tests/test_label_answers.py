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
