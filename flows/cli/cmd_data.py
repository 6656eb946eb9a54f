"""`tamis ingest` and `tamis demo-data`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.cli.common import ConfigOpt, config_file, load, out_console


def ingest_cmd(config: ConfigOpt = None) -> None:
    """Read every data source into a validated dataset; bad rows go to quarantine.jsonl with a reason."""
    config = config_file(config)
    from rich.table import Table

    from pipeline.data.ingest import source_digest
    from pipeline.unchanged import unchanged_ingest

    # Reading the sources first reports an unreadable source as a plain user error, before Prefect starts.
    cfg = load(config)
    digest = source_digest(cfg.data, cfg.artifacts)
    ref = unchanged_ingest(cfg.artifacts, cfg.data, digest)
    unchanged = ref is not None
    if ref is None:
        from flows.ingest import ingest_flow

        ref = ingest_flow(str(config) if config else None, digest)
    counts, folder = ref["counts"], Path(ref["dir"])
    table = Table(title="ingest")
    table.add_column("rows")
    table.add_column("count", justify="right")
    for name in ("read", "ingested", "quarantined", "duplicates"):
        table.add_row(name, str(counts[name]))
    out = out_console()
    out.print(table)
    out.print(f"dataset:    {folder / 'dataset'}", highlight=False, soft_wrap=True)
    out.print(f"quarantine: {folder / 'quarantine.jsonl'} ({counts['quarantined']} rows)", highlight=False, soft_wrap=True)
    out.print(f"duplicates: {folder / 'duplicates.jsonl'} ({counts['duplicates']} rows)", highlight=False, soft_wrap=True)
    if unchanged:
        out.print("nothing changed since the last ingest (sources, data section, code): its dataset is reused as it "
                  "is; no flow started", highlight=False)


def demo_data_cmd(
    out: Annotated[Path | None, typer.Option("--out", help="Folder to write images/, manifest.jsonl and "
                                             "ground_truth.jsonl into [default: artifacts/demo/digits, with --open "
                                             "artifacts/demo/digits-open].", show_default=False)] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="Only N images, balanced over the "
                                                 "digits (a tiny slice for tests).")] = None,
    open_answers: Annotated[bool, typer.Option("--open", help="Open answers: each image asked one of three "
                                               "questions answered in free text ('seven', 'odd', 'eight'), for "
                                               "configs/demo-open.yaml (data.answers: null).")] = False,
) -> None:
    """Write the demo dataset: scikit-learn's 1,797 handwritten digits as a visual question-answering task."""
    import json

    from pipeline.data.demo import write_digits

    out = out or Path("artifacts/demo/digits-open" if open_answers else "artifacts/demo/digits")
    folder = write_digits(out, limit=limit, open_answers=open_answers)
    rows = [json.loads(line) for line in (folder / "manifest.jsonl").read_text(encoding="utf-8").splitlines()]
    n_test = sum(r["split"] == "test" for r in rows)
    kind = "open-answer " if open_answers else ""
    typer.echo(f"wrote {len(rows)} {kind}digit images ({n_test} test with answers, {len(rows) - n_test} pool without) "
               f"to {folder}")
    typer.echo(f"manifest: {folder / 'manifest.jsonl'}\nground truth: {folder / 'ground_truth.jsonl'}")


def register(app: typer.Typer) -> None:
    app.command("ingest")(ingest_cmd)
    app.command("demo-data")(demo_data_cmd)
