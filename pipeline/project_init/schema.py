"""An answer schema proposed from answers that are JSON objects (`tamis init`, docs/structured.md).

When every labeled answer `tamis init` found is the text of a JSON object, the project's answers are structured:
init writes a JSON Schema beside the config (data.answer_schema) with one property per key seen:

- **enum** when the key's values are strings (or numbers) with few distinct values: at most ENUM_MAX, and each seen
  at least twice on average (a closed set repeats its values; a name seen once per row is free text);
- **number** / **integer** when every value is a number;
- **string** otherwise.

A key every answer holds is required. A value that is an object, a list or a boolean has no field kind tamis reads:
no schema is proposed, and init says why.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ENUM_MAX = 12  # distinct values of an enum field at most
SCHEMA_FILE = "answer.schema.json"


@dataclass(frozen=True)
class SchemaProposal:
    schema: dict[str, Any] | None  # None: the answers are not all JSON objects of enum / string / number fields
    why: str  # the sentence init prints
    longest: int = 0  # the longest answer's canonical JSON text, in characters (the generation budget reads it)


def _objects(counts: Mapping[str, int]) -> list[tuple[dict[str, Any], int]] | None:
    out = []
    for text, n in counts.items():
        try:
            value = json.loads(text)
        except (json.JSONDecodeError, TypeError):
            return None
        if not isinstance(value, dict) or not value:
            return None
        out.append((value, n))
    return out or None


def _property(values: Counter[Any], rows: int) -> dict[str, Any] | str:
    """The JSON Schema of one key from its values (value → rows), or why it has none."""
    kinds = {type(v) for v in values}
    if kinds & {tuple, bool, type(None)}:
        return "holds objects, lists, booleans or nulls"
    if kinds <= {int, float}:
        few = len(values) <= ENUM_MAX and rows >= 2 * len(values)
        if few and len(values) >= 2 and kinds == {int}:
            return {"enum": sorted(values)}
        return {"type": "integer" if kinds == {int} else "number"}
    if kinds == {str} and 2 <= len(values) <= ENUM_MAX and rows >= 2 * len(values):
        return {"enum": sorted(values)}
    return {"type": "string"}


def propose_schema(counts: Mapping[str, int]) -> SchemaProposal:
    """A schema for answers (answer text → labeled rows) that are all JSON objects (module docstring)."""
    objects = _objects(counts)
    if objects is None:
        return SchemaProposal(None, "")
    rows = sum(n for _, n in objects)
    seen: dict[str, Counter[Any]] = {}
    for value, n in objects:
        for k, v in value.items():
            # a nested value counted as a tuple (hashable), which no field kind takes
            seen.setdefault(k, Counter())[("nested", json.dumps(v)) if isinstance(v, (dict, list)) else v] += n
    props: dict[str, Any] = {}
    for key, values in seen.items():
        prop = _property(values, sum(values.values()))
        if isinstance(prop, str):
            return SchemaProposal(None, f"the answers are JSON objects, but field {key!r} {prop}: no schema "
                                  "proposed (docs/structured.md says what a field may be)")
        props[key] = prop
    required = [k for k in props if sum(seen[k].values()) == rows]
    schema = {"type": "object", "properties": props, "required": required}
    kinds = ", ".join(f"{k} ({'enum of ' + str(len(p['enum'])) if 'enum' in p else p['type']})"
                      for k, p in props.items())
    longest = max(len(json.dumps(v, ensure_ascii=False, separators=(",", ":"))) for v, _ in objects)
    return SchemaProposal(schema, f"structured answers: {rows} labeled answers are JSON objects with fields "
                          f"{kinds}", longest)
