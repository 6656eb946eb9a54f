"""`tamis init`: a commented project config written from the user's data, model and hardware.

detect.py finds the sources and the test answers, settings.py chooses what depends on the pool, the model and the
hardware, render.py writes the YAML (which `load_config` then validates before it is kept). `init_project` is the one
entry point; the CLI only prints what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, ModelError
from pipeline.project_init.detect import Found, detect_source, detect_test
from pipeline.project_init.render import render_config
from pipeline.project_init.settings import Settings, choose_settings, model_facts

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


def _answers(found: list[Found]) -> list[str] | None:
    """The closed answer set: every answer seen in class folders, answer columns and the test file; None (open
    answers) when there is none, or a single one (a closed set needs 2)."""
    seen = sorted({a for f in found for a in f.answers})
    return seen if len(seen) >= 2 else None


def init_project(path: Path, *, test: Path | None, model: str, out: Path, force: bool = False,
                 question: str | None = None, hw: Any = None, root: Path | None = None) -> InitResult:
    """Detect, decide, render and write `out` (refusing to replace an existing file without `force`)."""
    from pipeline.config import parse_config
    from pipeline.model.resolve import looks_local, resolve_model

    if out.exists() and not force:
        raise ConfigError(f"{out}: already exists; tamis init never overwrites a config: pass --force to replace it, "
                          "or --out another file")
    path = path.expanduser().resolve()
    found = [detect_source(path)]
    if test is not None:
        found.append(detect_test(test.expanduser().resolve(), path))
    try:
        resolved = resolve_model(model, build_tiny_if_missing=False)
        note = resolved.note
    except ModelError as exc:
        if looks_local(model):
            raise
        # A hub model this machine cannot reach yet: the config is still right; the round will say how to fix it.
        resolved, note = None, f"model: {model} is not reachable from here yet ({exc})"
    facts = model_facts(model, resolved)
    if hw is None:
        from pipeline.model.hardware import detect_hardware

        hw = detect_hardware()
    pool = sum(f.images - f.labeled for f in found if f.source.get("default_split") != "test")
    sizes = [s for f in found for s in f.sizes]
    settings = choose_settings(pool, sizes, facts, hw)
    answers = _answers(found)
    model_path = str(Path(model).expanduser().resolve()) if resolved is not None and resolved.where == "folder" \
        else model
    text = render_config(found, answers=answers, question=question or DEFAULT_QUESTION, model=model_path,
                         facts=facts, settings=settings, pool=pool,
                         artifacts=str(out.expanduser().resolve().parent / "artifacts"))
    import yaml

    parse_config(yaml.safe_load(text), origin=str(out), root=root)  # what `load_config` will accept, checked first
    out.parent.mkdir(parents=True, exist_ok=True)
    from pipeline.store import atomic_write_text

    atomic_write_text(out, text)
    return InitResult(out, text, found, settings, answers, note,
                      next_steps(out, out.expanduser().resolve().parent / "artifacts", answers, test is not None))


def next_steps(out: Path, artifacts: Path, answers: list[str] | None, has_test: bool) -> list[str]:
    steps = [f"tamis check-model -c {out}      # optional: what tamis will do with the model, before a round",
             f"tamis round -c {out}            # round 0: prepares the images, picks the first batch, exports it",
             f"label the batch in {artifacts / 'rounds' / '000' / 'export'} (Label Studio JSON, CSV or JSONL; "
             f"docs/annotation.md) and put the labeled file in {artifacts / 'inbox'}",
             f"tamis round -c {out}            # imports the labels, trains, evaluates, picks the next batch"]
    if not has_test:
        steps.append("add a labeled test set (tamis init … --test labels.csv) to measure each round")
    if answers is None:
        steps.append("no answer set found: open answers (free text); list data.answers to classify instead")
    return steps
