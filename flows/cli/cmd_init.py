"""`tamis init`: write a commented project config from a folder of images (or a manifest), a test file and a model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.cli.common import out_console


def init_cmd(
    path: Annotated[Path, typer.Argument(help="Your data: a folder of images (flat = unlabeled pool; one sub-folder "
                                         "per class = labeled), a CSV / JSONL manifest, a Label Studio JSON export "
                                         "or a saved HF dataset.")],
    test: Annotated[Path | None, typer.Option("--test", help="A labeled test file (CSV / JSONL: image, answer; e.g. "
                                               "labels.csv with file,category), paths relative to its folder.")] = None,
    model: Annotated[str, typer.Option("--model", "-m", help="A hub ID (e.g. HuggingFaceTB/SmolVLM-256M-Instruct) "
                                       "or a local model folder (e.g. one `tamis make-tiny-model` built).")]
    = "HuggingFaceTB/SmolVLM-256M-Instruct",
    out: Annotated[Path, typer.Option("--out", "-o", help="The config file to write.")] = Path("tamis.yaml"),
    question: Annotated[str | None, typer.Option("--question", "-q", help="The question asked of every image.")]
    = None,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
    open_: Annotated[bool, typer.Option("--open", help="Open answers (free text: captions, short answers): the model "
                                        "writes its answer, whatever answers the data holds.")] = False,
    closed: Annotated[bool, typer.Option("--closed", help="A closed answer set (classification) over the answers "
                                         "found, even where they look like free text.")] = False,
) -> None:
    """Write a project config from your data: sources and columns detected, the answer set, the model, and settings
    sized to the pool and this machine; then print the next steps."""
    from pipeline.errors import ConfigError
    from pipeline.project_init import init_project

    if open_ and closed:
        raise ConfigError("--open and --closed: give one of them (open answers: free text; closed: classification "
                          "over the answers found), or neither to let tamis init decide")
    res = init_project(path, test=test, model=model, out=out, force=force, question=question,
                       answer_mode="open" if open_ else "closed" if closed else "auto")
    o = out_console()
    for f in res.found:
        o.print(f"found: {f.what}", highlight=False, soft_wrap=True)
    o.print("answers: " + (f"{len(res.answers)} ({', '.join(res.answers[:12])}{', …' if len(res.answers) > 12 else ''})"
                           f"; {res.answers_why}" if res.answers else res.answers_why), highlight=False, soft_wrap=True)
    o.print(res.model_note, highlight=False, soft_wrap=True)
    for warning in res.warnings:
        o.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    o.print(f"hardware: {res.settings.hardware}; image size {res.settings.size.value} px "
            f"({res.settings.size.why})", highlight=False, soft_wrap=True)
    for note in res.settings.notes:
        o.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    o.print(f"wrote {res.config}\n\nnext steps:", highlight=False, soft_wrap=True)
    for i, step in enumerate(res.next_steps, 1):
        o.print(f"  {i}. {step}", highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("init")(init_cmd)
