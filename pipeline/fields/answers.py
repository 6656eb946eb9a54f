"""Answers under an answer schema: parsed, validated, counted when invalid, and spread over one column per field.

An answer is the text of a JSON object (a model's output may wrap it in a ```json fence, which is taken off). It is
validated with `jsonschema` (MIT) when it is installed, against the schema as written; else by `subset_problems`,
which checks what pipeline/fields/schema.py accepts (required fields, enum membership, string / number / integer
types, `additionalProperties: false`). Both give the same verdict on every answer (tests/test_fields.py checks them
against each other); the messages differ.

The canonical text of an answer (`canonical`) lists the fields in the schema's order, compact, without escaping
non-ASCII: the same object is the same label whatever the spacing or key order it was written with.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.fields.schema import AnswerSchema, FieldSpec

_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
EXAMPLES = 5  # invalid answers kept as examples by count_invalid


@dataclass(frozen=True)
class ParsedAnswer:
    value: dict[str, Any] | None  # the object, when the text is one (even an invalid one)
    problems: tuple[str, ...]  # empty when the answer is valid

    @property
    def valid(self) -> bool:
        return self.value is not None and not self.problems


def _type_ok(f: FieldSpec, v: Any) -> bool:
    if f.kind == "enum":  # JSON Schema's equality: 1 == 1.0, but "1" != 1 and true != 1
        return not isinstance(v, bool) and any(v == c and isinstance(v, str) == isinstance(c, str) for c in f.choices)
    if f.kind == "string":
        return isinstance(v, str)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return not f.integer or float(v).is_integer()


def subset_problems(value: Mapping[str, Any], schema: AnswerSchema) -> list[str]:
    """What is wrong with `value` under `schema` (module docstring), one sentence per problem."""
    out = [f"field {f.name!r} is missing" for f in schema.fields if f.required and f.name not in value]
    for f in schema.fields:
        if f.name in value and not _type_ok(f, value[f.name]):
            want = f"one of {list(f.choices)}" if f.kind == "enum" else f"a{'n integer' if f.integer else ' ' + f.kind}"
            out.append(f"field {f.name!r} is {value[f.name]!r}, not {want}")
    if schema.raw.get("additionalProperties") is False:
        out += [f"field {k!r} is not in the schema" for k in value if k not in schema.names]
    return out


def _jsonschema_problems(value: Mapping[str, Any], schema: AnswerSchema) -> list[str] | None:
    """jsonschema's messages, or None when it is not installed."""
    try:
        import jsonschema
    except ImportError:
        return None
    # `required` left out means every field (pipeline/fields/schema.py), which plain JSON Schema reads as none.
    raw = {**schema.raw, "required": [f.name for f in schema.fields if f.required]}
    validator = jsonschema.validators.validator_for(raw)(raw)
    return [(f"field {'.'.join(map(str, e.absolute_path))!r}: " if e.absolute_path else "") + e.message
            for e in validator.iter_errors(dict(value))]


def parse_answer(text: str | None, schema: AnswerSchema, *, use_jsonschema: bool = True) -> ParsedAnswer:
    """The answer `text` as an object and its problems under `schema` (none: valid)."""
    s = (text or "").strip()
    m = _FENCE.match(s)
    s = m.group(1) if m else s
    try:
        value = json.loads(s)
    except json.JSONDecodeError as exc:
        return ParsedAnswer(None, (f"not JSON ({exc.msg} at column {exc.colno}): {s[:60]!r}",))
    if not isinstance(value, dict):
        return ParsedAnswer(None, (f"a JSON {type(value).__name__}, not an object with fields {schema.names}",))
    found = _jsonschema_problems(value, schema) if use_jsonschema else None
    return ParsedAnswer(value, tuple(subset_problems(value, schema) if found is None else found))


def canonical(value: Mapping[str, Any], schema: AnswerSchema) -> str:
    """The answer's text: the schema's fields in its order (then any others, sorted), compact JSON."""
    ordered = {**{n: value[n] for n in schema.names if n in value},
               **{k: value[k] for k in sorted(value) if k not in schema.names}}
    return json.dumps(ordered, ensure_ascii=False, separators=(",", ":"))


def fields_at_fault(value: Mapping[str, Any] | None, schema: AnswerSchema) -> list[str]:
    """The fields an answer gets wrong (missing, wrong type or value, not in a closed schema); every field when it is
    not an object."""
    if value is None:
        return schema.names
    bad = [f.name for f in schema.fields if (f.required and f.name not in value) or
           (f.name in value and not _type_ok(f, value[f.name]))]
    if schema.raw.get("additionalProperties") is False:
        bad += [k for k in value if k not in schema.names]
    return bad


@dataclass(frozen=True)
class Checked:
    """A label checked against the schema: its canonical text when valid, else why not and the fields at fault."""

    canonical: str | None
    problem: str | None = None
    fields: tuple[str, ...] = ()


def check_label(text: str | None, schema: AnswerSchema) -> Checked:
    """A label (a source's answer, an imported label) as its canonical text, or the reason it breaks the schema,
    naming the fields and the fix."""
    parsed = parse_answer(text, schema)
    if parsed.valid:
        return Checked(canonical(parsed.value or {}, schema))
    where = schema.path or "data.answer_schema"
    fields = fields_at_fault(parsed.value, schema)
    return Checked(None, f"answer {str(text)[:80]!r} breaks {where}: {'; '.join(parsed.problems)}; fix field(s) "
                         f"{fields} (an object with fields {schema.names}, each as the schema declares)", tuple(fields))


@dataclass(frozen=True)
class InvalidCount:
    n: int
    invalid: int
    examples: list[dict[str, Any]]  # {"index", "answer", "problems"} of the first EXAMPLES invalid answers

    def as_dict(self) -> dict[str, Any]:
        return {"n": self.n, "invalid": self.invalid, "valid_rate": round(1 - self.invalid / self.n, 6) if self.n
                else None, "examples": self.examples}


def count_invalid(answers: Sequence[str | None], schema: AnswerSchema) -> InvalidCount:
    """How many of `answers` are not valid under `schema`, with the first few and why."""
    examples, invalid = [], 0
    for i, a in enumerate(answers):
        parsed = parse_answer(a, schema)
        if not parsed.valid:
            invalid += 1
            if len(examples) < EXAMPLES:
                examples.append({"index": i, "answer": a, "problems": list(parsed.problems)})
    return InvalidCount(len(answers), invalid, examples)


# --- label files: one column per field ---

def label_columns(schema: AnswerSchema) -> list[str]:
    """A label file's answer columns: one per field, named as the field."""
    return schema.names


def _cell_value(f: FieldSpec, cell: str) -> Any:
    """A cell's text as the field's value; ValueError naming the field when it is not one."""
    if f.kind == "enum":
        for c in f.choices:
            if str(c) == cell:
                return c
        raise ValueError(f"column {f.name!r}: {cell!r} is not one of {list(f.choices)}")
    if f.kind == "number":
        try:
            v = float(cell)
        except ValueError:
            raise ValueError(f"column {f.name!r}: {cell!r} is not a number") from None
        if f.integer and not v.is_integer():
            raise ValueError(f"column {f.name!r}: {cell!r} is not an integer")
        return int(v) if f.integer or v.is_integer() and "." not in cell else v
    return cell


def answer_from_cells(cells: Mapping[str, str | None], schema: AnswerSchema) -> str:
    """The canonical answer a label file's row gives (one cell per field; an empty cell leaves an optional field
    out). ValueError naming the column, the cell and the fix when the row gives no valid answer."""
    value = {}
    for f in schema.fields:
        cell = (cells.get(f.name) or "").strip()
        if not cell:
            if f.required:
                raise ValueError(f"column {f.name!r} is empty but the schema requires the field; fill it in")
            continue
        value[f.name] = _cell_value(f, cell)
    return canonical(value, schema)


def cells_of(answer: str | None, schema: AnswerSchema) -> dict[str, str]:
    """One cell per field of an answer (empty for a field it lacks, every cell empty when it is not an object): what a
    label file or an export writes."""
    parsed = parse_answer(answer, schema, use_jsonschema=False)
    value = parsed.value or {}
    return {n: "" if value.get(n) is None else str(value[n]) for n in schema.names}
