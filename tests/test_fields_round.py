"""Issue 51's second "done when", run as a user runs it: a JSONL manifest of generated pictures (a coloured shape on
a plain ground, not the digits) whose test answers are JSON objects, `{"shape": …, "color": …}`, goes through
`tamis init` (which proposes the answer schema: `shape` an enum of 3 values, `color` a string, it has too many
values to be a closed set) → round 0 (the export has one Label Studio control and one table column per field) →
labels back (the exported annotate.csv's field columns filled in, one row breaking the schema) → round 1 (trained on
the canonical JSON text, evaluated per field: per_class.json's `fields` and a summary in metrics.jsonl)."""

from __future__ import annotations

import csv
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from tests.test_several_images_round import tamis

SHAPES = ("circle", "square", "triangle")
# 14 colours: more than an enum field holds (pipeline/project_init/schema.py ENUM_MAX), so init proposes a string.
COLORS = {"red": (220, 30, 30), "dark red": (120, 10, 10), "green": (30, 180, 40), "dark green": (10, 90, 20),
          "blue": (30, 60, 220), "navy": (10, 20, 100), "yellow": (230, 220, 40), "orange": (240, 140, 20),
          "purple": (130, 40, 160), "pink": (240, 130, 180), "brown": (120, 70, 30), "grey": (128, 128, 128),
          "black": (10, 10, 10), "teal": (20, 140, 140)}


def answer_of(i: int) -> dict[str, str]:
    return {"shape": SHAPES[i % 3], "color": list(COLORS)[i % len(COLORS)]}


def scenes(root: Path, pool: int, test: int) -> Path:
    """`pool` unlabeled and `test` labeled (split: test) pictures in a JSONL manifest, answers as JSON objects."""
    (root / "images").mkdir(parents=True)
    rows = []
    for i in range(pool + test):
        a = answer_of(i)
        im = Image.new("RGB", (48, 40), (235, 235, 225))
        d, fill, box = ImageDraw.Draw(im), COLORS[a["color"]], (8 + i % 5, 6, 38 + i % 5, 34)
        if a["shape"] == "circle":
            d.ellipse(box, fill=fill)
        elif a["shape"] == "square":
            d.rectangle(box, fill=fill)
        else:
            d.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=fill)
        im.save(root / "images" / f"scene{i:03d}.png")
        rows.append({"image": f"images/scene{i:03d}.png", "question": "Which shape, in which colour?",
                     **({"answer": a, "split": "test"} if i >= pool else {})})
    (root / "scenes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "scenes.jsonl"


def check_round0_export(export: Path) -> list[dict]:
    """One control per field in Label Studio's config, one column per field in the table."""
    view = ET.fromstring((export / "label_config.xml").read_text())
    assert [c.get("name") for c in view.iter("Choices")] == ["shape"]
    assert sorted(c.get("value") for c in view.iter("Choice")) == sorted(SHAPES)
    assert [t.get("name") for t in view.iter("TextArea")] == ["color"]
    with (export / "annotate.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and list(rows[0])[-2:] == ["shape", "color"] and "label" not in rows[0]
    return rows


@pytest.mark.slow
def test_cli_a_schema_project_with_an_enum_and_a_string_field_runs_two_rounds_with_per_field_metrics(tmp_path,
                                                                                                     tiny_models):
    source = scenes(tmp_path / "data", pool=24, test=12)
    project = tmp_path / "project"
    project.mkdir()
    init = tamis(project, "init", str(source), "--model", str(tiny_models["idefics3"]))
    schema = json.loads((project / "answer.schema.json").read_text())
    assert schema["properties"] == {"shape": {"enum": sorted(SHAPES)}, "color": {"type": "string"}}, init.stdout
    assert "answer_schema:" in (project / "tamis.yaml").read_text()
    tamis(project, "round")
    artifacts = project / "artifacts"
    rows = check_round0_export(artifacts / "rounds" / "000" / "export")

    for r in rows:  # labels back: the user fills the field columns and drops the file into the inbox
        a = answer_of(int(r["original_image"][5:8]))
        r["shape"], r["color"] = a["shape"], a["color"]
    rows.append(dict(rows[0]))  # the row fixed, after the broken one
    rows[0]["shape"] = "hexagon"  # not one of the enum's values: rejected with its row, its field and the fix
    (artifacts / "inbox").mkdir(exist_ok=True)
    with (artifacts / "inbox" / "labels-round-000.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    tamis(project, "round")
    state = json.loads((artifacts / "rounds" / "001" / "round.json").read_text())
    assert state["labeled"] == len(rows) - 1 == 2, state
    rejected = [x for imp in state.get("imports", []) for x in imp.get("rejections", [])]
    assert any("labels-round-000.csv:2" in x["where"] and "'shape'" in x["reason"] and "hexagon" in x["reason"]
               for x in rejected), state.get("imports")

    per_class = json.loads((Path(state["eval_dir"]) / "per_class.json").read_text())
    fields = {f["field"]: f for f in per_class["fields"]}
    assert fields["shape"]["kind"] == "enum" and fields["shape"]["metric"] == "exact_match"
    assert fields["color"]["kind"] == "string" and fields["color"]["metric"] == "token_f1"
    assert "normalized_match" in fields["color"] and fields["shape"]["n"] == fields["color"]["n"] == 12
    assert set(fields["shape"]["per_class"]["answers"]) == set(SHAPES)
    assert per_class["invalid"]["n"] == 12
    from pipeline.metrics import read_metrics

    logged = {m["metric"] for m in read_metrics(artifacts) if m["round"] == 1}
    assert {"shape.exact_match", "color.token_f1", "color.normalized_match", "schema_valid_rate"} <= logged, logged
    # the training target: each label's canonical JSON text (the schema's field order, compact)
    from datasets import load_from_disk

    trained = load_from_disk(str(artifacts / "rounds" / "001" / "labeled" / "dataset"))
    assert sorted(trained["answer"]) == sorted(json.dumps(answer_of(int(r["original_image"][5:8])),
                                                          separators=(",", ":")) for r in rows[1:])
    status = tamis(project, "status", "--per-class").stdout
    assert "per-field results" in status and "shape" in status and "token_f1" in status, status
