"""The answer schema: a JSON Schema file for answers that are JSON objects of fields (docs/structured.md).

What tamis accepts, so each field has one metric, one Label Studio control and one uncertainty:

    {"type": "object",
     "properties": {"category": {"enum": ["shirt", "shoe", "bag"]},     # enum: a closed field
                    "color": {"type": "string"},                        # string: an open field
                    "price": {"type": "number"}},                       # number (or integer)
     "required": ["category", "color"]}

An enum's values are strings (or numbers: they are compared as written). `required` lists fields every answer must
hold (default: all of them). Anything else (nested objects, arrays, `$ref`, `oneOf`) is refused with the field that
holds it and the fix.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pipeline.errors import ConfigError

FieldKind = Literal["enum", "string", "number"]
IGNORED_KEYS = frozenset({"$schema", "$id", "title", "description", "additionalProperties", "examples", "default"})


@dataclass(frozen=True)
class FieldSpec:
    name: str
    kind: FieldKind
    choices: tuple[Any, ...] = ()  # an enum's values, in the schema's order
    integer: bool = False  # a number field declared "integer"
    required: bool = True

    @property
    def closed(self) -> bool:
        """Whether the field's answers come from a fixed set (enum): exact match, entropy over the set."""
        return self.kind == "enum"


@dataclass(frozen=True)
class AnswerSchema:
    fields: tuple[FieldSpec, ...]
    raw: dict[str, Any]  # the schema as written (jsonschema validates against it when installed)
    path: str = ""

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.fields]

    def field(self, name: str) -> FieldSpec:
        return next(f for f in self.fields if f.name == name)


def _field(name: str, spec: Any, where: str, required: bool) -> FieldSpec:
    if not isinstance(spec, dict):
        raise ConfigError(f"{where}: field {name!r} is {type(spec).__name__}, not an object; write e.g. "
                          '{"type": "string"} or {"enum": ["a", "b"]}')
    unknown = sorted(set(spec) - IGNORED_KEYS - {"type", "enum"})
    if unknown:
        raise ConfigError(f"{where}: field {name!r} uses {unknown}, which tamis does not read; a field is an enum "
                          '({"enum": [...]}), a string ({"type": "string"}) or a number ({"type": "number"}): '
                          "split nested values into fields of their own")
    kind = spec.get("type")
    if "enum" in spec:
        values = spec["enum"]
        if not isinstance(values, list) or len(values) < 2 or len(set(map(json.dumps, values))) != len(values):
            raise ConfigError(f"{where}: field {name!r}: enum must list at least 2 distinct values, got {values!r}")
        if not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in values):
            raise ConfigError(f"{where}: field {name!r}: enum values must be strings or numbers, got {values!r}")
        return FieldSpec(name, "enum", tuple(values), required=required)
    if kind == "string":
        return FieldSpec(name, "string", required=required)
    if kind in ("number", "integer"):
        return FieldSpec(name, "number", integer=kind == "integer", required=required)
    raise ConfigError(f"{where}: field {name!r} has type {kind!r}; tamis reads enum, string, number and integer "
                      "fields")


def schema_of(raw: Any, where: str = "data.answer_schema") -> AnswerSchema:
    """The AnswerSchema of a parsed JSON Schema, or a ConfigError naming the file, the field and the fix."""
    if not isinstance(raw, dict) or raw.get("type", "object") != "object" or not isinstance(raw.get("properties"),
                                                                                          dict):
        raise ConfigError(f"{where}: an answer schema is an object schema with `properties` (one per field), e.g. "
                          '{"type": "object", "properties": {"category": {"enum": ["a", "b"]}}}')
    props = raw["properties"]
    if not props:
        raise ConfigError(f"{where}: `properties` is empty; declare at least one field")
    required = raw.get("required", list(props))
    if not isinstance(required, list) or not set(required) <= set(props):
        raise ConfigError(f"{where}: `required` {required!r} must list fields of `properties` ({sorted(props)})")
    fields = tuple(_field(n, s, where, n in required) for n, s in props.items())
    return AnswerSchema(fields, raw, where)


def load_answer_schema(path: str | os.PathLike[str]) -> AnswerSchema:
    """Read and check `path` (module docstring); every refusal names the file and the fix."""
    p = Path(path)
    where = f"data.answer_schema ({p})"
    try:
        raw = json.loads(p.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise ConfigError(f"{where}: file not found; point data.answer_schema at a JSON Schema file (relative to "
                          "the config's folder)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot be read ({exc}); save it as UTF-8 JSON") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    return schema_of(raw, where)
