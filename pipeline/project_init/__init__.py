"""`tamis init`: a commented project config written from the user's data, model and hardware.

detect.py finds the sources and the test answers (tables.py reads a manifest and finds its image and answer
columns), settings.py chooses what depends on the pool, the model and the hardware, render.py writes the YAML (which
`load_config` then validates before it is kept). `init_project` is the one entry point; the CLI only prints what it
returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, ModelError, ModelUnreachable
from pipeline.project_init.answers import (
    AnswerChoice,
    AnswerMode,
    choose_answers,
    generation_budget,
    small_classes,
)
from pipeline.project_init.detect import detect_source, detect_test
from pipeline.project_init.found import Found
from pipeline.project_init.render import render_config
from pipeline.project_init.schema import SCHEMA_FILE, SchemaProposal, propose_schema
from pipeline.project_init.settings import ModelFacts, Settings, choose_settings, model_facts

DEFAULT_QUESTION = "What is shown in the image?"


@dataclass
class InitResult:
    config: Path
    text: str
    found: list[Found]
    settings: Settings
    answers: list[str] | None
    model_note: str
    next_steps: list[str]
    answers_why: str = ""
    warnings: list[str] = field(default_factory=list)
    model_problem: str = ""  # the model cannot be had from here yet: the config's first line, the first next step


def _resolve(model: str) -> tuple[Any, str, str]:
    """(the resolved model or None, the note init prints, the problem to fix first or "").

    A model the config names wrongly (a local folder that is not a model, a hub ID with no such model, a gated one)
    stops init with the fix: a config naming it would fail every round. A hub model this machine cannot reach now
    (offline, HF_HUB_OFFLINE, a proxy) still gets its config, because the rounds may well run on a machine that can
    (init on a laptop, rounds on the GPU box); the problem is then the config's first line and the first next step.
    """
    from pipeline.model.resolve import resolve_model

    try:
        resolved = resolve_model(model, build_tiny_if_missing=False)
    except ModelUnreachable as exc:
        return None, f"model: {model} is not reachable from here yet", str(exc)
    return resolved, resolved.note, ""


def _check_files(model: str, facts: ModelFacts) -> None:
    """A checkpoint that is here (a folder, an HF cache snapshot) but that a round could not load (a text-only model,
    a folder missing its processor or chat template) stops init with check-model's finding and fix."""
    if facts.resolved is None or not facts.resolved.path:
        return
    from pipeline.config import ModelConfig
    from pipeline.model.check import check_files

    report = check_files(ModelConfig(name_or_path=facts.resolved.path, family=facts.family))
    if not report.ok:
        row = report.failures[0]
        raise ModelError(f"--model {model}: a round could not load it ({row.check}: {row.found}); tamis init writes "
                         "no config naming a model a round cannot load: fix the checkpoint or pick another --model "
                         f"(`tamis check-model {model}` checks it end to end)")


def init_project(path: Path, *, test: Path | None, model: str, out: Path, force: bool = False,
                 question: str | None = None, hw: Any = None, root: Path | None = None,
                 answer_mode: AnswerMode = "auto") -> InitResult:
    """Detect, decide, render and write `out` (refusing to replace an existing file without `force`)."""
    from pipeline.config import parse_config

    if out.exists() and not force:
        raise ConfigError(f"{out}: already exists; tamis init never overwrites a config: pass --force to replace it, "
                          "or --out another file")
    path = path.expanduser().resolve()
    found = [detect_source(path)]
    if test is not None:
        found.append(detect_test(test.expanduser().resolve(), path))
    boxes = [c for f in found for c in f.box_classes]
    proposal = propose_schema({a: n for f in found for a, n in (f.counts or {}).items()}) if not boxes and \
        answer_mode == "auto" else SchemaProposal(None, "")
    box_file = "the COCO test file's categories" if any(f.source["kind"] == "coco" for f in found) else \
        "the YOLO folder's classes"
    choice = AnswerChoice(list(dict.fromkeys(boxes)), f"{box_file}: a box project (data.task: boxes, "
                          "docs/boxes.md)") if boxes else AnswerChoice(None, proposal.why) if proposal.schema \
        else choose_answers(found, answer_mode)
    resolved, note, problem = _resolve(model)
    facts = model_facts(model, resolved)
    _check_files(model, facts)
    if hw is None:
        from pipeline.model.hardware import detect_hardware

        hw = detect_hardware()
    pool = sum(f.images - f.labeled for f in found if f.source.get("default_split") != "test")
    settings = choose_settings(pool, [s for f in found for s in f.sizes], facts, hw)
    if choice.answers is None and choice.max_words:
        settings.max_new_tokens = generation_budget(choice.max_words)
    if proposal.schema:  # a JSON object's tokens: about one per 2 characters, 8 to spare
        settings.max_new_tokens = max(16, min(256, proposal.longest // 2 + 8))
    model_path = str(Path(model).expanduser().resolve()) if resolved is not None and resolved.where == "folder" \
        else model
    artifacts = out.expanduser().resolve().parent / "artifacts"
    default_question = f"Find every {', '.join(choice.answers or [])} in the image." if boxes else DEFAULT_QUESTION
    text = render_config(found, answers=choice.answers, question=question or default_question, model=model_path,
                         facts=facts, settings=settings, pool=pool, artifacts=str(artifacts),
                         answers_why=choice.why, boxes=bool(boxes),
                         schema_file=str(out.expanduser().resolve().parent / SCHEMA_FILE) if proposal.schema else None)
    if problem:
        text = f"# FIRST, before a round: {problem}\n" + text
    import yaml

    out.parent.mkdir(parents=True, exist_ok=True)
    from pipeline.store import atomic_write_json, atomic_write_text

    if proposal.schema:  # beside the config, as data.answer_schema names it (written before the config's check)
        atomic_write_json(out.expanduser().resolve().parent / SCHEMA_FILE, proposal.schema)

    parse_config(yaml.safe_load(text), origin=str(out), root=root)  # what `load_config` will accept
    atomic_write_text(out, text)
    has_test = any(f.test for f in found)
    steps = ([f"fix the model first: {problem}"] if problem else []) + next_steps(out, artifacts, choice.answers,
                                                                                  has_test, boxes=bool(boxes))
    return InitResult(out, text, found, settings, choice.answers, note, steps, choice.why,
                      small_classes(found, choice.answers), problem)


def next_steps(out: Path, artifacts: Path, answers: list[str] | None, has_test: bool, *,
               boxes: bool = False) -> list[str]:
    how = ("boxes: its label_config.xml in Label Studio, or the COCO / YOLO files beside it; export a Label Studio "
           "JSON or a COCO JSON that names the original files; docs/boxes.md" if boxes
           else "Label Studio JSON, CSV or JSONL; docs/annotation.md")
    steps = [f"tamis check-model -c {out}      # optional: what tamis will do with the model, before a round",
             f"tamis round -c {out}            # round 0: prepares the images, picks the first batch, exports it",
             f"label the batch in {artifacts / 'rounds' / '000' / 'export'} ({how}) and put the labeled file in "
             f"{artifacts / 'inbox'}",
             f"tamis round -c {out}            # imports the labels, trains, evaluates, picks the next batch"]
    if not has_test:
        steps.append("add a labeled test set (tamis init … --test labels.csv) to measure each round")
    if answers is None and not boxes:
        steps.append("open answers (free text): to classify instead, list data.answers (or rerun tamis init with "
                     "--closed)")
    return steps
