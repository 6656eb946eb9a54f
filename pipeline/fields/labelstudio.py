"""Label Studio labeling configs for samples of several images and structured answers.

One `<Image>` per picture of a sample (`$image`, `$image_2`, …: the task's data keys, `task_images`; several side by
side in one row), the question as
`<Text>`, then one control per field of the answer schema: `<Choices>` for an enum field (one `<Choice>` per value),
`<TextArea>` for a string field, `<Number>` for a number field, each under a `<Header>` naming the field. Each
control is named as its field, so an annotation's results map back to the answer's fields (`answer_from_results`);
a field named as an object tag (`image`, `image_2`, `question`) is refused. Controls point at the first image
(`toName`), as a per-task control must point at one object tag.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.errors import DataError
from pipeline.fields.answers import answer_from_cells
from pipeline.fields.schema import AnswerSchema, FieldSpec


def image_keys(n: int) -> list[str]:
    """The task data keys of a sample's n images: image, image_2, image_3, …"""
    return ["image", *(f"image_{i}" for i in range(2, n + 1))]


def task_images(urls: Sequence[str]) -> dict[str, str]:
    """A task's `data` entries for its images, in order (one `<Image>` each in `labeling_config`)."""
    return dict(zip(image_keys(len(urls)), urls, strict=True))


def _control(view: ET.Element, f: FieldSpec, to: str) -> None:
    ET.SubElement(view, "Header", value=f.name)
    required = {"required": "true"} if f.required else {}
    if f.kind == "enum":
        choices = ET.SubElement(view, "Choices", name=f.name, toName=to, choice="single", showInLine="true",
                                **required)
        for c in f.choices:
            ET.SubElement(choices, "Choice", value=str(c))
    elif f.kind == "number":
        # Label Studio's default step (1) would refuse decimals in a number field.
        ET.SubElement(view, "Number", name=f.name, toName=to, step="1" if f.integer else "0.001", **required)
    else:
        ET.SubElement(view, "TextArea", name=f.name, toName=to, maxSubmissions="1", editable="true", **required)


def labeling_config(n_images: int, schema: AnswerSchema | None = None, *, answers: Sequence[str] | None = None,
                    context: bool = False) -> str:
    """The `<View>` of a project whose samples have `n_images` pictures: one Image per picture, the earlier turns
    (`$context`, with `context`), the question (`$text`, as pipeline/annotation/export.py's config reads it), and
    one control per field of `schema` (module docstring); without a schema, one `answer` control: Choices of
    `answers` (a closed set), else a TextArea."""
    keys = image_keys(n_images)
    taken = sorted(set(schema.names if schema is not None else ()) & {*keys, "question", "context"})
    if taken:
        raise DataError(f"{schema.path if schema is not None else 'the answer schema'}: field(s) {taken} have the "
                        "names of the Label Studio task's images or question; rename the field(s) in the schema")
    view = ET.Element("View")
    # Several pictures side by side, each as wide as its share of the row: one under the other at full width pushed
    # the question and the controls below the screen (seen in a real Label Studio, docs/formats.md's screenshot).
    row = ET.SubElement(view, "View", style="display: flex; gap: 8px") if len(keys) > 1 else view
    for k in keys:
        parent = ET.SubElement(row, "View", style="flex: 1; min-width: 0") if len(keys) > 1 else view
        ET.SubElement(parent, "Image", name=k, value=f"${k}")
    if context:
        ET.SubElement(view, "Text", name="context", value="$context")
    ET.SubElement(view, "Text", name="question", value="$text")
    if schema is None:
        _control(view, FieldSpec("answer", "enum", tuple(answers)) if answers else FieldSpec("answer", "string"),
                 keys[0])
    for f in schema.fields if schema is not None else ():
        _control(view, f, keys[0])
    ET.indent(view)
    return ET.tostring(view, encoding="unicode") + "\n"


def sample_task(sample_id: str, urls: Sequence[str], question: str,
                context: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """A Label Studio task of one sample: its images (`task_images`, one `<Image>` each in `labeling_config`), its
    question as `text`, its earlier turns as `context` ("role: text" lines) and its sample ID."""
    data: dict[str, Any] = {**task_images(urls), "text": question, "sample_id": sample_id}
    if context:
        data["context"] = "\n".join(f"{role}: {text}" for role, text in context)
    return {"data": data}


def answer_from_results(results: Sequence[Mapping[str, Any]], schema: AnswerSchema) -> str:
    """The canonical answer of one annotation's results (each control's `from_name` is its field); ValueError
    naming the field when the annotation gives no valid answer."""
    cells: dict[str, str] = {}
    for r in results:
        value = r.get("value") or {}
        name = r.get("from_name")
        if r.get("type") == "choices" and value.get("choices"):
            cells[name] = str(value["choices"][0])
        elif r.get("type") == "textarea" and value.get("text"):
            cells[name] = "\n".join(value["text"])
        elif r.get("type") == "number" and value.get("number") is not None:
            cells[name] = str(value["number"])
    return answer_from_cells(cells, schema)


def prediction_results(answer: str | None, schema: AnswerSchema, to: str = "image") -> list[dict[str, Any]]:
    """A model's answer as pre-annotation results, one per field it gives validly (an enum value among the choices,
    a string, a number): Label Studio refuses a choice outside its control, and a field left out starts blank."""
    from pipeline.fields.answers import parse_answer

    value = parse_answer(answer, schema, use_jsonschema=False).value or {}
    out = []
    for f in schema.fields:
        v = value.get(f.name)
        if v is None or isinstance(v, bool):
            continue
        if f.kind == "enum" and any(v == c and isinstance(v, str) == isinstance(c, str) for c in f.choices):
            out.append({"type": "choices", "value": {"choices": [str(v)]}})
        elif f.kind == "string" and isinstance(v, str) and v.strip():
            out.append({"type": "textarea", "value": {"text": [v]}})
        elif f.kind == "number" and isinstance(v, (int, float)):
            out.append({"type": "number", "value": {"number": v}})
        else:
            continue
        out[-1] |= {"from_name": f.name, "to_name": to}
    return out
