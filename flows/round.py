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
from prefect.artifacts import create_link_artifact, create_markdown_artifact

from flows.ingest import ingest_ref
from flows.labelcheck import label_check_ref, relabel_ref, report_agreement, report_table, report_verdict
from flows.prepare import augment_ref, prepare_refs
from flows.select import select_ref
from flows.stages import run_stage, stage_task
from pipeline.annotation.export import EXPORT_VERSION, TASKS_FILE, export_dir, export_selection
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
from pipeline.rounds import (
    ROUND_FILE,
    completed_rounds,
    exported_before,
    next_round_index,
    save_labeled_set,
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

log = logging.getLogger(__name__)
TRAIN_STAGE_VERSION = "1"
SUMMARY_FILE = "summary.md"  # the round-summary artifact, also readable without the Prefect UI
EVAL_VERSION = "1"


def _cfg(sections: dict[str, Any], artifacts: str) -> ProjectConfig:
    return ProjectConfig.model_validate({**sections, "paths": {"artifacts": artifacts}})


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
    result = train_adapter(cfg, rows, Path(out_dir), init_adapter=init_adapter and init_adapter["adapter_dir"])
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


def _import_record(artifacts: Path, round_index: int, imports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The imports that brought a round's labels: a re-run of the round (whose files are all already imported) keeps
    the record of the run that imported them, and adds only what it imported or refused itself."""
    prev = next((s for s in completed_rounds(artifacts) if s["round"] == round_index), None)
    kept = [i for i in (prev or {}).get("imports", []) if not i.get("already_imported")]
    return kept + [i for i in imports if not i.get("already_imported") and i not in kept]


def _summary_markdown(state: dict[str, Any], metrics_rows: list[dict[str, Any]], label_report: str = "") -> str:
    lines = [f"# Labeling round {state['round']}", "",
             f"- labeled samples: **{state['labeled']}** (labels spent, re-labels included: "
             f"{state.get('labels_spent', state['labeled'])})",
             f"- pool (eligible): {state['pool']}", f"- selected: {state.get('selected', 0)}",
             f"- strategy: {state['strategy']}"]
    if state.get("phase"):
        lines.append(f"- selection phase: **{state['phase']['phase']}** — {state['phase']['reason']}")
    if state.get("embeddings") and state["embeddings"] != "model":
        lines.append(f"- selection space: `{state['embeddings']}` embeddings (select.embeddings)")
    if state.get("metrics"):
        lines.append("- test metrics: " + ", ".join(f"{k} = {v:.4f}" for k, v in state["metrics"].items()))
    if state.get("stopped"):
        lines.append(f"- **stopped**: {state['stopped']}")
    for imp in state.get("imports", []):
        lines.append(f"- inbox: {imp.get('summary') or 'REJECTED ' + imp['file'] + ': ' + imp['error']}")
    if metrics_rows:
        lines += ["", "## Learning curve", "", "| round | labels | metric | value |", "|---|---|---|---|"]
        lines += [f"| {r['round']} | {r['labels']} | {r['metric']} | {r['value']:.4f} |" for r in metrics_rows]
    if state.get("export_dir"):
        lines += ["", f"Export for annotators: `{state['export_dir']}`"]
    if state.get("label_studio"):
        ls = state["label_studio"]
        lines += [f"Label Studio: NOT pushed: {ls['error']}" if "error" in ls else
                  f"Label Studio: project {ls['project']} ← {ls['pushed']} new tasks ({ls['already']} already there)"]
    if state.get("relabel_dir"):
        lines += [f"Re-label tasks (likely label errors, {state['relabel']} samples): `{state['relabel_dir']}`"]
    out = state.get("outliers")
    if out:
        lines += ["", f"Outliers in the pool: {out['flagged']} flagged ({out['far']} far from every neighbour, "
                  f"{out['persistent']} persistently uncertain), policy `{out['policy']}`; list: "
                  f"`{state['selection_dir']}/outliers.jsonl`"]
    if label_report:
        lines += ["", label_report]
    return "\n".join(lines)


def run_round(cfg: ProjectConfig, *, simulate: bool | None = None) -> dict[str, Any]:
    """The body of a round; ordering only, every step is a library call or a cached stage task."""
    art = cfg.artifacts
    ing = ingest_ref(cfg)
    prep = prepare_refs(cfg, ing)
    ds_keys = load_prepared(prep["prepare"]["dir"])
    ds = ds_keys.select_columns(["sample_id", "split", "answer"])
    ids, splits, answers = ds["sample_id"], ds["split"], ds["answer"]

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
    state: dict[str, Any] = {"round": r, "labeled": len(labels), "labeled_digest": labeled_digest,
                             "imports": _import_record(art, r, imports), "metrics": None}

    # Rounds before this one: on a re-run of round r, round r's own state must not become its warm start.
    previous = [s for s in completed_rounds(art) if s["round"] < r]
    adapter = check = None
    if labels:
        labeled = save_labeled_set(load_prepared(prep["prepare"]["dir"]), labels, round_dir / "labeled",
                                   digest=digest_json([prep["prepare"]["digest"], labeled_digest]))
        aug = augment_ref(cfg, labeled) if cfg.augment.copies else None
        init = previous[-1].get("adapter") if previous and cfg.train.init == "warm" else None
        sections = {"model": cfg.section("model"), "train": cfg.section("train")}
        key = digest_json({"prepared": prep["prepare"]["digest"], "labeled": labeled_digest, **sections,
                           "aug": aug and aug["digest"], "init": init and init["adapter_digest"], "seed": cfg.seed})
        adapter = run_stage(train_task, artifacts=str(art), prepared=prep["prepare"], labeled=labeled,
                            augmented=aug, seed=cfg.seed, init_adapter=init, out_dir=str(art / "train" / key[:16]),
                            **sections)
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
        check = label_check_ref(cfg, labeled=labeled, previous=previous[-1] if previous else None,
                                round_dir=round_dir, prepared=prep["prepare"])
        if check is not None:
            state["labelcheck"] = {k: check.get(k) for k in ("dir", "method", "checked", "issues", "abstained",
                                                             "oos_accuracy", "expected_false_alarms", "message")}

    exported = exported_before(art, r)
    exclude = set(labels) | excluded_ids(prep["quality"]["dir"]) | (exported - set(labels))
    pool_ids = [s for s, sp in zip(ids, splits, strict=True) if sp == "pool" and s not in exclude]
    state.update(pool=len(pool_ids), strategy="cold start: " + cfg.select.cold_start if adapter is None
                 else f"{cfg.select.strategy}+{cfg.select.diversity}")
    state["labels_spent"] = labels_spent(len(labels), art, before_round=r)
    state["stopped"] = stop_reason(cfg, r, state["labels_spent"], read_metrics(art), len(pool_ids))
    if not state["stopped"]:
        adapter_ref = adapter and {"dir": adapter["adapter_dir"], "digest": adapter["adapter_digest"]}
        sel = select_ref(cfg, prepared=prep["prepare"], adapter=adapter_ref, pool_ids=pool_ids,
                         exclude=sorted(exclude), round_dir=round_dir, labels=labels,
                         history_dirs=[art / "rounds" / f"{p['round']:03d}" for p in previous])
        out = export_dir(art, r)
        exp = run_stage(export_task, artifacts=str(art), selection=sel, prepared=prep["prepare"],
                        annotate=cfg.section("annotate"), answers=cfg.data.answers, round_index=r, out_dir=str(out))
        if cfg.annotate.label_studio is not None:
            state["label_studio"] = push_batch(cfg, exp["dir"])
        state.update(selected=sel["n"], export_dir=exp["dir"], selection_dir=sel["dir"], outliers=sel.get("outliers"),
                     phase=sel.get("phase"), embeddings=sel.get("embeddings"))
        if sel.get("phase"):
            state["strategy"] = f"{sel['phase']['strategy']}+{sel['phase']['diversity']}"
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
    summary = _summary_markdown(state, metrics_rows, label_report)
    atomic_write_text(round_dir / SUMMARY_FILE, summary + "\n")
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
    if metrics_rows:
        plot_learning_curve(metrics_rows, art / "learning_curve.png")
    create_markdown_artifact(key="round-summary", markdown=summary, description=f"Labeling round {r}")
    if state.get("export_dir"):
        create_link_artifact(key="export-folder", link=Path(state["export_dir"]).resolve().as_uri(),
                             link_text=f"Round {r} export ({TASKS_FILE}, CSV, JSONL, images)")
    return state


@flow(name="labeling-round", log_prints=False)
def labeling_round(config_path: str | None = None, simulate: bool | None = None) -> dict[str, Any]:
    """Run (or resume, or re-run cached) the next labeling round of the project configured in `config_path`."""
    cfg = load_config(config_path)
    get_run_logger().info("labeling round for %s (artifacts in %s)", config_path or "the demo config", cfg.artifacts)
    with ProjectLock(cfg.artifacts / "round.lock"):
        return run_round(cfg, simulate=simulate)


def current_state(cfg: ProjectConfig) -> dict[str, Any]:
    """The last completed round's state (for the stand-alone select flow and `tamis status`)."""
    done = completed_rounds(cfg.artifacts)
    return done[-1] if done else {}
