"""The evaluate stage: a model's answers on the test split and their metrics (pipeline/answer_metrics.py).

The metrics log and learning curve live in pipeline/metrics.py, the project status in pipeline/status.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.answer_metrics import row_scores
from pipeline.codeversion import stage_version
from pipeline.errors import DataError
from pipeline.stage_ref import StageRef


def predict_answers(loaded: Any, rows: Sequence[Mapping[str, Any]], answers: Sequence[str] | None, *,
                    batch_size: int = 16, max_new_tokens: int = 16) -> list[str]:
    """The model's answer per row: the most likely candidate for closed sets, greedy generation for open answers."""
    return predict_with_confidence(loaded, rows, answers, batch_size=batch_size, max_new_tokens=max_new_tokens)[0]


def predict_with_confidence(loaded: Any, rows: Sequence[Mapping[str, Any]], answers: Sequence[str] | None, *,
                            batch_size: int = 16, max_new_tokens: int = 16) -> tuple[list[str], list[float | None]]:
    """(answers, confidences): predict_answers and the model's confidence in each answer (its probability for
    closed sets, the geometric mean of its tokens' for open ones), which orders the round report's errors."""
    from pipeline.scoring import make_scorer, predictions

    scorer = make_scorer(loaded, answers, max_new_tokens=max_new_tokens)
    res = scorer.score(list(rows), batch_size=batch_size)
    preds, confidence = predictions(res, list(answers) if answers else None)
    return [p if p is not None else "" for p in preds], confidence


def evaluate_boxes(loaded: Any, rows: Sequence[Mapping[str, Any]], labels: Sequence[str], *, batch_size: int = 16,
                   max_new_tokens: int = 16) -> dict[str, Any]:
    """A box project's evaluate_model: the model's generated box text on labeled test rows, read back into each
    image's pixels by its family's codec and scored by mAP (pipeline/boxes/rows.py: map50, map, per-class AP),
    each box ranked by its answer's confidence."""
    from pipeline.boxes.rows import evaluate_box_rows
    from pipeline.model.box_frames import codec_and_frame

    if not rows:
        raise DataError("evaluation needs at least one test row with boxes (split: test); add the COCO or YOLO test "
                        "set to data.sources with `split: test`")
    texts, confidence = predict_with_confidence(loaded, rows, None, batch_size=batch_size,
                                                max_new_tokens=max_new_tokens)
    codec, frame = codec_and_frame(loaded.family, loaded.processor)
    return evaluate_box_rows(texts, rows, labels, codec, frame, confidence)


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


BOX_PER_CLASS_FILE = "box_per_class.json"  # per-class AP@0.5 and AP@[.5:.95] with their intervals (box_map)


def _write_box_evaluation(out: Path, result: dict[str, Any], inputs: dict[str, Any], config: dict[str, Any]) -> Any:
    """A box project's evaluation folder: predictions.jsonl (the model's text per test row), box_per_class.json,
    metrics.json (map50, map, their intervals, n, unreadable pieces dropped) and the manifest."""
    from pipeline.store import atomic_write_json, atomic_write_jsonl, write_manifest

    atomic_write_jsonl(out / "predictions.jsonl", result.pop("predictions"))
    atomic_write_json(out / BOX_PER_CLASS_FILE, result.pop("per_class"))
    atomic_write_json(out / "metrics.json", result)
    outputs = {"metrics": "metrics.json", "predictions": "predictions.jsonl", "box_per_class": BOX_PER_CLASS_FILE}
    return write_manifest(out, stage="evaluate", stage_version=EVAL_VERSION, inputs=inputs, config=config,
                          outputs=outputs, info=result)


def with_field_metrics(result: dict[str, Any], raw_schema: dict[str, Any]) -> dict[str, Any]:
    """Structured answers (data.answer_schema): per_class.json's `fields` (pipeline/fields/metrics.py) of an
    evaluate_model result, each field's score added to its metrics as `<field>.<metric>` (so metrics.jsonl, the
    curve and the summary carry them) with its interval, and the share of predictions valid under the schema."""
    from pipeline.fields.metrics import fields_report
    from pipeline.fields.schema import schema_of

    rows = result["predictions"]
    fields = fields_report([r["prediction"] for r in rows], [r["answer"] for r in rows], schema_of(raw_schema))
    for f in fields["fields"]:
        if f["score"] is not None:
            result["metrics"][f"{f['field']}.{f['metric']}"] = f["score"]
            result["intervals"][f"{f['field']}.{f['metric']}"] = f["score_ci95"]
        if f.get("normalized_match") is not None:
            result["metrics"][f"{f['field']}.normalized_match"] = f["normalized_match"]
    result["metrics"]["schema_valid_rate"] = fields["invalid"]["valid_rate"]
    return fields


@dataclass(frozen=True)
class EvalParams:
    """The evaluate stage's parameters, built by pipeline.round.params.evaluate_params; its cache key is their
    `key_fields()`."""

    artifacts: str
    test: dict[str, str]  # the labeled test split on disk, {dataset, digest} (pipeline.round.params.test_set)
    adapter: StageRef  # the train stage's output (its extra: adapter_dir, adapter_digest)
    model: dict[str, Any]  # the model section with its identity (pipeline.model.identity.keyed_model)
    answers: list[str] | None
    batch_size: int  # select.score_batch_size, the scoring batch
    out_dir: str
    box_labels: list[str] | None = None  # a box project's class list (data.task: boxes): mAP, not answer accuracy
    answer_schema: dict[str, Any] | None = None  # data.answer_schema as written: per-field metrics (per_class.json)


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
    inputs = {"test": test["digest"], "adapter": adapter.extra["adapter_digest"]}
    config = {"model": model, "answers": answers, **({"box_labels": params.box_labels} if params.box_labels else {}),
              **({"answer_schema": params.answer_schema} if params.answer_schema else {})}

    def compute() -> Any:
        rows = list(datasets.load_from_disk(test["dataset"]))
        model_cfg = ModelConfig.model_validate(model)
        loaded = load_model(model_cfg, adapter=adapter.extra["adapter_dir"])
        out = Path(out_dir)
        if params.box_labels is not None:
            return _write_box_evaluation(out, evaluate_boxes(loaded, rows, params.box_labels, batch_size=params.batch_size,
                                                             max_new_tokens=model_cfg.max_new_tokens), inputs, config)
        result = evaluate_model(loaded, rows, answers, batch_size=params.batch_size,
                                max_new_tokens=model_cfg.max_new_tokens)
        outputs = {"metrics": "metrics.json", "predictions": "predictions.jsonl"}
        if params.answer_schema is not None:
            atomic_write_json(out / PER_CLASS_FILE, with_field_metrics(result, params.answer_schema))
            outputs["per_class"] = PER_CLASS_FILE
        atomic_write_jsonl(out / "predictions.jsonl", result.pop("predictions"))
        report = result.pop("report")
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
