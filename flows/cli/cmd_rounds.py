"""`tamis round`, `tamis demo`, `tamis status`: run labeling rounds and see where a project stands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from flows.cli.common import ConfigOpt, config_file, load, out_console
from flows.deploy import register_serve, server_url
from pipeline.config import ProjectConfig
from pipeline.errors import ConfigError, DataError
from pipeline.report import rejection_lines
from pipeline.round.simulate import simulated
from pipeline.round.stop import main_metric
from pipeline.round_state import LabelCheckRecord, RoundState


def _check_cell(check: LabelCheckRecord | None) -> str:
    """The label check's column: issues / checked, or that the model could not judge yet."""
    if not check:
        return "—"
    if check.get("abstained"):
        return f"can't judge yet ({check['checked']})"
    return f"{check['issues']} / {check['checked']}"


def _round_row(state: RoundState, metric: str) -> list[str]:
    main = (state.metrics or {}).get(metric)
    return [str(state.round), str(state.labeled), "—" if main is None else f"{main:.3f}", state.strategy,
            str(state.selected_count), _check_cell(state.labelcheck), str(state.relabel or 0), state.stopped or ""]


def _rounds_table(states: list[RoundState], metric: str) -> Any:
    """The rounds as a table; `metric`: the column's (pipeline.round.stop.main_metric)."""
    from rich.table import Table

    table = Table(title="labeling rounds")
    for col, just in (("round", "right"), ("labels", "right"), (metric.replace("_", " "), "right"), ("strategy", "left"),
                      ("selected", "right"), ("likely label errors", "right"), ("re-label", "right"),
                      ("stopped", "left")):
        table.add_column(col, justify=just)
    for s in states:
        table.add_row(*_round_row(s, metric))
    return table


def round_cmd(
    config: ConfigOpt = None,
    simulate: Annotated[bool | None, typer.Option("--simulate/--no-simulate", help="Let the simulated annotator "
                                                    "label the export (default: rounds.simulate_annotator).")] = None,
    full: Annotated[bool, typer.Option("--full", help="Run the flow even when nothing changed since the last "
                                       "round (it replays that round from the cache).")] = False,
) -> None:
    """Run the next labeling round (or finish / re-run the current one: finished work comes from the cache)."""
    config = config_file(config)
    from pipeline.model.resolve import resolve_configured
    from pipeline.unchanged import round_inputs, unchanged_round

    cfg = load(config)
    # Before anything heavy (and before Prefect starts): a model this machine cannot have fails here in seconds.
    out_console(stderr=True).print(resolve_configured(cfg.model).note, highlight=False, soft_wrap=True)
    last = None if full else unchanged_round(cfg.rounds, cfg.annotate, cfg.artifacts,
                                                  inputs=lambda: round_inputs(cfg), simulate=simulate)
    if last is not None:
        out = out_console()
        out.print(_rounds_table([last], main_metric(cfg.data.answers, cfg.data.task)))
        out.print(f"round {last.round}: nothing changed since it ran (config, code, data, labels, inbox, model), so "
                  "running it again would only replay it from the cache; no flow started. New labels go in "
                  f"{cfg.artifacts / 'inbox'} or through `tamis labels import`; `tamis round --full` replays it anyway.",
                  highlight=False)
        print_next_steps(out, cfg, last, config, simulate)
        return
    from flows.round import labeling_round

    state = RoundState.from_json(labeling_round(str(config) if config else None, simulate=simulate))
    out = out_console()
    out.print(_rounds_table([state], main_metric(cfg.data.answers, cfg.data.task)))
    if rejected := rejection_lines(state.imports):
        out.print("\n".join(rejected), highlight=False, soft_wrap=True, markup=False)
    print_next_steps(out, cfg, state, config, simulate)


def print_next_steps(out: Any, cfg: ProjectConfig, state: RoundState, config: Path | None, simulate: bool | None) -> None:
    from pipeline.annotation.export import CSV_FILE, JSONL_FILE, TASKS_FILE
    from pipeline.report import next_steps

    lines = next_steps(state, artifacts=cfg.artifacts, config=str(config) if config else "",
                       files={"tasks": TASKS_FILE, "csv": CSV_FILE, "jsonl": JSONL_FILE},
                       batch_size=cfg.select.batch_size, max_rounds=cfg.rounds.max_rounds,
                       simulated=simulated(cfg.rounds, simulate))
    if lines:
        out.print("\n".join(lines), highlight=False, soft_wrap=True)


def demo_cmd(
    config: ConfigOpt = None,
    rounds: Annotated[int | None, typer.Option("--rounds", min=1, help="Stop after this many rounds "
                                                 "(default: rounds.max_rounds).")] = None,
) -> None:
    """The demo: digits data + a tiny 4-bit model, several rounds with the simulated annotator, on the CPU (the
    built-in configs/demo.yaml unless -c names another)."""
    import time

    from pipeline.config import DEFAULT_CONFIG

    config = config_file(config) if config is not None else DEFAULT_CONFIG

    cfg = load(config)
    out = out_console()
    from pipeline.model.resolve import resolve_configured

    out.print(resolve_configured(cfg.model).note, highlight=False, soft_wrap=True)
    digits = cfg.data.sources[0].path.parent if cfg.data.sources else None
    if digits is not None and not cfg.data.sources[0].path.exists():
        from pipeline.data.demo import write_digits

        write_digits(digits)
        out.print(f"wrote the digits demo data to {digits}", highlight=False)
    from flows.round import labeling_round as flow

    states = []
    for _ in range(rounds or cfg.rounds.max_rounds):
        t0 = time.perf_counter()
        state = RoundState.from_json(flow(str(config) if config else None, simulate=True))
        state.extra["seconds"] = round(time.perf_counter() - t0, 1)
        states.append(state)
        out.print(_rounds_table(states, main_metric(cfg.data.answers, cfg.data.task)))
        if state.stopped:
            break
    out.print(f"learning curve: {cfg.artifacts / 'learning_curve.png'}", highlight=False)
    named = "demo" if config == DEFAULT_CONFIG else config  # the built-in config, as other commands ask for it
    out.print(f"round reports: {cfg.artifacts / 'rounds'}/NNN/report.html (`tamis report --open -c {named}` opens "
              "the last)",
              highlight=False)
    last_export = next((s.export_dir for s in reversed(states) if s.export_dir), None)
    if last_export:
        out.print(f"last export for annotators: {last_export}", highlight=False)


def status_summary_of(cfg: ProjectConfig) -> dict[str, Any]:
    """Everything `tamis status` reports, as plain data (`--json` prints it as is)."""
    from pipeline.chance import chance_check
    from pipeline.metrics import read_metrics
    from pipeline.round_state import completed_rounds
    from pipeline.status import annotation_time, status_summary

    states = completed_rounds(cfg.artifacts)
    chance = chance_check(read_metrics(cfg.artifacts), cfg.data.scored_answers, train=cfg.train, model=cfg.model)
    quarantined = 0
    for p in Path(cfg.artifacts).glob("*/*/quarantine.jsonl"):
        with open(p, encoding="utf-8") as f:
            quarantined += sum(1 for _ in f)
    return {**status_summary(cfg.artifacts), "quarantined_rows": quarantined,
            "annotation_time": annotation_time(cfg.artifacts, next_batch=cfg.select.batch_size),
            "pool_eligible": states[-1].pool if states else None,
            "at_chance": chance.warning, "chance_check": chance.reason,
            "rounds": [{k: getattr(s, k) for k in ("round", "labeled", "metrics", "strategy", "selected", "stopped",
                                                   "export_dir", "eval_dir")} for s in states]}


def _box_per_class_table(rows: list[dict[str, Any]], where: str) -> Any:
    """A box project's per-class AP (box_per_class.json) as a rich table; — where a class has no labeled box."""
    from rich.table import Table

    def num(v: float | None) -> str:
        return "—" if v is None else f"{v:.3f}"

    def ci(v: list[float] | None) -> str:
        return "—" if not v else f"{v[0]:.3f}–{v[1]:.3f}"

    table = Table(title=f"per-class AP ({where})")
    for col in ("class", "AP@0.5", "95% CI", "AP@[.5:.95]", "95% CI ", "labeled boxes"):
        table.add_column(col, justify="left" if col == "class" else "right")
    for r in rows:
        table.add_row(r["label"], num(r["ap50"]), ci(r["ap50_ci95"]), num(r["ap"]), ci(r["ap_ci95"]), str(r["support"]))
    return table


def per_class_output(states: list[RoundState]) -> tuple[Any, str]:
    """(a rich table, a line above it) of the latest evaluation's per-class (closed), per-group (open) or per-class
    AP (boxes) results."""
    from rich.table import Table

    from pipeline.perclass import load_eval_report
    from pipeline.report import per_class_markdown

    state = next((s for s in reversed(states) if s.eval_dir), None)
    ev = load_eval_report(state and state.eval_dir)
    if ev is None:
        return None, ("no per-class evaluation yet: the first round that trains an adapter writes one (rounds "
                      "evaluated by an older tamis have none; `tamis round --full` re-evaluates)")
    where = f"round {state.round}"
    if ev.per_box_class:
        return _box_per_class_table(ev.per_box_class, where), f"evaluation folder: {ev.dir}"
    if ev.per_class:
        pc = ev.per_class
        table = Table(title=f"per-class results ({where})")
        for col in ("answer", "precision", "recall", "F1", "support"):
            table.add_column(col, justify="left" if col == "answer" else "right")
        for r in pc["per_class"]:
            table.add_row(r["answer"], f"{r['precision']:.3f}", f"{r['recall']:.3f}", f"{r['f1']:.3f}",
                          str(r["support"]))
        return table, per_class_markdown(pc)[0].replace("**", "") + f"\nevaluation folder: {ev.dir}"
    if ev.fields:  # structured answers (data.answer_schema): one row per field
        table = Table(title=f"per-field results ({where})")
        for col in ("field", "kind", "metric", "score", "n"):
            table.add_column(col, justify="left" if col in ("field", "kind", "metric") else "right")
        for f in ev.fields["fields"]:
            table.add_row(f["field"], f["kind"], f["metric"], "—" if f["score"] is None else f"{f['score']:.3f}",
                          str(f["n"]))
        return table, f"{ev.fields['n']} test samples; evaluation folder: {ev.dir}"
    pg = ev.per_group
    table = Table(title=f"results by {pg['by'].replace('_', ' ')} ({where})")
    for col in ("group", "n", *pg["metrics"]):
        table.add_column(col, justify="left" if col == "group" else "right")
    for g in pg["groups"]:
        table.add_row(g["group"], str(g["n"]), *(f"{g[m]:.3f}" for m in pg["metrics"]))
    return table, f"{pg['n']} test samples; evaluation folder: {ev.dir}"


def status_cmd(
    config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print everything as one JSON object (for scripts).")] = False,
    per_class: Annotated[bool, typer.Option("--per-class", help="Also print the latest evaluation's per-class "
                                            "precision / recall / F1 / support (per group for open answers; AP per class "
                                            "for boxes).")] = False,
) -> None:
    """Rounds so far, labeled / pool / quarantined counts, last metrics."""
    config = config_file(config)
    import json

    from pipeline.report import merge_equal_metrics
    from pipeline.round_state import completed_rounds

    cfg = load(config)
    summary = status_summary_of(cfg)
    if as_json and per_class:
        from pipeline.perclass import load_eval_report

        state = next((s for s in reversed(completed_rounds(cfg.artifacts)) if s.eval_dir), None)
        ev = load_eval_report(state and state.eval_dir)
        summary["per_class"] = ev and (ev.per_class or ev.fields or ev.per_group or ev.per_box_class)
    if as_json:
        typer.echo(json.dumps(summary, default=str, indent=2))
        return
    out = out_console()
    states = completed_rounds(cfg.artifacts)
    if not states:
        out.print(f"no finished round yet in {cfg.artifacts}; start one with `tamis round`", highlight=False)
    else:
        out.print(_rounds_table(states, main_metric(cfg.data.answers, cfg.data.task)))
    metrics = ", ".join(f"{k} {v:.3f}" for k, v in merge_equal_metrics(summary["last_metrics"]).items())
    lines = [
        f"rounds finished: {summary['rounds_done']} (exported for annotation: {len(summary['rounds_exported'])})",
        f"labeled samples: {summary['labeled']} in the ledger ({summary['ledger_entries']} entries, "
        f"{summary['corrections']} corrections, {summary['carried']} carried over to re-saved images)"
        + "".join(f"\n  not counted: {p}" for p in summary["ledger_problems"]),
        f"labels matching no sample any more: {summary['orphan_labels'] or 0}"
        + (" (`tamis labels orphans` lists them)" if summary["orphan_labels"] else ""),
        f"pool eligible: {'—' if summary['pool_eligible'] is None else summary['pool_eligible']}, "
        f"quarantined rows: {summary['quarantined_rows']}",
        f"inbox files not imported yet: {len(summary['inbox_pending'])}"
        + "".join(f"\n  {p}" for p in summary["inbox_pending"]),
    ]
    if summary["rejected_rows"]:
        lines.append(f"{summary['rejected_rows']} rejected label rows, see {summary['rejections_dir']} (file:line and "
                     f"reason; {summary['rejected_unlabeled']} of their samples have no label: back among the "
                     "candidates of the next batch)")
    if summary["last_round_evaluated"] is not None:
        lines.append(f"last evaluated round {summary['last_round_evaluated']}: {metrics}")
    lines += time_lines(summary["annotation_time"])
    out.print("\n".join(lines), highlight=False)
    if summary["at_chance"]:
        out.print(f"[bold red]WARNING[/] {escape(summary['at_chance'])}", highlight=False)
    if per_class:
        table, line = per_class_output(states)
        out.print(line, highlight=False)
        if table is not None:
            out.print(table)


def time_lines(t: dict[str, Any] | None) -> list[str]:
    """Annotator time as `tamis status` prints it (nothing when no annotation carried a time)."""
    if not t:
        return []
    out = [f"annotator time: {t['hours']:.2f} h over {t['timed']} timed annotations (median {t['median_s']:.0f} s, "
           f"p90 {t['p90_s']:.0f} s per label)"]
    out += [f"  {who}: {a['n']} labels, median {a['median_s']:.0f} s, p90 {a['p90_s']:.0f} s"
            for who, a in t["annotators"].items()]
    if t.get("next_batch"):
        out.append(f"next batch of {t['next_batch']}: about {t['next_batch_hours']:.2f} h at the median")
    return out


def resume_cmd(
    config: ConfigOpt = None,
    labels: Annotated[Path | None, typer.Option("--labels", help="The annotators' export file (copied into the "
                                                 "inbox by the resumed run); default: the labels are in the inbox.")] = None,
    note: Annotated[str, typer.Option("--note", help="A note for the run's log.")] = "",
    run_id: Annotated[str | None, typer.Option("--run-id", help="The suspended run (default: the only one).")] = None,
) -> None:
    """Resume a round waiting for its annotators (rounds.wait_for_labels), as the Resume button in the Prefect UI."""
    config = config_file(config)
    load(config)
    if labels is not None and not labels.is_file():
        raise DataError(f"--labels {labels}: no such file; give the annotators' export (Label Studio JSON, or CSV / "
                        "JSONL with sample_id,label)")
    server_url_for("tamis resume")
    from prefect.flow_runs import resume_flow_run

    waiting = waiting_rounds()
    if run_id is not None:
        waiting = [r for r in waiting if str(r.id) == run_id]
    if len(waiting) != 1:
        listed = ", ".join(f"{r.name} ({r.id})" for r in waiting) or "none"
        raise ConfigError(f"{len(waiting)} labeling rounds are waiting for labels"
                          + (f" with --run-id {run_id}" if run_id else "") + f": {listed}; "
                          + ("give --run-id" if len(waiting) > 1 else "nothing to resume"))
    run = waiting[0]
    answer = {"labels_in_inbox": labels is None, "labels_file": str(labels.resolve()) if labels else "", "note": note}
    resume_flow_run(run.id, run_input=answer)
    out_console().print(f"resumed {run.name} ({run.id}); its worker imports the labels and runs the next round",
                        highlight=False)


def waiting_rounds() -> list[Any]:
    """The labeling rounds suspended (or paused) on the Prefect server, waiting for their labels."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter
    from prefect.client.schemas.filters import FlowRunFilterState as State
    from prefect.client.schemas.filters import FlowRunFilterStateType as StateTypes
    from prefect.client.schemas.objects import StateType

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["labeling-round"])),
            flow_run_filter=FlowRunFilter(state=State(type=StateTypes(any_=[StateType.PAUSED]))))


def server_url_for(command: str) -> str:
    try:
        return server_url()
    except ConfigError:
        raise ConfigError(f"PREFECT_API_URL is not set: `{command}` talks to the Prefect server the deployment runs "
                          "on; `export PREFECT_API_URL=http://127.0.0.1:4200/api` and retry") from None


def register(app: typer.Typer) -> None:
    register_serve(app)
    app.command("round")(round_cmd)
    app.command("demo")(demo_cmd)
    app.command("status")(status_cmd)
    app.command("resume")(resume_cmd)
