"""Structured answers (issue 51 item 3), the library parts: data.answer_schema checked with the field and the fix,
answers validated (jsonschema checked against the subset validator), per-field metrics in per_class.json's format,
a Label Studio config with one control per field and one Image per picture, label files with one column per field,
and per-field uncertainty with its stated combination."""

import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from pipeline.config import parse_config
from pipeline.errors import ConfigError, DataError
from pipeline.fields.answers import (
    answer_from_cells,
    canonical,
    cells_of,
    count_invalid,
    label_columns,
    parse_answer,
    subset_problems,
)
from pipeline.fields.labelstudio import answer_from_results, labeling_config, task_images
from pipeline.fields.metrics import fields_report
from pipeline.fields.schema import load_answer_schema, schema_of
from pipeline.fields.uncertainty import combine, enum_shares, enum_uncertainty, open_uncertainty

SCHEMA = {"type": "object",
          "properties": {"category": {"enum": ["shirt", "shoe", "bag"]}, "color": {"type": "string"},
                         "size": {"type": "integer"}, "price": {"type": "number"}},
          "required": ["category", "color"], "additionalProperties": False}


@pytest.fixture
def schema():
    return schema_of(SCHEMA, "products.json")


def test_a_schema_of_enum_string_and_number_fields_loads_in_order(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    s = load_answer_schema(tmp_path / "s.json")
    assert [(f.name, f.kind, f.required) for f in s.fields] == [
        ("category", "enum", True), ("color", "string", True), ("size", "number", False), ("price", "number", False)]
    assert s.field("category").choices == ("shirt", "shoe", "bag") and s.field("size").integer


@pytest.mark.parametrize("raw,words", [
    ({"type": "array"}, "object schema with `properties`"),
    ({"properties": {}}, "`properties` is empty"),
    ({"properties": {"dims": {"type": "object", "properties": {}}}}, "field 'dims' uses ['properties']"),
    ({"properties": {"tags": {"type": "array"}}}, "field 'tags' has type 'array'"),
    ({"properties": {"c": {"enum": ["only"]}}}, "at least 2 distinct values"),
    ({"properties": {"c": {"type": "string"}}, "required": ["d"]}, "`required` ['d'] must list fields"),
])
def test_a_schema_tamis_cannot_read_is_refused_naming_the_field_and_the_fix(raw, words):
    with pytest.raises(ConfigError, match="products.json") as e:
        schema_of(raw, "products.json")
    assert words in str(e.value)


def test_config_reads_the_schema_relative_to_the_config_and_keeps_the_data_dump_of_a_project_without_one(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    cfg = parse_config({"data": {"answer_schema": "s.json"}}, root=tmp_path)
    assert cfg.data.answer_schema == tmp_path / "s.json"
    assert "answer_schema" not in parse_config({}).data.model_dump(mode="json")  # ingest keys unchanged
    (tmp_path / "bad.json").write_text('{"properties": {"x": {"type": "boolean"}}}')
    with pytest.raises(ConfigError, match=r"tamis.yaml: invalid config\n.*bad.json.*field 'x' has type 'boolean'"):
        parse_config({"data": {"answer_schema": "bad.json"}}, origin="tamis.yaml", root=tmp_path)
    with pytest.raises(ConfigError, match="file not found"):
        parse_config({"data": {"answer_schema": "gone.json"}}, root=tmp_path)
    with pytest.raises(ConfigError, match="remove data.answers"):
        parse_config({"data": {"answer_schema": "s.json", "answers": ["a", "b"]}}, root=tmp_path)


ANSWERS = [
    '{"category": "shoe", "color": "red"}',
    '```json\n{"category": "bag", "color": "black", "size": 3, "price": 19.5}\n```',
    '{"category": "hat", "color": "red"}',
    '{"category": "shoe"}',
    '{"category": "shoe", "color": 7}',
    '{"category": "shoe", "color": "red", "size": 2.5}',
    '{"category": "shoe", "color": "red", "size": 2.0}',
    '{"category": "shoe", "color": "red", "price": true}',
    '{"category": "shoe", "color": "red", "brand": "x"}',
    '["shoe", "red"]',
    'a red shoe',
    None,
]


@pytest.mark.parametrize("answer", ANSWERS)
def test_jsonschema_and_the_subset_validator_agree_on_every_answer(schema, answer):
    pytest.importorskip("jsonschema")
    assert parse_answer(answer, schema).valid == parse_answer(answer, schema, use_jsonschema=False).valid


def test_invalid_answers_are_counted_with_the_first_few_and_why(schema):
    count = count_invalid(ANSWERS, schema).as_dict()
    assert (count["n"], count["invalid"]) == (12, 9)
    assert count["examples"][0]["index"] == 2 and len(count["examples"]) == 5
    assert subset_problems({"category": "hat"}, schema) == [
        "field 'color' is missing", "field 'category' is 'hat', not one of ['shirt', 'shoe', 'bag']"]


def test_per_field_metrics_exact_match_for_enum_and_number_token_f1_for_strings(schema):
    refs = ['{"category": "shoe", "color": "dark red", "price": 10}',
            '{"category": "bag", "color": "black"}',
            '{"category": "shirt", "color": "white", "price": 5.5}']
    preds = ['{"category": "shoe", "color": "red", "price": 10.0}',
             'not json at all',
             '{"category": "bag", "color": "white", "price": 6}']
    report = fields_report(preds, refs, schema)
    by = {f["field"]: f for f in report["fields"]}
    assert (by["category"]["metric"], by["category"]["score"]) == ("exact_match", round(1 / 3, 6))
    assert by["color"]["metric"] == "token_f1" and by["color"]["score"] == round((2 / 3 + 0 + 1) / 3, 6)
    assert (by["price"]["n"], by["price"]["score"]) == (2, 0.5)
    assert by["size"]["n"] == 0 and by["size"]["score"] is None
    assert by["category"]["missing"] == 1 and by["category"]["per_class"]["answers"] == ["shirt", "shoe", "bag"]
    assert by["category"]["per_class"]["confusion"][2] == [0, 0, 0, 1]  # bag → no answer ("(other)")
    assert report["invalid"]["invalid"] == 1 and report["n"] == 3
    with pytest.raises(DataError, match=r"test answer 1 of 1 .* not valid under products.json"):
        fields_report(["{}"], ['{"category": "hat", "color": "x"}'], schema)


def test_label_studio_config_has_one_image_per_picture_and_one_control_per_field(schema):
    view = ET.fromstring(labeling_config(2, schema))
    assert [(e.get("name"), e.get("value")) for e in view.iter("Image")] == [("image", "$image"),
                                                                              ("image_2", "$image_2")]
    assert [c.get("value") for c in view.find("Choices[@name='category']")] == ["shirt", "shoe", "bag"]
    assert view.find("TextArea[@name='color']").get("required") == "true"
    assert view.find("Number[@name='size']").get("step") == "1"
    assert view.find("Number[@name='price']").get("required") is None
    assert {e.get("toName") for e in view if e.get("toName")} == {"image"}
    assert task_images(["a.png", "b.png"]) == {"image": "a.png", "image_2": "b.png"}
    results = [{"from_name": "category", "type": "choices", "value": {"choices": ["bag"]}},
               {"from_name": "color", "type": "textarea", "value": {"text": ["navy"]}},
               {"from_name": "price", "type": "number", "value": {"number": 12.5}}]
    assert answer_from_results(results, schema) == '{"category":"bag","color":"navy","price":12.5}'
    with pytest.raises(DataError, match="rename the field"):
        labeling_config(1, schema_of({"properties": {"question": {"type": "string"}}}))


def test_label_files_have_one_column_per_field_and_read_back_to_the_canonical_answer(schema):
    assert label_columns(schema) == ["category", "color", "size", "price"]
    answer = answer_from_cells({"category": "shoe", "color": " red ", "size": "42", "price": ""}, schema)
    assert answer == '{"category":"shoe","color":"red","size":42}'
    assert cells_of(answer, schema) == {"category": "shoe", "color": "red", "size": "42", "price": ""}
    assert canonical({"color": "red", "category": "shoe"}, schema) == '{"category":"shoe","color":"red"}'
    with pytest.raises(ValueError, match="column 'category': 'hat' is not one of"):
        answer_from_cells({"category": "hat", "color": "red"}, schema)
    with pytest.raises(ValueError, match="column 'color' is empty but the schema requires"):
        answer_from_cells({"category": "shoe"}, schema)
    with pytest.raises(ValueError, match="column 'size': '2.5' is not an integer"):
        answer_from_cells({"category": "shoe", "color": "red", "size": "2.5"}, schema)


def test_field_uncertainties_are_normalised_and_combined_as_stated(schema):
    assert enum_uncertainty(np.array([[1, 0, 0], [1, 1, 1]])).round(6).tolist() == [0.0, 1.0]
    samples = [['{"category": "shoe", "color": "Red"}', '{"category": "shoe", "color": "red."}'],
               ['{"category": "shoe", "color": "red"}', '{"category": "bag", "color": "blue"}'],
               ['{"category": "shoe", "color": "red"}', "garbage"]]
    color = open_uncertainty(samples, schema, schema.field("color"))
    assert color.round(6).tolist() == [0.0, 1.0, 1.0]  # same meaning; two meanings; a value and no value
    cat = enum_uncertainty(enum_shares(samples, schema, schema.field("category")))
    assert cat.round(6).tolist() == [0.0, round(np.log(2) / np.log(3), 6), 0.0]
    assert combine({"category": cat, "color": color}).round(6).tolist() == [0.0, round((cat[1] + 1) / 2, 6), 0.5]
    assert combine({"category": cat, "color": color}, how="max").tolist() == [0.0, 1.0, 1.0]
