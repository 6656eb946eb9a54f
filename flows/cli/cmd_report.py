"""`tamis report`: (re)build a round's self-contained HTML report and optionally open it."""

from __future__ import annotations

from typing import Annotated

import typer

from flows.cli.common import ConfigOpt, config_file, load, out_console


def report_cmd(
    config: ConfigOpt = None,
    round_index: Annotated[int | None, typer.Option("--round", min=0, help="The finished round to report on "
                                                    "(default: the last one).")] = None,
    open_it: Annotated[bool, typer.Option("--open", help="Open the report in the default browser.")] = False,
) -> None:
    """Write artifacts/rounds/NNN/report.html: the batch as a contact sheet, the pool map, what the model gets wrong,
    the quality flags, the learning curve and the labels, in one file that opens offline."""
    config = config_file(config)
    from pipeline.roundreport import rebuild_report
    from pipeline.roundreport.sources import resolve_sources

    cfg = load(config)
    rep = rebuild_report(cfg.artifacts, round_index, resolve=lambda state, prep: resolve_sources(cfg, state, prep))
    out = out_console()
    out.print(f"report: {rep.html} ({rep.bytes / 1e3:,.0f} kB, built in {rep.seconds:.1f} s)", highlight=False)
    if open_it:
        import webbrowser

        if not webbrowser.open(rep.html.resolve().as_uri()):
            out.print("no browser found to open it here; copy the file to a machine that has one (it needs nothing "
                      "else)", highlight=False)


def register(app: typer.Typer) -> None:
    app.command("report")(report_cmd)
