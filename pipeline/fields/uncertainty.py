"""Per-field uncertainty of structured answers and its combination into one sample score (pure functions).

- **Closed field (enum)**: the entropy of the model's probability over the field's values, divided by ln k (k values),
  so 0 is certain and 1 is uniform: `enum_uncertainty`. The probabilities are the model's, one per value of the
  enum (how a round gets them, scoring each value in the answer's context, is the scoring stage's part); without them,
  the shares of k sampled answers are a stand-in (`enum_shares`).
- **Open field (string, number)**: semantic entropy (Kuhn, Gal & Farquhar, ICLR 2023) of the field's values in k
  sampled answers, grouped by meaning as pipeline/meaning.py groups short answers, divided by ln k (every sample a
  different meaning): `open_uncertainty`. A sample whose answer is invalid or lacks the field counts as one more
  meaning ("no value"), so a model that cannot fill a field is uncertain about it.
- **One score per sample** (`combine`): the mean of the fields' normalised uncertainties (`how="mean"`, the
  default: each field counts the same, so a sample uncertain on every field ranks above one uncertain on one), or
  their maximum (`how="max"`: a sample is as uncertain as its most uncertain field). Both lie in [0, 1].
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

from pipeline.errors import SelectionError
from pipeline.fields.answers import parse_answer
from pipeline.fields.schema import AnswerSchema, FieldSpec

NO_VALUE = "\0no value"  # the meaning of a sampled answer that gives no value for the field


def enum_uncertainty(probs: np.ndarray) -> np.ndarray:
    """[n] normalised entropy of [n, k] probabilities over an enum's k values (rows are renormalised)."""
    p = np.asarray(probs, dtype=float)
    if p.ndim != 2 or p.shape[1] < 2 or (p < 0).any():
        raise SelectionError(f"enum_uncertainty: needs [n, k >= 2] non-negative probabilities over the enum's values, "
                             f"got shape {p.shape}")
    p = p / np.clip(p.sum(axis=1, keepdims=True), 1e-12, None)
    h = -(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)).sum(axis=1)
    return h / math.log(p.shape[1])


def field_values(samples: Sequence[Sequence[str | None]], schema: AnswerSchema, f: FieldSpec) -> list[list[str]]:
    """[n][k] the field's value in each sampled answer as text (NO_VALUE when the answer gives none)."""
    out = []
    for runs in samples:
        values = []
        for a in runs:
            v = (parse_answer(a, schema, use_jsonschema=False).value or {}).get(f.name)
            values.append(NO_VALUE if v is None else str(v))
        out.append(values)
    return out


def enum_shares(samples: Sequence[Sequence[str | None]], schema: AnswerSchema, f: FieldSpec) -> np.ndarray:
    """[n, k] the share of sampled answers giving each of the enum's k values (a stand-in for the model's
    probabilities); a row whose samples give none of them is uniform."""
    choices = [str(c) for c in f.choices]
    counts = np.array([[v.count(c) for c in choices] for v in field_values(samples, schema, f)], dtype=float)
    counts[counts.sum(axis=1) == 0] = 1.0
    return counts / counts.sum(axis=1, keepdims=True)


def open_uncertainty(samples: Sequence[Sequence[str | None]], schema: AnswerSchema, f: FieldSpec) -> np.ndarray:
    """[n] semantic entropy of the field's values over k sampled answers, divided by ln k (module docstring)."""
    from pipeline.meaning import meaning_key

    values = field_values(samples, schema, f)
    k = len(values[0]) if values else 0
    if k < 2 or any(len(v) != k for v in values):
        raise SelectionError(f"open_uncertainty: needs the same k >= 2 sampled answers per sample for field "
                             f"{f.name!r}, got {sorted({len(v) for v in values})}; set select.mc_dropout_passes >= 2")
    out = np.zeros(len(values))
    for i, runs in enumerate(values):
        groups: dict[str, int] = {}
        for v in runs:
            key = v if v == NO_VALUE else meaning_key(v)
            groups[key] = groups.get(key, 0) + 1
        share = np.array(list(groups.values()), dtype=float) / k
        out[i] = float(-(share * np.log(share)).sum()) / math.log(k)
    return out


def combine(per_field: Mapping[str, np.ndarray], how: Literal["mean", "max"] = "mean") -> np.ndarray:
    """[n] one score per sample from each field's [n] normalised uncertainty (module docstring)."""
    if not per_field:
        raise SelectionError("combine: no field uncertainties to combine; the answer schema declares no field")
    stacked = np.stack([np.asarray(v, dtype=float) for v in per_field.values()])
    return stacked.mean(axis=0) if how == "mean" else stacked.max(axis=0)
