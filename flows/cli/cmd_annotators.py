"""`tamis labels annotators`: each annotator's votes, agreement with the consensus and estimated accuracy."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from flows.cli.common import ConfigOpt, config_file, out_console


def labels_annotators(
    config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the record as JSON (confusion matrices included).")]
    = False,
) -> None:
    """The consensus of every raw vote as annotate.consensus derives it now (nothing is written), per annotator."""
    config = config_file(config)
    from pipeline.annotation.consensus import annotator_rows, derive_consensus
    from pipeline.annotation.redundancy import requeued_ids
    from pipeline.config import load_config
    from pipeline.round.plan import import_round

    cfg = load_config(config)
    art = cfg.artifacts
    record, changes = derive_consensus(art, cfg.annotate, answers=cfg.data.scored_answers, round_index=import_round(art),
                                       requeued=requeued_ids(art))
    out = out_console(markup=False, highlight=False)
    if record is None:
        if as_json:
            typer.echo(json.dumps({"method": cfg.annotate.consensus, "samples": 0, "annotators": {}}))
            return
        out.print(f"no votes yet in {art} (import labels first: `tamis labels import FILE` or a round's inbox)")
        return
    undecided = sum(d.label is None for d in record.samples.values())
    if as_json:
        d = record.to_dict()
        typer.echo(json.dumps({"method": d["method"], "model_rater": d["model_rater"], "samples": len(d["samples"]),
                               "undecided": undecided, "pending_ledger_changes": len(changes),
                               "annotators": d["annotators"]}, indent=2, sort_keys=True))
        return
    t = Table(title=f"annotators (consensus: {record.method}{', model as a rater' if record.model_rater else ''})")
    for col in ("annotator", "votes", "on shared samples", "agreement with consensus", "estimated accuracy"):
        t.add_column(col, justify="left" if col == "annotator" else "right")
    for r in annotator_rows(record):
        t.add_row(r["annotator"], str(r["votes"]), str(r["shared"]),
                  *("–" if x is None else f"{100 * x:.1f}%" for x in (r["agreement"], r["accuracy"])))
    out.print(t)
    out.print(f"{len(record.samples)} samples with votes, {undecided} undecided (ties)"
              + (f"; the next round's consensus changes {len(changes)} ledger labels" if changes else ""))
