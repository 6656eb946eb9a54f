"""`tamis labels import|history|issues|orphans` and `tamis simulate-annotator`: the annotation round-trip from the command line."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from flows.cli.cmd_annotators import labels_annotators
from flows.cli.common import ConfigOpt, config_file, out_console

LOCK_NAME = "round.lock"


def labels_import(
    file: Annotated[Path, typer.Argument(help="Label Studio JSON / JSON_MIN export, CSV or JSONL: an answer column "
                                              "(`label`, or the one `tamis init` would read, e.g. `letter`) and a key "
                                              "column (sample_id, your own id, or the image path).")],
    config: ConfigOpt = None,
    round_index: Annotated[
        int | None, typer.Option("--round", help="Round the labels belong to (default: the next round, the first "
                                                 "that trains on them; the same as an inbox import).")
    ] = None,
    dataset: Annotated[
        Path | None, typer.Option(help="A saved dataset whose samples may be labeled (default: the project's last "
                                       "prepared dataset).")
    ] = None,
    strict: Annotated[bool, typer.Option(help="Reject the whole file if any row is rejected.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would land in the ledger; write nothing.")]
    = False,
) -> None:
    """Validate a label file and append its labels to the ledger (artifacts/labels.jsonl)."""
    config = config_file(config)
    from pipeline.annotation import Ledger, import_labels, ledger_path
    from pipeline.annotation.labels import LabelKeys, project_index
    from pipeline.config import load_config
    from pipeline.lock import ProjectLock
    from pipeline.round.plan import import_round

    out = out_console(markup=False, highlight=False)  # reasons hold [lists] rich would read as markup
    cfg = load_config(config)
    artifacts = cfg.artifacts
    index = project_index(artifacts, dataset)
    # The round flow imports the inbox under the same lock: two writers must not judge corrections concurrently.
    with ProjectLock(artifacts / LOCK_NAME, purpose="label import"):
        rep = import_labels(
            file,
            known_ids=index,
            answers=cfg.data.scored_answers,
            ledger=Ledger(ledger_path(artifacts)),
            round_index=import_round(artifacts) if round_index is None else round_index,
            rejections_dir=artifacts / "rejections",
            strict=strict,
            keys=LabelKeys.from_config(cfg.data),
            dry_run=dry_run,
            aliases=cfg.data.answer_aliases,
        )
    out.print(rep.summary())
    if dry_run:
        from pipeline.schema import display_name

        for e in rep.accepted[:50]:  # the user's file name first, the sample ID second
            key = f", by {e['matched_by']} {e['matched_key']!r}" if e.get("matched_key") else ""
            name = display_name(index.paths.get(e["sample_id"]), None, e["sample_id"])
            out.print(f"  would {'correct' if e['kind'] == 'correction' else 'label'} {name} = {e['label']!r} "
                      f"(sample {e['sample_id']}{key})")
        if len(rep.accepted) > 50:
            out.print(f"  … {len(rep.accepted) - 50} more")
    for r in rep.rejected[:20]:
        out.print(f"  rejected {r.where}: {r.reason}")
    if len(rep.rejected) > 20:
        out.print(f"  … {len(rep.rejected) - 20} more" + (f" in {rep.rejections_file}" if rep.rejections_file else ""))
    for c in rep.conflicts:
        out.print(f"  conflict {c.sample_id}: votes {c.votes} → {c.outcome} {c.label or ''}")


def labels_history(
    sample_id: Annotated[str, typer.Argument(help="The sample whose label history to show.")],
    config: ConfigOpt = None,
) -> None:
    """Every ledger entry of one sample, oldest first; the last one is its current label."""
    config = config_file(config)
    from pipeline.annotation import Ledger, ledger_path
    from pipeline.config import load_config

    out = out_console()
    hist = Ledger(ledger_path(load_config(config).artifacts)).history(sample_id)
    if not hist:
        out.print(f"{sample_id}: no labels in the ledger")
        raise typer.Exit(1)
    t = Table(title=f"label history of {sample_id}")
    for col in ("time", "kind", "label", "annotator", "round", "source file", "supersedes", ""):
        t.add_column(col)
    for i, e in enumerate(hist):
        t.add_row(
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.get("time", 0))),
            e["kind"],
            e["label"],
            e["annotator"],
            str(e["round"]),
            Path(e["source_file"]).name,
            f"{e['supersedes']} ({e.get('previous_label')})" if e.get("supersedes") else
            f"from {e['carried_from']}" if e.get("carried_from") else "",
            "current" if i == len(hist) - 1 else "",
        )
    out.print(t)


def labels_issues(
    config: ConfigOpt = None,
    round_index: Annotated[int | None, typer.Option("--round", help="Round to show (default: the latest).")] = None,
    top: Annotated[int, typer.Option(help="How many likely errors to list.")] = 20,
) -> None:
    """The likely label errors and annotator agreement found by a round's label check."""
    config = config_file(config)
    import json

    from pipeline.config import load_config
    from pipeline.errors import DataError
    from pipeline.labelcheck import VERDICT_FILE, false_alarm_text, verdict_headline, verdict_signals
    from pipeline.round_state import completed_rounds
    from pipeline.store import read_jsonl

    out = out_console()
    cfg = load_config(config)
    done = [s for s in completed_rounds(cfg.artifacts) if round_index is None or s.round == round_index]
    checked = [s for s in done if s.labelcheck]
    if not checked:
        which = "any round" if round_index is None else f"round {round_index}"
        raise DataError(f"{cfg.artifacts}: no label check in {which}; checks run after a round trains, unless "
                        "labelcheck.method is off (heldout needs a previous round's adapter)")
    state = checked[-1]
    check = state.labelcheck
    folder = Path(check["dir"])
    rows = read_jsonl(folder / "issues.jsonl")
    verdict_path = folder / VERDICT_FILE
    verdict = json.loads(verdict_path.read_text(encoding="utf-8")) if verdict_path.is_file() else {}
    if verdict.get("abstained"):
        out.print(f"round {state.round}: {verdict_headline(verdict, 0, check['checked'])}", highlight=False)
    else:
        t = Table(title=f"round {state.round}: {len(rows)} likely label errors among {check['checked']} labels "
                        f"checked ({check['method']})")
        for col in ("rank", "sample", "given", "suggested", "P(wrong)", "signals", "score", "annotators",
                    "source file"):
            t.add_column(col, no_wrap=col == "sample")  # an ID must stay copyable from the terminal
        for r in rows[:top]:
            t.add_row(str(r["rank"]), r["sample_id"], r["given_label"], r["suggested_label"],
                      f"{r.get('confidence', 1.0):.2f}", "+".join(r.get("signals", [])), f"{r['score']:.3f}",
                      ", ".join(r["annotators"]) or r["origin"], Path(r["source_file"]).name)
        out.print(t)
        if rows and "expected_false_alarms" in verdict:
            out.print(false_alarm_text(verdict["expected_false_alarms"]), highlight=False)
    for line in verdict_signals(verdict):
        out.print(line, highlight=False)
    agreement = json.loads((folder / "agreement.json").read_text(encoding="utf-8"))
    if agreement:
        a = Table(title="annotator agreement")
        for col in ("annotator", "shared votes", "agree with majority", "labels checked", "agree with model"):
            a.add_column(col)
        for who, v in agreement.items():
            a.add_row(who, str(v["n"]), "–" if v["agree_majority"] is None else f"{100 * v['agree_majority']:.0f}%",
                      str(v["n_model"]), "–" if v["agree_model"] is None else f"{100 * v['agree_model']:.0f}%")
        out.print(a)
    out.print(f"full table: {folder / 'issues.jsonl'}", highlight=False)
    if state.relabel_dir:
        out.print(f"sent back for re-labeling: {state.relabel_dir}", highlight=False)


def labels_orphans(
    config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the list as JSON (for scripts).")] = False,
) -> None:
    """Labels that match no sample of the dataset any more (their image was edited or cropped, or removed, or looks
    like several images; a re-save or a re-encode carries the label over at the next round): they stay in the
    ledger; relabel the new images or put the old ones back."""
    config = config_file(config)
    import json

    from pipeline.annotation.carry import orphan_labels
    from pipeline.config import load_config

    out = out_console(markup=False, highlight=False)
    cfg = load_config(config)
    rows = orphan_labels(cfg.artifacts)
    if as_json:
        typer.echo(json.dumps(rows or [], indent=2))
        return
    if rows is None:
        out.print(f"no dataset in {cfg.artifacts} yet: run `tamis ingest` (or a round) first")
        return
    if not rows:
        out.print("every label matches a sample of the dataset (re-saved images carried their labels over)")
        return
    t = Table(title=f"{len(rows)} labels matching no sample of the dataset")
    for col in ("sample", "label", "annotator", "round", "image it had", "source file"):
        t.add_column(col, no_wrap=col == "sample")
    for r in rows:
        t.add_row(r["sample_id"], r["label"], r["annotator"], str(r["round"]), r["image_path"] or "(unknown)",
                  Path(r["source_file"]).name)
    out.print(t)


def simulate(
    round_index: Annotated[int, typer.Option("--round", help="The exported round to answer.")],
    config: ConfigOpt = None,
    noise: Annotated[float, typer.Option(help="Fraction of answers to flip to a wrong answer.")] = 0.0,
    seed: Annotated[int | None, typer.Option(help="Seed for the flips (default: the config's seed).")] = None,
) -> None:
    """Answer an exported round from data.ground_truth; writes a Label Studio export into artifacts/inbox."""
    config = config_file(config)
    from pipeline.annotation import export_dir, simulate_annotator
    from pipeline.annotation.simulate import sidecar_path
    from pipeline.config import load_config
    from pipeline.errors import ConfigError

    out = out_console()
    cfg = load_config(config)
    if cfg.data.ground_truth is None:
        raise ConfigError("data.ground_truth is not set; the simulated annotator needs the held-back answers JSONL")
    path = simulate_annotator(
        export_dir(cfg.artifacts, round_index),
        cfg.data.ground_truth,
        cfg.artifacts / "inbox",
        round_index=round_index,
        noise=noise,
        seed=cfg.seed if seed is None else seed,
    )
    out.print(f"wrote {path} (flips recorded in {sidecar_path(path)})", highlight=False)


def register(app: typer.Typer) -> None:
    labels_app = typer.Typer(help="Import annotators' labels; inspect the label ledger.", no_args_is_help=True)
    labels_app.command("import")(labels_import)
    labels_app.command("history")(labels_history)
    labels_app.command("issues")(labels_issues)
    labels_app.command("annotators")(labels_annotators)
    labels_app.command("orphans")(labels_orphans)
    app.add_typer(labels_app, name="labels")
    app.command("simulate-annotator")(simulate)
