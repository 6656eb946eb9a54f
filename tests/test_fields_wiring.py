"""Structured answers through a round's parts (issue 51's second "done when"): a source answer or an imported label
that breaks data.answer_schema is quarantined / rejected with its file and row, the field and the fix, a valid one
is kept as its canonical JSON text (the training target); Label Studio's per-field controls go out and come back as
the JSON answer; the evaluation's per-field metrics reach metrics.json; `tamis init` proposes the schema."""

import csv
import io
import json
import xml.etree.ElementTree as ET

from PIL import Image

from pipeline.annotation.export import CSV_FILE, LABEL_CONFIG_FILE, TASKS_FILE, export_selection
from pipeline.annotation.label_files import LabelKeys
from pipeline.annotation.labels import import_labels
from pipeline.annotation.ledger import Ledger
from pipeline.config import parse_config
from pipeline.data.ingest import ingest, load_ingested
from pipeline.evaluate import with_field_metrics
from pipeline.fields.schema import schema_of
from pipeline.project_init.schema import propose_schema
from pipeline.store import read_jsonl

SCHEMA = {"type": "object", "properties": {"shape": {"enum": ["circle", "square"]}, "color": {"type": "string"}}}
KNOWN = {f"s{i:03d}" for i in range(6)}


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), (200, 10, 10)).save(buf, "PNG")
    return buf.getvalue()


def _config(tmp_path, sources):
    (tmp_path / "shapes.schema.json").write_text(json.dumps(SCHEMA))
    return parse_config({"data": {"sources": sources, "answer_schema": "shapes.schema.json"},
                         "paths": {"artifacts": "art"}}, root=tmp_path)


def test_a_source_answer_breaking_the_schema_is_quarantined_naming_its_field_and_a_valid_one_kept_canonical(tmp_path):
    (tmp_path / "imgs").mkdir()
    rows = [{"image": "imgs/a.png", "answer": {"color": "dark red", "shape": "circle"}, "split": "test"},
            {"image": "imgs/b.png", "answer": {"shape": "hexagon", "color": "red"}, "split": "test"},
            {"image": "imgs/c.png", "answer": "a red circle", "split": "test"}]
    for i, name in enumerate("abc"):
        Image.new("RGB", (8, 6), (i * 60, 10, 10)).save(tmp_path / "imgs" / f"{name}.png")
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _config(tmp_path, [{"kind": "jsonl", "path": "m.jsonl"}])
    ingest(cfg.data, cfg.artifacts, tmp_path / "out")
    kept = load_ingested(tmp_path / "out")
    assert kept["answer"] == ['{"shape":"circle","color":"dark red"}']  # the schema's order, compact
    quarantined = {q["path"].rsplit("/", 1)[-1]: q for q in read_jsonl(tmp_path / "out" / "quarantine.jsonl")}
    bad = quarantined["b.png"]
    assert bad["source"].endswith("m.jsonl:2") and bad["fields"] == ["shape"] and "hexagon" in bad["reason"] and "fix field(s) ['shape']" in bad["reason"]
    assert "not JSON" in quarantined["c.png"]["reason"] and quarantined["c.png"]["fields"] == [
        "shape", "color"]


def _import(tmp_path, path, schema):
    led = Ledger(tmp_path / "artifacts" / "labels.jsonl")
    rep = import_labels(path, known_ids=KNOWN, answers=None, ledger=led, round_index=1,
                        rejections_dir=tmp_path / "artifacts" / "rejections", keys=LabelKeys(schema=schema))
    return rep, led.labels()


def test_imported_labels_breaking_the_schema_are_rejected_with_file_row_field_and_fix(tmp_path):
    schema = schema_of(SCHEMA, "shapes.schema.json")
    path = tmp_path / "labels.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        {"sample_id": "s000", "label": {"color": "blue", "shape": "square"}},
        {"sample_id": "s001", "label": '{"shape": "hexagon", "color": "red"}'},
        {"sample_id": "s002", "label": '{"shape": "circle"}'}]))
    rep, labels = _import(tmp_path, path, schema)
    assert labels == {"s000": '{"shape":"square","color":"blue"}'}
    why = {x.where: x.reason for x in rep.rejected}
    assert "'shape'" in why[f"{path}:2"] and "hexagon" in why[f"{path}:2"] and "fix field(s) ['shape']" in why[
        f"{path}:2"]
    assert "fix field(s) ['color']" in why[f"{path}:3"]

    table = tmp_path / "fields.csv"  # one column per field, as the export writes it
    table.write_text("sample_id,shape,color\ns003,circle,light green\ns004,oval,red\n")
    rep, labels = _import(tmp_path, table, schema)
    assert labels["s003"] == '{"shape":"circle","color":"light green"}'
    assert [(x.where, "column 'shape'" in x.reason and "oval" in x.reason) for x in rep.rejected] == [
        (f"{table}:3", True)]


def test_label_studio_gets_one_control_per_field_and_its_annotations_come_back_as_the_json_answer(tmp_path,
                                                                                                 make_vqa):
    ds, _ = make_vqa()
    schema = schema_of(SCHEMA, "shapes.schema.json")
    cfg = parse_config({"paths": {"artifacts": "artifacts"}, "annotate": {"export_images": "prepared"}},
                       root=tmp_path)
    sel = [{"sample_id": sid, "rank": k, "score": 0.5, "strategy": "token_entropy", "adapter_digest": "ab" * 32,
            "prediction": p, "confidence": 0.4, "scores": {}} for k, (sid, p) in enumerate(
        [("s001", '{"shape":"circle","color":"red"}'), ("s002", '{"shape":"oval","color":"teal"}')])]
    out = tmp_path / "export"
    export_selection(sel, ds, cfg.annotate, None, cfg.artifacts, out, round_index=0, schema=schema)
    view = ET.fromstring((out / LABEL_CONFIG_FILE).read_text())
    assert [c.get("name") for c in view.iter("Choices")] == ["shape"]
    assert [c.get("name") for c in view.iter("TextArea")] == ["color"]
    tasks = json.loads((out / TASKS_FILE).read_text())
    results = [{r["from_name"]: r["value"] for r in t["predictions"][0]["result"]} for t in tasks]
    # an enum value outside the choices is no pre-annotation (Label Studio would refuse it); the string still is
    assert results == [{"shape": {"choices": ["circle"]}, "color": {"text": ["red"]}}, {"color": {"text": ["teal"]}}]
    header = next(csv.reader(io.StringIO((out / CSV_FILE).read_text())))
    assert header[-2:] == ["shape", "color"] and "label" not in header

    for t, (shape, color) in zip(tasks, [("square", "navy blue"), ("circle", "")], strict=True):
        t["id"] = len(shape)
        t["annotations"] = [{"id": 7, "completed_by": 1, "result": [
            {**r, "value": v} for r, v in zip(t["predictions"][0]["result"][:1], [{"choices": [shape]}], strict=True)
        ] + ([{"from_name": "color", "to_name": "image", "type": "textarea", "value": {"text": [color]}}]
             if color else [])}]
        t["annotations"][0]["result"][0]["from_name"] = "shape"
        t["annotations"][0]["result"][0]["type"] = "choices"
    (tmp_path / "ls.json").write_text(json.dumps(tasks))
    rep, labels = _import(tmp_path, tmp_path / "ls.json", schema)
    assert labels == {"s001": '{"shape":"square","color":"navy blue"}'}
    assert len(rep.rejected) == 1 and "column 'color' is empty" in rep.rejected[0].reason


def test_per_field_metrics_reach_the_evaluations_metrics_with_their_intervals():
    rows = [{"prediction": '{"shape":"circle","color":"Red"}', "answer": '{"shape":"circle","color":"red"}'},
            {"prediction": '{"shape":"square","color":"dark blue"}', "answer": '{"shape":"circle","color":"blue"}'},
            {"prediction": "no json", "answer": '{"shape":"square","color":"green"}'}]
    result = {"metrics": {"exact_match": 0.0}, "intervals": {}, "predictions": rows}
    fields = with_field_metrics(result, SCHEMA)
    assert [f["field"] for f in fields["fields"]] == ["shape", "color"] and fields["invalid"]["invalid"] == 1
    m = result["metrics"]
    assert round(m["shape.exact_match"], 3) == 0.333 and m["color.normalized_match"] == round(1 / 3, 6)
    assert 0.33 < m["color.token_f1"] < 0.6 and round(m["schema_valid_rate"], 3) == 0.667
    assert set(result["intervals"]) == {"shape.exact_match", "color.token_f1"}


def test_init_proposes_an_enum_for_a_field_with_few_values_and_a_string_otherwise():
    answers = {json.dumps({"shape": ["circle", "square"][i % 2], "color": f"colour {i}", "size": i % 3 + 0.5}): 1
               for i in range(10)}
    p = propose_schema(answers)
    assert p.schema == {"type": "object", "properties": {"shape": {"enum": ["circle", "square"]},
                                                         "color": {"type": "string"}, "size": {"type": "number"}},
                        "required": ["shape", "color", "size"]}
    assert "shape (enum of 2)" in p.why and schema_of(p.schema).names == ["shape", "color", "size"]
    assert propose_schema({"cat": 3, "dog": 2}).schema is None  # plain answers: no schema
    assert "holds objects" in propose_schema({json.dumps({"a": {"b": 1}}): 2}).why
