"""`tamis round`, `tamis demo`, `tamis status`: run labeling rounds and see where a project stands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from flows.cli_common import ConfigOpt, load
from flows.deploy import register_serve


def _check_cell(check: dict[str, Any] | None) -> str:
    """The label check's column: issues / checked, or that the model could not judge yet."""
    if not check:
        return "—"
    if check.get("abstained"):
        return f"can't judge yet ({check['checked']})"
    return f"{check['issues']} / {check['checked']}"


def _round_row(state: dict[str, Any]) -> list[str]:
    metrics = state.get("metrics") or {}
    main = metrics.get("accuracy", metrics.get("token_f1"))
    check = state.get("labelcheck")
    return [str(state["round"]), str(state["labeled"]), "—" if main is None else f"{main:.3f}", state["strategy"],
            str(state.get("selected", 0)), _check_cell(check),
            str(state.get("relabel", 0)), state.get("stopped") or ""]


def _rounds_table(states: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title="labeling rounds")
    for col, just in (("round", "right"), ("labels", "right"), ("accuracy", "right"), ("strategy", "left"),
                      ("selected", "right"), ("likely label errors", "right"), ("re-label", "right"),
                      ("stopped", "left")):
        table.add_column(col, justify=just)
    for s in states:
        table.add_row(*_round_row(s))
    return table


def round_cmd(
    config: ConfigOpt = None,
    simulate: Annotated[bool | None, typer.Option("--simulate/--no-simulate", help="Let the simulated annotator "
                                                    "label the export (default: rounds.simulate_annotator).")] = None,
) -> None:
    """Run the next labeling round (or finish / re-run the current one: finished work comes from the cache)."""
    from rich.console import Console

    load(config)
    from flows.round import labeling_round

    state = labeling_round(str(config) if config else None, simulate=simulate)
    Console().print(_rounds_table([state]))


def demo_cmd(
    config: ConfigOpt = None,
    rounds: Annotated[int | None, typer.Option("--rounds", min=1, help="Stop after this many rounds "
                                                 "(default: rounds.max_rounds).")] = None,
) -> None:
    """The demo: digits data + a tiny 4-bit model, several rounds with the simulated annotator, on the CPU."""
    import time

    from rich.console import Console

    cfg = load(config)
    out = Console()
    digits = cfg.data.sources[0].path.parent if cfg.data.sources else None
    if digits is not None and not cfg.data.sources[0].path.exists():
        from pipeline.data.demo import write_digits

        write_digits(digits)
        out.print(f"wrote the digits demo data to {digits}", highlight=False)
    from flows.round import labeling_round as flow

    states = []
    for _ in range(rounds or cfg.rounds.max_rounds):
        t0 = time.perf_counter()
        state = flow(str(config) if config else None, simulate=True)
        state["seconds"] = round(time.perf_counter() - t0, 1)
        states.append(state)
        out.print(_rounds_table(states))
        if state.get("stopped"):
            break
    out.print(f"learning curve: {cfg.artifacts / 'learning_curve.png'}", highlight=False)
    last_export = next((s["export_dir"] for s in reversed(states) if s.get("export_dir")), None)
    if last_export:
        out.print(f"last export for annotators: {last_export}", highlight=False)


def status_cmd(config: ConfigOpt = None) -> None:
    """Rounds so far, labeled / pool / quarantined counts, last metrics."""
    import json

    from rich.console import Console

    from pipeline.evaluate import status_summary
    from pipeline.rounds import completed_rounds

    cfg = load(config)
    out = Console()
    states = completed_rounds(cfg.artifacts)
    if not states:
        out.print(f"no finished round yet in {cfg.artifacts}; start one with `tamis round`", highlight=False)
    else:
        out.print(_rounds_table(states))
    quarantined = sum(
        sum(1 for _ in open(p, encoding="utf-8")) for p in Path(cfg.artifacts).glob("*/*/quarantine.jsonl")
    )
    summary = {**status_summary(cfg.artifacts), "quarantined_rows": quarantined,
               "pool_eligible": states[-1]["pool"] if states else None}
    out.print_json(json.dumps(summary, default=str))


def register(app: typer.Typer) -> None:
    register_serve(app)
    app.command("round")(round_cmd)
    app.command("demo")(demo_cmd)
    app.command("status")(status_cmd)
