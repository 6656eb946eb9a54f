"""What a round tells the people watching it: run names, the summary markdown (with the learning curve inline), the
annotator hand-off, and progress figures. Plain text building, so the Prefect flow only decides where it goes."""

from __future__ import annotations

import base64
import contextlib
import os
import shlex
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.boxes.batch import NAMES_FILE as BOX_NAMES_FILE
from pipeline.mdtext import escape_md
from pipeline.round_state import RoundState

# The stages of a round in the order the flow runs them, with their rough share of a round's time on a CPU (training
# dominates), so the round's progress bar moves like the clock, not like a stage counter.
ROUND_STAGES: tuple[tuple[str, float], ...] = (
    ("ingest", 2), ("prepare", 3), ("import labels", 1), ("train", 70), ("evaluate", 8), ("label check", 2),
    ("score pool", 10), ("select", 2), ("export", 2),
)


def run_name(round_index: int | None, *, rerun: bool = False, suffix: str = "") -> str:
    """`round-003`, `round-003-rerun` (same labeled set as the finished round 3), `round-003-score-pool`;
    `round-next` before the round is known."""
    base = "round-next" if round_index is None else f"round-{round_index:03d}"
    return base + ("-rerun" if rerun else "") + (f"-{suffix}" if suffix else "")


# Tags that describe the run's current round only: renaming the run for its next round drops them.
ROUND_FLAGS = ("rerun", "stopped", "waiting-for-labels")


def run_tags(round_index: int, *, rerun: bool = False, stopped: str | None = None,
             waiting: bool = False) -> list[str]:
    """Tags the runs list shows beside the name (filterable): the round, re-run, stopped, waiting for labels."""
    tags = ["tamis", f"round-{round_index:03d}"]
    tags += ["rerun"] * rerun + ["stopped"] * bool(stopped) + ["waiting-for-labels"] * waiting
    return tags


def state_message(s: RoundState) -> str:
    """One line for the run's final state: what the round did, or why no batch was selected."""
    done = f"round {s.round}: {s.labeled} labels"
    if s.metrics:
        done += ", " + ", ".join(f"{k} {v:.3f}" for k, v in merge_equal_metrics(s.metrics).items())
    if s.stopped:
        return f"{done}; stopped: {s.stopped}"
    return f"{done}; {s.selected_count} samples exported for annotation"


def png_data_uri(path: str | os.PathLike[str]) -> str:
    """The PNG inline: the Prefect UI (both versions) renders `![](data:image/png;base64,…)` in markdown artifacts and
    an image artifact's URL, and a local server has no other way to show a file from the project."""
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def import_record(previous: RoundState | None, imports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The imports that brought a round's labels: a re-run of the round (whose files are all already imported) keeps
    the record of the run that imported them (`previous`, that round's finished state), and adds only what it
    imported or refused itself."""
    kept = [i for i in (previous.imports if previous else []) if not i.get("already_imported")]
    return kept + [i for i in imports if not i.get("already_imported") and i not in kept]


REJECTIONS_SHOWN = 5  # rejected label rows a round's output names; the rest are in the file it points to


def rejection_lines(imports: Sequence[Mapping[str, Any]], limit: int = REJECTIONS_SHOWN) -> list[str]:
    """What a round prints about its imports' rejected rows: the first `limit` of each file with file:line and the
    reason, where the full list is, and that their samples go back to the pool."""
    lines = []
    for imp in imports:
        n, shown = imp.get("rejected") or 0, imp.get("rejections") or []
        if not n:
            continue
        lines.append(f"{n} label rows rejected in {imp['file']} (their samples return to the candidates of the next "
                     f"batch; fix the rows and drop the file into the inbox again):")
        lines += [f"  {r['where']}: {r['reason']}" for r in shown[:limit]]
        more = f"… and {n - min(limit, len(shown))} more; " if n > min(limit, len(shown)) else ""
        if imp.get("rejections_file"):
            lines.append(f"  {more}full list: {imp['rejections_file']}")
    return lines


def curve_table(metrics_rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The learning-curve history as markdown rows, one per round; metrics with the same value share a column
    (accuracy = exact_match on a closed answer set), and a re-evaluated round shows its newest values."""
    by_round: dict[int, dict[str, Any]] = {}
    for r in metrics_rows:
        row = by_round.setdefault(int(r["round"]), {"labels": r["labels"], "metrics": {}})
        row["labels"] = r["labels"]
        row["metrics"][r["metric"]] = float(r["value"])
    if not by_round:
        return []
    merged = {k: merge_equal_metrics(v["metrics"]) for k, v in by_round.items()}
    names = list(dict.fromkeys(name for m in merged.values() for name in m))
    lines = ["| round | labels | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for k in sorted(by_round):
        cells = [f"{merged[k][n]:.4f}" if n in merged[k] else "—" for n in names]
        lines.append(f"| {k} | {by_round[k]['labels']} | " + " | ".join(cells) + " |")
    return lines


def candidates_line(c: Mapping[str, Any], *, reason: bool = True) -> str:
    """What a round scored: "scored N candidates of M eligible (...)" when restricted, "scored all M eligible" when
    select.candidates: auto chose not to; then why (the reason auto gave), unless `reason` is False (the round
    report's batch cards, whose page says it once)."""
    why = f" — {c['reason']}" if reason and c.get("reason") else ""
    if c.get("method") == "all":
        return f"scored all {c['eligible']} eligible samples (select.candidates){why}"
    parts = ", ".join(f"{n} {name}" for name, n in c["sources"].items())
    extra = c["scored"] - c["candidates"]
    return (f"scored {c['candidates']} candidates of {c['eligible']} eligible ({parts}; select.candidates)"
            + (f" and the {extra} labeled samples" if extra else "") + why)


def annotators_markdown(rec: Mapping[str, Any]) -> str:
    """The round summary's section from pipeline.annotation.consensus.round_record(), a plain dict: each annotator's
    votes, agreement with the consensus and (Dawid–Skene) estimated accuracy. It lives here, not beside the
    consensus, because this module is in the training stage's code closure and must not pull the consensus (and,
    through it, scoring) into it."""
    def pct(x: float | None) -> str:
        return "–" if x is None else f"{x:.1%}"

    lines = [f"### Annotators (consensus: {rec['method']}{', model as a rater' if rec['model_rater'] else ''})", "",
             "| annotator | votes | on shared samples | agreement with consensus | estimated accuracy |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {escape_md(r['annotator'])} | {r['votes']} | {r['shared']} | {pct(r['agreement'])} | {pct(r['accuracy'])} |"
              for r in rec["annotators"]]
    lines += ["", f"{rec['samples']} samples with votes, {rec['undecided']} undecided (ties), mean consensus "
                  f"confidence {rec['mean_confidence']:.3f}."]
    return "\n".join(lines)


PER_CLASS_ROWS = 30  # a larger answer set shows its lowest-F1 answers in the summary; per_class.json has them all


def per_class_markdown(pc: Mapping[str, Any], *, limit: int = PER_CLASS_ROWS) -> list[str]:
    """The per-class table of an evaluation (pipeline.perclass's per_class.json): precision, recall, F1, support
    per answer, with accuracy and macro-F1 and their bootstrap intervals above it."""
    rows = list(pc["per_class"])
    lines = [f"Accuracy **{pc['accuracy']:.3f}** (95% CI {pc['accuracy_ci95'][0]:.3f}–{pc['accuracy_ci95'][1]:.3f}), "
             f"macro-F1 **{pc['macro_f1']:.3f}** (95% CI {pc['macro_f1_ci95'][0]:.3f}–{pc['macro_f1_ci95'][1]:.3f}) on "
             f"{pc['n']} test samples ({pc['bootstrap']['resamples']} bootstrap resamples).", ""]
    if len(rows) > limit:
        rows = sorted(rows, key=lambda r: (r["f1"], -r["support"]))[:limit]
        lines += [f"The {limit} answers with the lowest F1 of {len(pc['per_class'])} (all in per_class.json):", ""]
    lines += ["| answer | precision | recall | F1 | support |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {escape_md(r['answer'])} | {r['precision']:.3f} | {r['recall']:.3f} | {r['f1']:.3f} | {r['support']} |"
              for r in rows]
    if pc["confusion_columns"][-1] not in pc["answers"]:
        other = sum(row[-1] for row in pc["confusion"])
        lines += ["", f"{other} predictions fell outside the answer set (column {escape_md(pc['confusion_columns'][-1])})."]
    return lines


def _ci(interval: Sequence[float] | None) -> str:
    return f"{interval[0]:.3f}–{interval[1]:.3f}" if interval else "—"


def box_per_class_markdown(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """A box project's per-class AP (box_per_class.json, pipeline.boxes.evaluation.box_map's rows): AP@0.5 and
    AP@[.5:.95] with their 95 % bootstrap intervals and the labeled-box count; a class without labeled test boxes
    has no AP (—), as in COCO."""
    def ap(v: float | None) -> str:
        return "—" if v is None else f"{v:.3f}"

    lines = ["| class | AP@0.5 | 95% CI | AP@[.5:.95] | 95% CI | labeled boxes |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {escape_md(r['label'])} | {ap(r['ap50'])} | {_ci(r['ap50_ci95'])} | {ap(r['ap'])} | "
              f"{_ci(r['ap_ci95'])} | {r['support']} |" for r in rows]
    return lines


def per_group_markdown(pg: Mapping[str, Any]) -> list[str]:
    """Open answers: each metric per question or per answer-length bucket (pipeline.perclass's per_group.json)."""
    names = list(pg["metrics"])
    lines = [f"| {pg['by'].replace('_', ' ')} | n | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    lines += [f"| {escape_md(g['group'])} | {g['n']} | " + " | ".join(f"{g[m]:.3f}" for m in names) + " |" for g in pg["groups"]]
    return lines


def evaluation_markdown(evaluation: Any, confusion_uri: str | None = None) -> list[str]:
    """The summary's section from an evaluation folder's report (pipeline.perclass.EvalReport)."""
    if evaluation is None:
        return []
    lines = ["", "## Results by group" if evaluation.per_group else "## Per-class results", ""]
    if evaluation.per_box_class:
        lines += box_per_class_markdown(evaluation.per_box_class)
    if evaluation.per_class:
        lines += per_class_markdown(evaluation.per_class)
        if confusion_uri:
            lines += ["", f"![confusion matrix]({confusion_uri})"]
        if evaluation.confusion_png:
            lines += ["", f"Confusion matrix PNG: `{evaluation.confusion_png}`"]
    if evaluation.fields:
        lines += ["", "### Per field", ""] + fields_markdown(evaluation.fields)
    if evaluation.per_group:
        lines += per_group_markdown(evaluation.per_group)
    return lines


def fields_markdown(fields: Mapping[str, Any]) -> list[str]:
    """per_class.json's `fields` of structured answers as a table: each field's metric, score and interval."""
    lines = ["| field | kind | metric | score | 95% CI | n |", "|---|---|---|---:|---|---:|"]
    for f in fields["fields"]:
        score, ci = f.get("score"), f.get("score_ci95")
        lines.append(f"| {escape_md(f['field'])} | {f['kind']} | {f['metric']} | "
                     f"{'—' if score is None else f'{score:.3f}'} | {'' if not ci else f'{ci[0]:.3f}–{ci[1]:.3f}'} | "
                     f"{f['n']} |")
    inv = fields.get("invalid") or {}
    if inv.get("invalid"):
        lines += ["", f"{inv['invalid']} of {inv['n']} predictions break the answer schema (examples in per_class.json)"]
    return lines


def _stability_line(st: Mapping[str, Any]) -> str:
    """The stop set's line: its agreement with the previous adapter (κ and the F-score bound when measured)."""
    if "agreement" not in st:
        return f"- stop set ({st['n']} pool samples): first predictions recorded; {st['forecast']}"
    kappa = ""
    if "kappa" in st:
        kappa = (f" (κ; F-score change ≤ {st['f_change_bound']:.3f})" if st.get("f_change_bound") is not None
                 else " (κ; no F-score bound at κ ≤ 0)")
    return (f"- stop set ({st['n']} pool samples): agreement with the previous adapter {st['agreement']:.4f}{kappa}; "
            f"{st['forecast']}")


def time_text(t: Mapping[str, Any] | None) -> str:
    """round.json's annotation_time in words ("" without one), for summary.md and the round's report."""
    if not t:
        return ""
    return (f"{t['hours']:.2f} h over {t['timed']} timed labels (median {t['median_s']:.0f} s, p90 {t['p90_s']:.0f} s)"
            + (f"; next batch of {t['next_batch']} ≈ {t['next_batch_hours']:.2f} h" if t.get("next_batch") else ""))


def merge_equal_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """Metrics with the same value under one joined name, in first-seen order: on a closed answer set accuracy and
    exact match are usually the same number, shown once as `accuracy = exact_match`."""
    groups: dict[float, list[str]] = {}
    for name, value in metrics.items():
        groups.setdefault(float(value), []).append(name)
    return {" = ".join(names): value for value, names in groups.items()}


def metrics_text(metrics: Mapping[str, float] | None) -> str:
    """The round's test metrics, equal ones merged ("accuracy = exact_match = 0.8000"), for summary.md and the report."""
    return ", ".join(f"{k} = {v:.4f}" for k, v in merge_equal_metrics(metrics or {}).items())


def _cost_line(c: Mapping[str, Any]) -> str:
    """select.cost: the predicted cost model (pipeline/strategies/cost.py) and its forecast for the batch."""
    fit = (f"CV R² {c['cv_r2']:.3f}, MAE {c['cv_mae_s']:.1f} s (median guess {c['median_mae_s']:.1f} s); "
           if "cv_r2" in c else "")
    ranking = "ranked by gain per predicted second" if c["status"] == "predicted" else f"cost-blind ranking: {c['reason']}"
    return (f"- cost model ({c['n']} timed labels): {fit}{ranking}; forecast for this batch of {c['next_batch']}: "
            f"{c['next_batch_hours']:.2f} h")


def _counts_lines(s: RoundState) -> list[str]:
    """The summary's list: counts, strategy, phase, flags, metrics, why it stopped, time, cost, imports."""
    lines = [f"- labeled samples: **{s.labeled}** (labels spent, re-labels included: "
             f"{s.labeled if s.labels_spent is None else s.labels_spent})",
             f"- pool (eligible): {s.pool}", f"- selected: {s.selected_count}", f"- strategy: {s.strategy}"]
    if s.candidates:
        lines.append(f"- {candidates_line(s.candidates)}")
    if s.phase:
        lines.append(f"- selection phase: **{s.phase['phase']}** — {s.phase['reason']}")
    if s.quality_flags:
        lines += ["- quality flags (pipeline.quality.explain_flags):"] + [f"  - {x}" for x in s.quality_flags]
    if s.embeddings and s.embeddings != "model":
        lines.append(f"- selection space: `{s.embeddings}` embeddings (select.embeddings)")
    if s.metrics:
        lines.append("- test metrics: " + metrics_text(s.metrics))
    if s.stopped:
        lines.append(f"- **stopped**: {s.stopped}")
    if s.stability:
        lines.append(_stability_line(s.stability))
    if s.annotation_time:
        lines.append("- annotator time so far: " + time_text(s.annotation_time))
    if s.cost:
        lines.append(_cost_line(s.cost))
    for imp in s.imports:
        lines.append(f"- inbox: {escape_md(imp.get('summary') or 'REJECTED ' + imp['file'] + ': ' + imp['error'])}")
        lines += [f"  - {escape_md(x.strip())}" for x in rejection_lines([imp])]  # the first rejected rows, the rest
    return lines


def _handoff_lines(s: RoundState) -> list[str]:
    """Where the batch, its Label Studio push, the re-label queue and the pool's outliers are."""
    lines = []
    if s.export_dir:
        lines += ["", f"Export for annotators: `{s.export_dir}` (artifact `export-folder`: what to do with it)"]
    if ls := s.label_studio:
        lines += [f"Label Studio: NOT pushed: {escape_md(ls['error'])}" if "error" in ls else
                  f"Label Studio: project {ls['project']} ← {ls['pushed']} new tasks ({ls['already']} already there)"]
    if s.relabel_dir:
        lines += [f"Re-label tasks (likely label errors, {s.relabel} samples): `{s.relabel_dir}`"]
    if out := s.outliers:
        lines += ["", f"Outliers in the pool: {out['flagged']} flagged ({out['far']} far from every neighbour, "
                  f"{out['persistent']} persistently uncertain), policy `{out['policy']}`; list: "
                  f"`{s.selection_dir}/outliers.jsonl`"]
    return lines


def summary_markdown(s: RoundState, metrics_rows: Sequence[Mapping[str, Any]],
                     label_report: str = "", *, curve_uri: str | None = None,
                     curve_path: str | os.PathLike[str] | None = None, evaluation: Any = None,
                     confusion_uri: str | None = None, batch_uri: str | None = None,
                     report_path: str | os.PathLike[str] | None = None) -> str:
    """The round-summary artifact (also artifacts/rounds/NNN/summary.md): counts, metrics, the learning curve as a
    picture (`curve_uri`, a data URI, for the UI) and as a table, the batch's contact sheet (`batch_uri`, for the UI),
    where the round's report is, the per-class results (`evaluation`, a pipeline.perclass.EvalReport, with the
    confusion matrix inline as `confusion_uri` for the UI), the hand-off, the label check and, with several annotators
    a sample, their quality and the redundancy tasks."""
    warn = [f"**{s.at_chance}**", ""] if s.at_chance else []  # first: nothing else on the page matters as much
    lines = [f"# Labeling round {s.round}", "", *warn, *_counts_lines(s)]
    if report_path:
        lines += ["", f"Round report (contact sheet, pool map, errors, quality; one HTML file): `{Path(report_path)}` "
                  f"— `tamis report --round {s.round} --open`"]
    if batch_uri:
        lines += ["", "## The batch", "", f"![batch contact sheet]({batch_uri})"]
    if metrics_rows:
        lines += ["", "## Learning curve", ""]
        if curve_uri:
            lines += [f"![learning curve]({curve_uri})", ""]
        if curve_path:
            lines += [f"PNG: `{Path(curve_path)}`", ""]
        lines += curve_table(metrics_rows)
    lines += evaluation_markdown(evaluation, confusion_uri) + _handoff_lines(s)
    if label_report:
        lines += ["", label_report]
    if s.consensus:  # several annotators a sample: their quality, as consensus.json estimates it
        lines += ["", annotators_markdown(s.consensus)]
    if s.consensus_dir:
        lines += ["", f"Redundancy tasks (consensus below annotate.redundancy.threshold, {s.consensus_requeued} "
                  f"samples): `{s.consensus_dir}`"]
    if s.consensus_trimmed:
        lines += ["", f"Redundancy tasks held back: {s.consensus_trimmed['reason']}."]
    return "\n".join(lines)


def handoff_markdown(export_dir: str | os.PathLike[str], *, artifacts: str | os.PathLike[str], round_index: int,
                     count: int, tasks_file: str, label_config_file: str, csv_file: str,
                     waiting: bool = False) -> str:
    """The export-folder artifact: where the batch is, as text to copy (a browser will not open a `file://` link
    from a web page), and one command per way of handing it to annotators and getting the labels back."""
    export_dir, artifacts = Path(export_dir).resolve(), Path(artifacts).resolve()
    q = shlex.quote
    lines = [f"# Round {round_index}: {count} samples for annotation", "", "Folder:", "", "```", str(export_dir), "```",
             "", f"- `{tasks_file}`: Label Studio tasks (with the model's answer as a pre-annotation), "
             f"`{label_config_file}`: its labeling interface", f"- `{csv_file}` / `.jsonl`: for spreadsheet annotators "
             "(fill the `label` column)", "",
             "Download the files from a browser (serves this folder on this machine only):", "",
             "```bash", "python -m http.server 8765 --bind 127.0.0.1 \\", f"  --directory {q(str(export_dir))}", "```", "",
             f"then http://127.0.0.1:8765/{tasks_file} and http://127.0.0.1:8765/{csv_file}.", "",
             "Label Studio (serves the images as local files; create a project with the labeling interface above, "
             f"add a Local files storage on `{artifacts / 'rounds'}`, import `{tasks_file}`):", "",
             "```bash",
             "LABEL_STUDIO_LOCAL_FILES_SERVING_ENABLED=true \\",
             f"  LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT={q(str(artifacts))} \\",
             "  label-studio start --internal-host 127.0.0.1", "```", "",
             f"Labels back: drop the annotators' export (Label Studio JSON, or CSV / JSONL with `sample_id,label`) into "
             f"`{artifacts / 'inbox'}`"]
    if waiting:
        lines[-1] += (", then resume this run (the **Resume** button: the form asks for the file's path, or leave it "
                      "empty when the file is in the inbox), or run `tamis resume --labels FILE`.")
    else:
        lines[-1] += "; the next round imports it (or now: `tamis labels import FILE`)."
    return "\n".join(lines)


def next_steps(s: RoundState, *, artifacts: str | os.PathLike[str], config: str,
               files: Mapping[str, str], batch_size: int, max_rounds: int, simulated: bool = False) -> list[str]:
    """What to do after a round, as `tamis round` prints it: where the batch for annotators is (the export's
    `files`: tasks, csv, jsonl), how its labels come back, and what the next round will do. The Prefect UI's
    hand-off (handoff_markdown) says the same at more length."""
    inbox = Path(artifacts).resolve() / "inbox"
    again = f"tamis round{f' -c {config}' if config else ''}"
    if s.stopped:
        adapter = (s.adapter or {}).get("adapter_dir")
        return [f"stopped: {s.stopped}"] + ([f"the model: adapter {adapter} (docs/use-your-model.md)"]
                                            if adapter else [])
    if not s.export_dir:
        return []
    export = Path(s.export_dir)
    labeled = s.labeled + s.selected_count
    last = s.round + 1 >= max_rounds - 1
    boxes = (export / BOX_NAMES_FILE).is_file()  # a box batch (pipeline/boxes/batch.py) has no table to fill
    where = (f"  Label Studio: {files['tasks']} (+ label_config.xml, RectangleLabels); COCO: predictions_coco.json; "
             "YOLO: yolo/; the images in images/ under their original file names" if boxes else
             f"  Label Studio: {files['tasks']} (+ label_config.xml); spreadsheet: {files['csv']} or {files['jsonl']} "
             "(fill the label column); the images in images/ (original_image: each one's file name in your data)")
    back = ("a Label Studio JSON export, or a COCO JSON naming the original files" if boxes
            else "Label Studio JSON, or CSV / JSONL with sample_id,label")
    return [f"batch for annotators ({s.selected_count} images): {export}", where,
            (f"labels back: the simulated annotator (rounds.simulate_annotator) answered it into {inbox}; `{again}`"
             if simulated else f"labels back: save the labeled export ({back}) into {inbox}, or "
             f"`tamis labels import FILE`; then `{again}`"),
            f"next round ({s.round + 1}): imports them, trains the adapter on {labeled} labels, evaluates it"
            + (", and stops there: it is the last (rounds.max_rounds)" if last
               else f" and selects {batch_size} more")]


@dataclass
class RoundProgress:
    """Percent of a round done, stage by stage, weighted by ROUND_STAGES; `sink(percent, text)` publishes it."""

    sink: Callable[[float, str], None]
    done: list[str] = field(default_factory=list)

    def start(self, stage: str) -> None:
        self.sink(self.percent(), f"{stage}…" + (f" (done: {', '.join(self.done)})" if self.done else ""))

    def finish(self, stage: str) -> None:
        if stage not in self.done:
            self.done.append(stage)

    @contextlib.contextmanager
    def step(self, stage: str, *with_it: str) -> Iterator[None]:
        """`with progress.step("train"):` the stage's start is published, and it counts as done once the block ends
        without an error; `with_it`: stages run inside the same block (the select stage scores the pool itself)."""
        self.start(stage)
        yield
        for s in (stage, *with_it):
            self.finish(s)

    def skip(self, *stages: str) -> None:
        """Stages this round does not run (no labels yet: no training; stopped: no selection) count as done."""
        for s in stages:
            self.finish(s)

    def percent(self) -> float:
        total = sum(w for _, w in ROUND_STAGES)
        return round(100.0 * sum(w for s, w in ROUND_STAGES if s in self.done) / total, 1)

    def complete(self, text: str) -> None:
        self.done = [s for s, _ in ROUND_STAGES]
        self.sink(100.0, text)


@dataclass
class StepReporter:
    """Training progress every `every` optimizer steps (and at the first and last), not every step: each report is an
    API call when it goes to the Prefect UI. Use as `train_adapter(..., on_step=reporter)`. The total is the training
    loop's own, handed in with each step (micro-batch × accumulation × processes, as the loop chose them), so the
    bar ends at 100 %: the sink is opened with it at the first step (`open_sink(total)`)."""

    open_sink: Callable[[int], Callable[[float, str], None]]
    every: int | None = None  # None: about 20 reports over the run
    losses: list[float] = field(default_factory=list)
    sink: Callable[[float, str], None] | None = field(default=None, init=False, repr=False)

    def __call__(self, step: int, total: int, loss: float) -> None:
        if self.sink is None:
            self.sink, self.every = self.open_sink(total), self.every or max(1, total // 20)
        self.losses.append(float(loss))
        if step % self.every == 0 or step >= total or step == 1:
            window = self.losses[-self.every:]
            self.sink(min(100.0, 100.0 * step / max(1, total)),
                      f"step {step} / {total}, loss {loss:.4f} (mean of last {len(window)}: "
                      f"{sum(window) / len(window):.4f})")

