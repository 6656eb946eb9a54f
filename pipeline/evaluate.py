"""Per-round metrics: accuracy / exact match (closed answer sets), SQuAD-style exact match, token F1 and normalized
edit similarity (open answers), and the evaluation of a model on the test split.

The metrics log and learning curve live in pipeline/metrics.py, the project status in pipeline/status.py."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.codeversion import stage_version
from pipeline.errors import DataError
from pipeline.meaning import normalize_answer  # noqa: F401 (re-exported: the metrics' normalisation)


def _pairs(preds: Sequence[str | None], refs: Sequence[str]) -> None:
    if len(preds) != len(refs):
        raise DataError(f"{len(preds)} predictions for {len(refs)} references; score the whole test split")
    if not refs:
        raise DataError("no references to score against: the test split is empty")


def accuracy(preds: Sequence[str | None], refs: Sequence[str]) -> float:
    """Fraction of predictions equal to the reference after stripping whitespace (closed answer sets)."""
    _pairs(preds, refs)
    return sum((p or "").strip() == r.strip() for p, r in zip(preds, refs, strict=True)) / len(refs)


def exact_match(preds: Sequence[str | None], refs: Sequence[str]) -> float:
    _pairs(preds, refs)
    return sum(normalize_answer(p) == normalize_answer(r) for p, r in zip(preds, refs, strict=True)) / len(refs)


def _f1(pred: str | None, ref: str) -> float:
    p, r = normalize_answer(pred).split(), normalize_answer(ref).split()
    if not p or not r:
        return float(p == r)
    common = sum((Counter(p) & Counter(r)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(r)
    return 2 * precision * recall / (precision + recall)


def token_f1(preds: Sequence[str | None], refs: Sequence[str]) -> float:
    _pairs(preds, refs)
    return sum(_f1(p, r) for p, r in zip(preds, refs, strict=True)) / len(refs)


def _edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insert / delete / substitute, each 1); two rows of the table at a time."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def edit_similarity(preds: Sequence[str | None], refs: Sequence[str]) -> float:
    """Mean 1 − Levenshtein(pred, ref) / max(len) over characters of the normalised strings (ANLS without its
    threshold): partial credit for a near-miss spelling ("sevn" for "seven") that token F1 scores 0."""
    _pairs(preds, refs)
    total = 0.0
    for p, r in zip(preds, refs, strict=True):
        a, b = normalize_answer(p), normalize_answer(r)
        total += 1.0 if a == b else 1.0 - _edit_distance(a, b) / max(len(a), len(b))
    return total / len(refs)


def row_scores(preds: Sequence[str | None], refs: Sequence[str], *, closed: bool) -> dict[str, list[float]]:
    """Each metric's score per row (every metric here is the mean of these): accuracy + exact match for closed
    sets; exact match, token F1 and edit similarity for open ones (exact match first: it is the learning curve's
    default metric)."""
    _pairs(preds, refs)
    pairs = list(zip(preds, refs, strict=True))
    em = [float(normalize_answer(p) == normalize_answer(r)) for p, r in pairs]
    if closed:
        return {"accuracy": [float((p or "").strip() == r.strip()) for p, r in pairs], "exact_match": em}
    return {"exact_match": em, "token_f1": [_f1(p, r) for p, r in pairs],
            "edit_similarity": [edit_similarity([p], [r]) for p, r in pairs]}


def score_answers(preds: Sequence[str | None], refs: Sequence[str], *, closed: bool) -> dict[str, float]:
    """The metrics a round reports (row_scores' means)."""
    return {name: sum(v) / len(v) for name, v in row_scores(preds, refs, closed=closed).items()}


def predict_answers(loaded: Any, rows: Sequence[Mapping[str, Any]], answers: Sequence[str] | None, *,
                    batch_size: int = 16, max_new_tokens: int = 16) -> list[str]:
    """The model's answer per row: the most likely candidate for closed sets, greedy generation for open answers."""
    return predict_with_confidence(loaded, rows, answers, batch_size=batch_size, max_new_tokens=max_new_tokens)[0]


def predict_with_confidence(loaded: Any, rows: Sequence[Mapping[str, Any]], answers: Sequence[str] | None, *,
                            batch_size: int = 16, max_new_tokens: int = 16) -> tuple[list[str], list[float | None]]:
    """(answers, confidences): predict_answers and the model's confidence in each answer (its probability for
    closed sets, the geometric mean of its tokens' for open ones), which orders the round report's errors."""
    from pipeline.scoring import make_scorer
    from pipeline.selection import predictions

    scorer = make_scorer(loaded, answers, max_new_tokens=max_new_tokens)
    res = scorer.score(list(rows), batch_size=batch_size)
    preds, confidence = predictions(res, list(answers) if answers else None)
    return [p if p is not None else "" for p in preds], confidence


def evaluate_model(loaded: Any, rows: Sequence[Mapping[str, Any]], answers: Sequence[str] | None, *,
                   batch_size: int = 16, max_new_tokens: int = 16) -> dict[str, Any]:
    """Metrics of `loaded` on labeled rows (`prepared`, `question`, `answer`), each with its 95 % bootstrap interval
    (`intervals`), the per-row predictions, and the per-class (closed) or per-group (open) report."""
    from pipeline.perclass import mean_interval, per_class_report, per_group_report

    if not rows:
        raise DataError("evaluation needs at least one test row with an answer (split: test); add a labeled held-out "
                        "source with `split: test` to data.sources")
    preds, confidence = predict_with_confidence(loaded, rows, answers, batch_size=batch_size,
                                                max_new_tokens=max_new_tokens)
    refs = [r["answer"] for r in rows]
    scores = row_scores(preds, refs, closed=bool(answers))
    return {
        "metrics": {name: sum(v) / len(v) for name, v in scores.items()},
        "intervals": {name: mean_interval(v) for name, v in scores.items()},
        "n": len(rows),
        "predictions": [{"sample_id": r["sample_id"], "prediction": p, "answer": a, "confidence": c}
                        for r, p, a, c in zip(rows, preds, refs, confidence, strict=True)],
        "report": per_class_report(preds, refs, answers) if answers else per_group_report(rows, scores),
    }


EVAL_VERSION = stage_version("2", "pipeline.evaluate")  # 2: per-class report, intervals


@dataclass(frozen=True)
class EvalParams:
    """The evaluate stage's parameters, built by pipeline.round.params.evaluate_params; its cache key is their `asdict()`."""

    artifacts: str
    test: dict[str, Any]  # the labeled test split on disk (pipeline.round.params.test_set)
    adapter: dict[str, Any]  # the train stage's ref
    model: dict[str, Any]  # the model section with its identity (pipeline.model.identity.keyed_model)
    answers: list[str] | None
    batch_size: int  # select.score_batch_size, the scoring batch
    out_dir: str


def evaluate_stage(params: EvalParams) -> dict[str, Any]:
    """The evaluate stage: the round's adapter on the labeled test split, predictions and metrics into
    `params.out_dir`."""
    import datasets

    from pipeline.config import ModelConfig
    from pipeline.model.loading import load_model
    from pipeline.perclass import CONFUSION_FILE, PER_CLASS_FILE, PER_GROUP_FILE, plot_confusion
    from pipeline.store import (
        atomic_write_json,
        atomic_write_jsonl,
        reuse_or_compute,
        stage_key,
        write_manifest,
    )

    test, adapter, model, answers, out_dir = params.test, params.adapter, params.model, params.answers, params.out_dir
    inputs = {"test": test["digest"], "adapter": adapter["adapter_digest"]}
    config = {"model": model, "answers": answers}

    def compute() -> Any:
        rows = list(datasets.load_from_disk(test["dataset"]))
        model_cfg = ModelConfig.model_validate(model)
        result = evaluate_model(load_model(model_cfg, adapter=adapter["adapter_dir"]), rows, answers,
                                batch_size=params.batch_size, max_new_tokens=model_cfg.max_new_tokens)
        out = Path(out_dir)
        atomic_write_jsonl(out / "predictions.jsonl", result.pop("predictions"))
        report = result.pop("report")
        outputs = {"metrics": "metrics.json", "predictions": "predictions.jsonl"}
        if answers:
            atomic_write_json(out / PER_CLASS_FILE, report)
            plot_confusion(report, out / CONFUSION_FILE)
            outputs.update(per_class=PER_CLASS_FILE, confusion=CONFUSION_FILE)
        else:
            atomic_write_json(out / PER_GROUP_FILE, report)
            outputs["per_group"] = PER_GROUP_FILE
        atomic_write_json(out / "metrics.json", result)
        return write_manifest(out, stage="evaluate", stage_version=EVAL_VERSION, inputs=inputs, config=config,
                              outputs=outputs, info=result)

    m = reuse_or_compute(out_dir, stage_key("evaluate", EVAL_VERSION, inputs, config), compute)
    return {"dir": out_dir, "digest": m.key, **m.info}
