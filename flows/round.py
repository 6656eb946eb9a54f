"""One labeling round: ingest → prepare → import labels → (augment → retrain → evaluate) → score → select → export.

Every heavy step is a content-keyed task, so a re-run of a finished round executes no stage body and a round killed
anywhere resumes where it stopped. A round's index advances only when the labeled set changed: running again with
no new labels is a re-run of the last round, not a new one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_image_artifact, create_markdown_artifact
from prefect.input import RunInput
from pydantic import Field

from flows.ingest import ingest_ref
from flows.labelcheck import label_check_ref, relabel_ref, report_agreement, report_table, report_verdict
from flows.prepare import augment_ref, prepare_refs
from flows.select import select_ref
from flows.stages import run_stage, stage_task
from flows.ui import library_logs_to_ui, name_run, progress_sink
from pipeline.annotation.export import (
    CSV_FILE,
    EXPORT_VERSION,
    LABEL_CONFIG_FILE,
    TASKS_FILE,
    export_dir,
    export_selection,
)
from pipeline.annotation.label_studio import pull_labels, push_batch
from pipeline.annotation.labels import LabelKeys, SampleIndex, import_labels, import_round, inbox_files
from pipeline.annotation.ledger import Ledger, ledger_path
from pipeline.annotation.simulate import simulate_annotator
from pipeline.config import ProjectConfig, load_config
from pipeline.errors import LabelImportError
from pipeline.evaluate import append_metrics, evaluate_model, plot_learning_curve, read_metrics
from pipeline.labelcheck import label_report_markdown, labels_spent
from pipeline.lock import ProjectLock
from pipeline.preprocess import load_prepared
from pipeline.quality import excluded_ids
from pipeline.report import (
    RoundProgress,
    StepReporter,
    handoff_markdown,
    import_record,
    planned_train_steps,
    png_data_uri,
    run_name,
    run_tags,
    state_message,
    summary_markdown,
)
from pipeline.rounds import (
    ROUND_FILE,
    completed_rounds,
    exported_before,
    next_round_index,
    receive_labels,
    save_labeled_set,
    should_wait,
    stop_reason,
)
from pipeline.store import (
    atomic_write_json,
    atomic_write_jsonl,
    atomic_write_text,
    digest_json,
    find_valid_manifest,
    read_jsonl,
    read_manifest,
    stage_key,
    write_manifest,
)
from pipeline.strategies.schedule import phase_label

log = logging.getLogger(__name__)
TRAIN_STAGE_VERSION = "1"
SUMMARY_FILE = "summary.md"  # the round-summary artifact, also readable without the Prefect UI
EVAL_VERSION = "1"


def _cfg(sections: dict[str, Any], artifacts: str) -> ProjectConfig:
    return ProjectConfig.model_validate({**sections, "paths": {"artifacts": artifacts}})


def _single_process(cfg: ProjectConfig) -> bool:
    """Training hooks run in this process only when it trains alone (spawned ranks cannot reach this run)."""
    from pipeline.model.hardware import detect_hardware, resolve_num_processes

    return resolve_num_processes(cfg.train.num_processes, detect_hardware()) == 1


# ------------------------------------------------------------------------------------------------ stages
@stage_task("train", TRAIN_STAGE_VERSION)
def train_task(artifacts: str, prepared: dict, labeled: dict, augmented: dict | None, model: dict, train: dict,
               seed: int, init_adapter: dict | None, out_dir: str) -> dict[str, Any]:
    import datasets

    from pipeline.model.train import train_adapter

    cfg = _cfg({"model": model, "train": train, "seed": seed}, artifacts)
    cols = ["sample_id", "prepared", "question", "answer"]
    rows = list(datasets.load_from_disk(labeled["dataset"]).select_columns(cols))
    if augmented is not None:
        from pipeline.augment import load_augmented

        rows += list(load_augmented(augmented["dir"]).select_columns(cols))
    total = planned_train_steps(cfg.train.max_steps, cfg.train.epochs, len(rows), cfg.train.effective_batch_size)
    # Every ~20th of the run (at least every step for short runs): each report is an API call.
    reporter = StepReporter(total, progress_sink("training-progress", f"training ({total} steps)"),
                            every=max(1, total // 20))
    result = train_adapter(cfg, rows, Path(out_dir), init_adapter=init_adapter and init_adapter["adapter_dir"],
                           on_step=reporter if _single_process(cfg) else None)
    m = read_manifest(out_dir)
    return {"dir": out_dir, "digest": m.key, "adapter_dir": str(result.adapter_dir),
            "adapter_digest": m.outputs["adapter"].digest}


@stage_task("evaluate", EVAL_VERSION)
def evaluate_task(artifacts: str, prepared: dict, adapter: dict, model: dict, answers: list[str] | None,
                  batch_size: int, out_dir: str) -> dict[str, Any]:
    from pipeline.model.loading import load_model

    key = stage_key("evaluate", EVAL_VERSION, {"prepared": prepared["digest"], "adapter": adapter["adapter_digest"]},
                    {"model": model, "answers": answers})
    if (m := find_valid_manifest(out_dir, key)) is None:
        ds = load_prepared(prepared["dir"])
        test = ds.filter(lambda split, answer: split == "test" and answer is not None,
                         input_columns=["split", "answer"], keep_in_memory=True)
        cfg = _cfg({"model": model}, artifacts)
        loaded = load_model(cfg.model, adapter=adapter["adapter_dir"])
        result = evaluate_model(loaded, list(test), answers, batch_size=batch_size,
                                max_new_tokens=cfg.model.max_new_tokens)
        out = Path(out_dir)
        atomic_write_jsonl(out / "predictions.jsonl", result.pop("predictions"))
        atomic_write_json(out / "metrics.json", result)
        m = write_manifest(out, stage="evaluate", stage_version=EVAL_VERSION,
                           inputs={"prepared": prepared["digest"], "adapter": adapter["adapter_digest"]},
                           config={"model": model, "answers": answers},
                           outputs={"metrics": "metrics.json", "predictions": "predictions.jsonl"}, info=result)
    return {"dir": out_dir, "digest": m.key, **m.info}


@stage_task("export", EXPORT_VERSION)
def export_task(artifacts: str, selection: dict, prepared: dict, annotate: dict, answers: list[str] | None,
                round_index: int, out_dir: str) -> dict[str, Any]:
    cfg = _cfg({"annotate": annotate, "data": {"answers": answers}}, artifacts)
    rows = read_jsonl(Path(selection["dir"]) / "selection.jsonl")
    m = export_selection(rows, load_prepared(prepared["dir"]), cfg, out_dir, round_index=round_index)
    return {"dir": out_dir, "digest": m.key, "count": m.info["count"]}


# ------------------------------------------------------------------------------------------------- steps
def import_new_labels(cfg: ProjectConfig, known_ids: SampleIndex | set[str], round_index: int) -> list[dict[str, Any]]:
    """Import every inbox file on its own: a corrupt file is rejected (reported with its line) and the rest go in."""
    ledger = Ledger(ledger_path(cfg.artifacts))
    index, keys = SampleIndex.of(known_ids), LabelKeys.from_config(cfg)
    reports = []
    for path in inbox_files(cfg.artifacts / "inbox"):
        try:
            rep = import_labels(path, known_ids=index, answers=cfg.data.answers, ledger=ledger,
                                round_index=round_index, rejections_dir=cfg.artifacts / "rejections", keys=keys)
        except LabelImportError as exc:
            log.error("label file rejected, nothing imported from it: %s", exc)
            reports.append({"file": str(path), "error": str(exc)})
            continue
        if not rep.already_imported:
            log.info(rep.summary())
        reports.append({"file": rep.file, "summary": rep.summary(), "accepted": len(rep.accepted),
                        "rejected": len(rep.rejected), "already_imported": rep.already_imported})
    return reports


def run_round(cfg: ProjectConfig, *, simulate: bool | None = None,
              progress: RoundProgress | None = None) -> dict[str, Any]:
    """The body of a round; ordering only, every step is a library call or a cached stage task."""
    art = cfg.artifacts
    progress = progress or RoundProgress(lambda percent, text: None)
    progress.start("ingest")
    ing = ingest_ref(cfg)
    progress.finish("ingest")
    progress.start("prepare")
    prep = prepare_refs(cfg, ing)
    progress.finish("prepare")
    ds_keys = load_prepared(prep["prepare"]["dir"])
    ds = ds_keys.select_columns(["sample_id", "split", "answer"])
    ids, splits, answers = ds["sample_id"], ds["split"], ds["answer"]

    progress.start("import labels")
    start = import_round(art)  # the round `tamis labels import` records too
    cols = [c for c in ("sample_id", "external_id", "image_path") if c in ds_keys.column_names]
    index = SampleIndex.from_dataset(ds_keys.select_columns(cols))
    # A live Label Studio project (annotate.label_studio) first, then the inbox: the same importer for both.
    imports = pull_labels(cfg, known_ids=index, round_index=start) + import_new_labels(cfg, index, start)
    seed_labels = {s: a for s, sp, a in zip(ids, splits, answers, strict=True) if sp == "train" and a is not None}
    ledger_labels = {s: lab for s, lab in Ledger(ledger_path(art)).labels().items() if s in set(ids)}
    labels = {**seed_labels, **ledger_labels}
    labeled_digest = digest_json(sorted(labels.items()))
    r = next_round_index(art, labeled_digest)
    round_dir = art / "rounds" / f"{r:03d}"
    same = next((s for s in completed_rounds(art) if s["round"] == r), None)  # set on a re-run of a finished round
    state: dict[str, Any] = {"round": r, "labeled": len(labels), "labeled_digest": labeled_digest,
                             "imports": import_record(same, imports), "metrics": None}
    name_run(run_name(r, rerun=same is not None), run_tags(r, rerun=same is not None))
    progress.finish("import labels")

    # Rounds before this one: on a re-run of round r, round r's own state must not become its warm start.
    previous = [s for s in completed_rounds(art) if s["round"] < r]
    adapter = check = None
    if labels:
        labeled = save_labeled_set(load_prepared(prep["prepare"]["dir"]), labels, round_dir / "labeled",
                                   digest=digest_json([prep["prepare"]["digest"], labeled_digest]))
        aug = augment_ref(cfg, labeled) if cfg.augment.copies else None
        init = previous[-1].get("adapter") if previous and cfg.train.init == "warm" else None
        progress.start("train")
        sections = {"model": cfg.section("model"), "train": cfg.section("train")}
        key = digest_json({"prepared": prep["prepare"]["digest"], "labeled": labeled_digest, **sections,
                           "aug": aug and aug["digest"], "init": init and init["adapter_digest"], "seed": cfg.seed})
        adapter = run_stage(train_task, artifacts=str(art), prepared=prep["prepare"], labeled=labeled,
                            augmented=aug, seed=cfg.seed, init_adapter=init, out_dir=str(art / "train" / key[:16]),
                            **sections)
        progress.finish("train")
        progress.start("evaluate")
        ev_key = digest_json({"prepared": prep["prepare"]["digest"], "adapter": adapter["adapter_digest"]})
        ev = run_stage(evaluate_task, artifacts=str(art), prepared=prep["prepare"], adapter=adapter,
                       model=cfg.section("model"), answers=cfg.data.answers,
                       batch_size=cfg.select.score_batch_size, out_dir=str(art / "eval" / ev_key[:16]))
        state["metrics"] = ev["metrics"]
        recorded = {(m["round"], m["metric"]) for m in read_metrics(art)}
        for name, value in ev["metrics"].items():
            if (r, name) not in recorded:
                append_metrics(art, {"round": r, "labels": len(labels), "metric": name, "value": value,
                                     "strategy": f"{cfg.select.strategy}+{cfg.select.diversity}"})
        progress.finish("evaluate")
        progress.start("label check")
        check = label_check_ref(cfg, labeled=labeled, previous=previous[-1] if previous else None,
                                round_dir=round_dir, prepared=prep["prepare"])
        progress.finish("label check")
        if check is not None:
            state["labelcheck"] = {k: check.get(k) for k in ("dir", "method", "checked", "issues", "abstained",
                                                             "oos_accuracy", "expected_false_alarms", "message")}
    else:
        progress.skip("train", "evaluate", "label check")

    exported = exported_before(art, r)
    exclude = set(labels) | excluded_ids(prep["quality"]["dir"]) | (exported - set(labels))
    pool_ids = [s for s, sp in zip(ids, splits, strict=True) if sp == "pool" and s not in exclude]
    state.update(pool=len(pool_ids), strategy="cold start: " + cfg.select.cold_start if adapter is None
                 else f"{cfg.select.strategy}+{cfg.select.diversity}")
    state["labels_spent"] = labels_spent(len(labels), art, before_round=r)
    state["stopped"] = stop_reason(cfg, r, state["labels_spent"], read_metrics(art), len(pool_ids))
    if not state["stopped"]:
        progress.start("score pool")
        adapter_ref = adapter and {"dir": adapter["adapter_dir"], "digest": adapter["adapter_digest"]}
        sel = select_ref(cfg, prepared=prep["prepare"], adapter=adapter_ref, pool_ids=pool_ids,
                         exclude=sorted(exclude), round_dir=round_dir, labels=labels,
                         history_dirs=[art / "rounds" / f"{p['round']:03d}" for p in previous])
        progress.skip("score pool", "select")
        progress.start("export")
        out = export_dir(art, r)
        exp = run_stage(export_task, artifacts=str(art), selection=sel, prepared=prep["prepare"],
                        annotate=cfg.section("annotate"), answers=cfg.data.answers, round_index=r, out_dir=str(out))
        if cfg.annotate.label_studio is not None:
            state["label_studio"] = push_batch(cfg, exp["dir"])
        state.update(selected=sel["n"], export_dir=exp["dir"], selection_dir=sel["dir"], outliers=sel.get("outliers"),
                     phase=sel.get("phase"), embeddings=sel.get("embeddings"))
        if sel.get("phase"):
            state["strategy"] = phase_label(sel["phase"])
        if check is not None and cfg.labelcheck.relabel_top_n:
            rel = relabel_ref(cfg, check=check, prepared=prep["prepare"], round_index=r)
            state["relabel"] = rel["count"]
            if rel["count"]:
                state["relabel_dir"] = rel["dir"]
                if cfg.annotate.label_studio is not None:
                    state["label_studio_relabel"] = push_batch(cfg, rel["dir"])

    state["adapter"] = adapter
    metrics_rows = read_metrics(art)
    label_report = ""
    if check is not None:
        label_report = label_report_markdown(report_table(check), report_agreement(check), method=check["method"],
                                             checked=check["checked"], verdict=report_verdict(check))
    curve = plot_learning_curve(metrics_rows, art / "learning_curve.png") if metrics_rows else None
    # The file keeps the PNG's path (a data URI would make summary.md unreadable as text); the UI gets the picture.
    atomic_write_text(round_dir / SUMMARY_FILE, summary_markdown(state, metrics_rows, label_report,
                                                                 curve_path=curve) + "\n")
    atomic_write_json(round_dir / ROUND_FILE, state)
    # Only a finished round is answered: with its labels in the inbox before round.json, a crash in between made
    # the re-run import them into this round (a cold-start round trained, its export replaced, rounds renumbered).
    if state.get("export_dir") and (cfg.rounds.simulate_annotator if simulate is None else simulate):
        simulate_annotator(state["export_dir"], cfg.data.ground_truth, art / "inbox", round_index=r,
                           noise=cfg.rounds.simulate_noise, seed=cfg.seed)
        if state.get("relabel_dir"):
            # The reviewer of likely errors is careful: answers from the ground truth, never flipped.
            simulate_annotator(state["relabel_dir"], cfg.data.ground_truth, art / "inbox", round_index=r,
                               seed=cfg.seed, annotator="simulated-reviewer", kind="relabel")
    uri = png_data_uri(curve) if curve else None
    create_markdown_artifact(key="round-summary", description=f"Labeling round {r}",
                             markdown=summary_markdown(state, metrics_rows, label_report, curve_uri=uri,
                                                       curve_path=curve))
    if uri:
        create_image_artifact(key="learning-curve", image_url=uri,
                              description=f"Learning curve after round {r} ({curve})")
    if state.get("export_dir"):
        create_markdown_artifact(key="export-folder", description=f"Round {r} export: where it is, how to hand it off",
                                 markdown=handoff_markdown(state["export_dir"], artifacts=art, round_index=r,
                                                           count=state["selected"], tasks_file=TASKS_FILE,
                                                           label_config_file=LABEL_CONFIG_FILE, csv_file=CSV_FILE,
                                                           waiting=waits_for_labels(cfg, state)))
    progress.complete(state_message(state))
    name_run(run_name(r, rerun=same is not None), run_tags(r, rerun=same is not None, stopped=state["stopped"]))
    return state


WAIT_KEY = "labels-in"  # the round's one suspension: a resumed run finds it among its pause keys


class LabelsIn(RunInput):
    """The form a round waiting for its annotators shows in the Prefect UI (and `tamis resume` fills in)."""

    labels_in_inbox: bool = Field(default=True, title="The labels are in the inbox",
                                  description="The annotators' export is in artifacts/inbox/ (or give its path below).")
    labels_file: str = Field(default="", title="Annotators' export file",
                             description="Path, on the worker's machine, of a Label Studio JSON export or a CSV / "
                                         "JSONL with sample_id,label; copied into the inbox. Empty: use the inbox.")
    note: str = Field(default="", title="Note", description="Written to the run's log.")


def _first_name() -> str:
    """The name a run starts with: the round after the last finished one (renamed once the labels are counted)."""
    from prefect.runtime import flow_run

    try:
        done = completed_rounds(load_config(flow_run.parameters.get("config_path")).artifacts)
    except Exception:  # a bad config fails the run itself, with its message; the name must not fail first
        return run_name(None)
    return run_name(done[-1]["round"] + 1 if done else 0)


def _resumed() -> bool:
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return ctx is not None and WAIT_KEY in (ctx.flow_run.empirical_policy.pause_keys or set())


def _deployed() -> bool:
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return ctx is not None and ctx.flow_run.deployment_id is not None


def waits_for_labels(cfg: ProjectConfig, state: dict[str, Any]) -> bool:
    return should_wait(cfg, state, deployed=_deployed())


def _locked_round(cfg: ProjectConfig, simulate: bool | None) -> dict[str, Any]:
    progress = RoundProgress(progress_sink("round-progress", "labeling round"))
    with ProjectLock(cfg.artifacts / "round.lock"):
        return run_round(cfg, simulate=simulate, progress=progress)


def _final(state: dict[str, Any]) -> Any:
    from prefect.states import Completed

    # The run's state message, in the runs list: what the round did or why it stopped. Callers get `state`.
    return Completed(message=state_message(state), data=state)


@flow(name="labeling-round", flow_run_name=_first_name, log_prints=False)
def labeling_round(config_path: str | None = None, simulate: bool | None = None) -> dict[str, Any]:
    """Run (or resume, or re-run cached) the next labeling round of the project configured in `config_path`.

    With `rounds.wait_for_labels` a deployed run suspends after its export (Suspended in the UI, with a form) and
    holds nothing meanwhile: no process, no lock. Resumed, it starts again from the top, finds its pause key, skips
    straight to the labels, imports them and runs the next round.
    """
    from prefect.flow_runs import suspend_flow_run

    cfg = load_config(config_path)
    logger = get_run_logger()
    logger.info("labeling round for %s (artifacts in %s)", config_path or "the demo config", cfg.artifacts)
    with library_logs_to_ui():
        if not _resumed():
            state = _locked_round(cfg, simulate)
            if not waits_for_labels(cfg, state):
                if cfg.rounds.wait_for_labels and not _deployed():
                    logger.info("rounds.wait_for_labels: only a deployment's run can wait (its worker restarts it "
                                "when resumed); this run ends now, the next one imports the labels")
                return _final(state)
            name_run(run_name(state["round"]), run_tags(state["round"], waiting=True))
            logger.info("round %d exported %d samples to %s; suspending until the labels are in (resume from the "
                        "UI or `tamis resume`; gives up after %d s, rounds.wait_timeout_s)", state["round"],
                        state["selected"], state["export_dir"], cfg.rounds.wait_timeout_s)
        # The first call ends this process (the run shows Suspended); in the resumed run it returns the form's input.
        answer = suspend_flow_run(wait_for_input=LabelsIn, timeout=cfg.rounds.wait_timeout_s, key=WAIT_KEY)
        logger.info("resumed: labels in inbox %s, file %r, note %r", answer.labels_in_inbox, answer.labels_file,
                    answer.note)
        if answer.labels_file.strip():
            logger.info("labels file copied to %s", receive_labels(cfg.artifacts, answer.labels_file.strip()))
        return _final(_locked_round(cfg, simulate))


def current_state(cfg: ProjectConfig) -> dict[str, Any]:
    """The last completed round's state (for the stand-alone select flow and `tamis status`)."""
    done = completed_rounds(cfg.artifacts)
    return done[-1] if done else {}
