"""Per-field evaluation of structured answers: the `fields` section of per_class.json (pipeline/perclass.py).

Each field is scored on the test rows whose reference holds it: exact match for enum and number fields (numbers
compared as numbers: 3 = 3.0), token F1 (SQuAD's, pipeline/evaluate.py) for string fields (with `normalized_match`: the share whose whole value
matches after normalisation), each with a 95 %
bootstrap interval of its mean. A prediction that is not a valid answer still scores on the fields it holds (a
field it lacks scores 0), and is counted under `invalid` with the first few and why. An enum field also gets the
per-class report of its values (precision / recall / F1, the confusion matrix), as a closed answer set does.

    {"fields": [{"field": "category", "kind": "enum", "metric": "exact_match", "score": 0.8, "score_ci95": [..],
                 "n": 20, "missing": 1, "per_class": {<per_class_report of the field's values>}},
                {"field": "color", "kind": "string", "metric": "token_f1", "score": 0.61, ...}],
     "invalid": {"n": 20, "invalid": 2, "valid_rate": 0.9, "examples": [...]},
     "n": 20}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.errors import DataError
from pipeline.fields.answers import count_invalid, parse_answer
from pipeline.fields.schema import AnswerSchema, FieldSpec

METRIC = {"enum": "exact_match", "number": "exact_match", "string": "token_f1"}


def field_score(f: FieldSpec, pred: Any, ref: Any) -> float:
    """One row's score on one field (module docstring); a missing prediction (None) scores 0."""
    if pred is None:
        return 0.0
    if f.kind == "string":
        from pipeline.answer_metrics import token_f1

        return token_f1([str(pred)], [str(ref)])
    if f.kind == "number":
        return float(not isinstance(pred, (bool, str)) and isinstance(pred, (int, float)) and float(pred) == float(ref))
    return float(pred == ref and isinstance(pred, str) == isinstance(ref, str) and not isinstance(pred, bool))


def _references(refs: Sequence[str], schema: AnswerSchema) -> list[dict[str, Any]]:
    out = []
    for i, r in enumerate(refs):
        parsed = parse_answer(r, schema)
        if not parsed.valid:
            where = schema.path or "the answer schema"
            raise DataError(f"test answer {i + 1} of {len(refs)} ({r!r}) is not valid under {where}: "
                            f"{'; '.join(parsed.problems)}; fix the label")
        out.append(parsed.value or {})
    return out


def _one_field(f: FieldSpec, preds: list[dict[str, Any]], refs: list[dict[str, Any]]) -> dict[str, Any]:
    from pipeline.perclass import mean_interval, per_class_report

    at = [i for i, r in enumerate(refs) if f.name in r]
    scores = [field_score(f, preds[i].get(f.name), refs[i][f.name]) for i in at]
    entry: dict[str, Any] = {"field": f.name, "kind": f.kind, "metric": METRIC[f.kind], "n": len(at),
                             "missing": sum(f.name not in preds[i] for i in at)}
    if not at:
        return {**entry, "score": None, "score_ci95": None}
    entry.update(score=round(sum(scores) / len(scores), 6), score_ci95=mean_interval(scores))
    if f.kind == "string":  # the whole value right, ignoring case, punctuation and articles (SQuAD's normalisation)
        from pipeline.meaning import normalize_answer

        same = [preds[i].get(f.name) is not None and normalize_answer(str(preds[i][f.name])) ==
                normalize_answer(str(refs[i][f.name])) for i in at]
        entry["normalized_match"] = round(sum(same) / len(same), 6)
    if f.kind == "enum":
        choices = [str(c) for c in f.choices]
        got = [None if preds[i].get(f.name) is None else str(preds[i][f.name]) for i in at]
        entry["per_class"] = per_class_report(got, [str(refs[i][f.name]) for i in at], choices)
    return entry


def fields_report(preds: Sequence[str | None], refs: Sequence[str], schema: AnswerSchema) -> dict[str, Any]:
    """per_class.json's `fields` section and the invalid-answer count (module docstring) for one prediction per
    test row; DataError when the counts differ or a reference is not a valid answer."""
    if len(preds) != len(refs) or not refs:
        raise DataError(f"per-field metrics need one prediction per test row: {len(preds)} predictions, "
                        f"{len(refs)} references")
    ref_values = _references(refs, schema)
    pred_values = [parse_answer(p, schema, use_jsonschema=False).value or {} for p in preds]
    return {"fields": [_one_field(f, pred_values, ref_values) for f in schema.fields],
            "invalid": count_invalid(preds, schema).as_dict(), "n": len(refs)}
