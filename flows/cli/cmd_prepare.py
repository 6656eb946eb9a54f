"""`tamis prepare` and `tamis quality report`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.cli.common import ConfigOpt, config_file, load, out_console


def prepare_cmd(config: ConfigOpt = None) -> None:
    """Ingest, preprocess (resize, pad) and quality-flag the data; every stage is cached on its inputs."""
    config = config_file(config)
    from rich.table import Table

    from pipeline.data.ingest import source_digest
    from pipeline.unchanged import unchanged_prepare

    # Reading the sources first reports an unreadable source as a plain user error, before Prefect starts.
    cfg = load(config)
    digest = source_digest(cfg.data, cfg.artifacts)
    refs = unchanged_prepare(cfg.artifacts, digest, data=cfg.data, preprocess=cfg.preprocess, model=cfg.model,
                             quality=cfg.quality)
    unchanged = refs is not None
    if refs is None:
        from flows.prepare import prepare_flow

        refs = prepare_flow(str(config) if config else None, source_digest=digest)
    prep, qual = refs["prepare"], refs["quality"]
    table = Table(title="prepare")
    table.add_column("stage")
    table.add_column("result")
    table.add_column("folder", overflow="fold")
    counts = refs["ingest"].get("counts", {})
    table.add_row("ingest", f"{counts.get('ingested', '?')} rows, {counts.get('quarantined', '?')} quarantined",
                  refs["ingest"]["dir"])
    table.add_row("preprocess", f"{prep['info']['rows']} rows at {prep['info']['size']} px, "
                  f"{prep['info']['quarantined']} quarantined", prep["dir"])
    flags = ", ".join(f"{k} {v}" for k, v in qual["info"]["counts"].items())
    table.add_row("quality", f"{qual['info']['excluded']} excluded from the pool ({flags})", qual["dir"])
    out = out_console()
    out.print(table)
    from pipeline.quality import explain_flags

    for line in explain_flags(qual["info"], cfg.quality):
        out.print(f"quality: {line}", highlight=False, soft_wrap=True)
    if unchanged:
        out.print("nothing changed since the last prepare (sources, config sections, code): every stage's output is "
                  "reused as it is; no flow started", highlight=False)


def quality_report_cmd(
    config: ConfigOpt = None,
    top: Annotated[int, typer.Option("--top", min=1, help="Worst examples shown per flag.")] = 10,
) -> None:
    """Counts per quality flag and the worst examples' IDs and image paths (from the last `tamis prepare`)."""
    config = config_file(config)
    from rich.table import Table

    from pipeline.preprocess import latest_refs, load_prepared
    from pipeline.quality import quality_report
    from pipeline.store import read_manifest

    cfg = load(config)
    refs = latest_refs(cfg.artifacts)
    out = out_console()
    qdir = Path(refs["quality"]["dir"])
    if read_manifest(qdir, verify=False).config != cfg.section("quality"):
        out.print("[yellow]note:[/] the quality section changed since the last `tamis prepare`; this report "
                  "shows the old flags until you run it again", highlight=False)
    rep = quality_report(qdir, load_prepared(refs["prepare"]["dir"]), top=top)
    summary = Table(title=f"quality: {rep['rows']} samples, {rep['excluded']} excluded from the pool")
    summary.add_column("flag")
    summary.add_column("samples", justify="right")
    summary.add_column("keeps out of pool")
    for flag, n in rep["counts"].items():
        summary.add_row(flag, str(n), "yes" if flag in cfg.quality.exclude else "no")
    out.print(summary)
    for flag, rows in rep["worst"].items():
        if not rows:
            continue
        t = Table(title=f"worst {flag}")
        t.add_column("sample_id", no_wrap=True)
        t.add_column("image", overflow="fold")
        t.add_column("reason", overflow="fold")
        for r in rows:
            t.add_row(r["sample_id"], r["image_path"] or r["source"], r["reason"])
        out.print(t)
    from pipeline.quality import explain_flags

    for line in explain_flags(read_manifest(qdir, verify=False).info, cfg.quality):
        out.print(line, highlight=False, soft_wrap=True)
    out.print(f"table: {qdir / 'quality.jsonl'}", highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("prepare")(prepare_cmd)
    quality_app = typer.Typer(help="Quality flags of the prepared data.", no_args_is_help=True)
    quality_app.command("report")(quality_report_cmd)
    app.add_typer(quality_app, name="quality")
