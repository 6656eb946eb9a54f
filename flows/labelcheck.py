"""Label checks of a round: out-of-sample probabilities (+ kNN label consistency) → likely label errors → relabel queue.

The check is a cached stage keyed by the labeled set, the model/training/labelcheck config, the selection embeddings
(kNN signal) and (heldout) the adapter it scores with, so a re-run costs nothing. The probabilities live in their own
folder keyed only by what they depend on: k-fold adapters are trained once per labeled set, whatever the detection
settings (min_oos_accuracy, knn_k, min_confidence, relabel_top_n) become.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flows.stages import run_stage, stage_task
from pipeline.config import ProjectConfig
from pipeline.labelcheck import LABELCHECK_VERSION
from pipeline.store import digest_json


def _cfg(sections: dict[str, Any], artifacts: str) -> ProjectConfig:
    return ProjectConfig.model_validate({**sections, "paths": {"artifacts": artifacts}})


# Settings that only decide what is reported or queued: never part of the probabilities' folder key.
DETECTION_KEYS = ("min_oos_accuracy", "knn_k", "min_confidence", "relabel_top_n")
QUEUE_KEYS = ("min_confidence", "relabel_top_n")


@stage_task("labelcheck", LABELCHECK_VERSION)
def labelcheck_task(artifacts: str, labeled: dict, model: dict, train: dict, labelcheck: dict, select: dict,
                    data: dict, seed: int, heldout_adapter: dict | None, trained_ids_digest: str | None,
                    trained_ids_path: str | None, ledger_digest: str, space: dict | None, oos_dir: str,
                    out_dir: str) -> dict[str, Any]:
    import datasets

    from pipeline.annotation.ledger import Ledger, ledger_path
    from pipeline.embeddings import load_selection_embeddings
    from pipeline.labelcheck import check_labels
    from pipeline.store import read_jsonl

    cfg = _cfg({"model": model, "train": train, "labelcheck": labelcheck, "select": select, "data": data,
                "seed": seed}, artifacts)
    rows = list(datasets.load_from_disk(labeled["dataset"]).select_columns(
        ["sample_id", "prepared", "question", "answer"]))
    trained = [r["sample_id"] for r in read_jsonl(trained_ids_path)] if trained_ids_path else []
    m = check_labels(cfg, rows, out_dir, Ledger(ledger_path(artifacts)),
                     adapter=heldout_adapter and heldout_adapter["adapter_dir"], trained_ids=trained,
                     oos_dir=oos_dir, selection_embeddings=load_selection_embeddings(space["dir"]) if space else None)
    return {"dir": out_dir, "digest": m.key, **m.info}


def label_check_ref(cfg: ProjectConfig, *, labeled: dict[str, Any], previous: dict[str, Any] | None,
                    round_dir: Path, prepared: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Run (or reuse) the label check of the labeled set; None when labelcheck.method is off or the heldout method
    has no earlier adapter to score with (the first trained round). `prepared` (the prepare stage's ref) gives the
    kNN signal the selection embeddings when select.embeddings is not `model` (the same cached stage selection
    reads); without it the check runs on the model signal alone and says so."""
    from pipeline.annotation.ledger import ledger_path
    from pipeline.store import atomic_write_jsonl, digest_file

    method = cfg.labelcheck.method
    if method == "off":
        return None
    heldout_adapter = trained_path = trained_digest = None
    if method == "heldout":
        if not previous or not previous.get("adapter"):
            return None
        import datasets

        prev_set = Path(cfg.artifacts) / "rounds" / f"{previous['round']:03d}" / "labeled" / "dataset"
        trained = sorted(datasets.load_from_disk(str(prev_set))["sample_id"])
        trained_path = round_dir / "labelcheck_trained_ids.jsonl"
        atomic_write_jsonl(trained_path, [{"sample_id": s} for s in trained])
        heldout_adapter, trained_digest = previous["adapter"], digest_json(trained)
    ledger = ledger_path(cfg.artifacts)
    # The ledger is in the key for the table's annotator / source columns only; the probabilities are cached by the
    # labeled set below (fold adapters are not retrained when just the ledger changed).
    ledger_digest = digest_file(ledger) if ledger.is_file() else "none"
    # The probabilities depend on the model, training, method/folds and scoring settings only: a new detection
    # setting, relabel_top_n or select.batch_size must not retrain fold adapters.
    lc = cfg.section("labelcheck")
    check_cfg = {k: v for k, v in lc.items() if k not in QUEUE_KEYS}
    scoring = {k: cfg.section("select")[k] for k in ("length_normalize", "score_batch_size")}
    if not cfg.data.answers:  # open answers: the check compares the label with the model's MC-dropout answers too
        scoring["mc_dropout_passes"] = cfg.select.mc_dropout_passes
    probs_sections = {"model": cfg.section("model"), "train": cfg.section("train"), "select": scoring,
                      "labelcheck": {k: v for k, v in lc.items() if k not in DETECTION_KEYS}}
    oos_key = digest_json({"labeled": labeled["digest"], "heldout": heldout_adapter and
                           heldout_adapter["adapter_digest"], "method": method, **probs_sections, "seed": cfg.seed})
    space = None
    # Open answers have no kNN label-consistency signal (answers are not classes): no space to pass.
    if cfg.select.embeddings.source != "model" and cfg.labelcheck.knn_k and prepared is not None and cfg.data.answers:
        from flows.select import embeddings_ref

        ref = embeddings_ref(cfg, prepared)
        space = ref and {"dir": ref["dir"], "digest": ref["digest"]}
    embeddings = cfg.section("select")["embeddings"]
    report_key = digest_json({"oos": oos_key, "labelcheck": check_cfg, "space": space and space["digest"],
                              "embeddings": embeddings})
    labelcheck_dir = Path(cfg.artifacts) / "labelcheck"
    return run_stage(labelcheck_task, artifacts=str(cfg.artifacts), labeled=labeled, data={"answers": cfg.data.answers},
                     seed=cfg.seed, heldout_adapter=heldout_adapter, trained_ids_digest=trained_digest,
                     trained_ids_path=trained_path and str(trained_path), ledger_digest=ledger_digest, space=space,
                     oos_dir=str(labelcheck_dir / "oos" / oos_key[:16]), out_dir=str(labelcheck_dir / report_key[:16]),
                     model=cfg.section("model"), train=cfg.section("train"), labelcheck=check_cfg,
                     select={**scoring, "embeddings": embeddings})


@stage_task("relabel", LABELCHECK_VERSION)
def relabel_task(artifacts: str, check: dict, prepared: dict, annotate: dict, answers: list[str] | None,
                 top_n: int, min_confidence: float, already_queued: list[str], round_index: int,
                 out_dir: str) -> dict[str, Any]:
    from pipeline.labelcheck import export_relabel, issues_from_report, relabel_candidates
    from pipeline.preprocess import load_prepared

    cfg = _cfg({"annotate": annotate, "data": {"answers": answers}}, artifacts)
    issues = relabel_candidates(issues_from_report(check["dir"]), min_confidence=min_confidence, top_n=top_n,
                                skip=already_queued)
    m = export_relabel(issues, load_prepared(prepared["dir"]), cfg, out_dir, round_index=round_index)
    return {"dir": out_dir, "digest": m.key, "count": m.info["count"]} if m else {"count": 0}


def relabel_ref(cfg: ProjectConfig, *, check: dict[str, Any], prepared: dict[str, Any],
                round_index: int) -> dict[str, Any]:
    """Export the likely errors at least `labelcheck.min_confidence` likely wrong that no earlier round sent back,
    at most `labelcheck.relabel_top_n`, to rounds/NNN/relabel/; {"count": 0} when there are none (an abstaining
    check reports none)."""
    from pipeline.labelcheck import relabel_dir, relabel_queued

    queued = sorted({s for ids in relabel_queued(cfg.artifacts, round_index).values() for s in ids})
    return run_stage(relabel_task, artifacts=str(cfg.artifacts), check={"dir": check["dir"], "digest": check["digest"]},
                     prepared=prepared, annotate=cfg.section("annotate"), answers=cfg.data.answers,
                     top_n=cfg.labelcheck.relabel_top_n, min_confidence=cfg.labelcheck.min_confidence,
                     already_queued=queued, round_index=round_index,
                     out_dir=str(relabel_dir(cfg.artifacts, round_index)))


def report_table(ref: dict[str, Any]) -> list[dict[str, Any]]:
    from pipeline.store import read_jsonl

    return read_jsonl(Path(ref["dir"]) / "issues.jsonl")


def report_agreement(ref: dict[str, Any]) -> dict[str, Any]:
    import json

    return json.loads((Path(ref["dir"]) / "agreement.json").read_text(encoding="utf-8"))


def report_verdict(ref: dict[str, Any]) -> dict[str, Any]:
    """The check's verdict.json ({} for a report written before verdicts existed)."""
    import json

    from pipeline.labelcheck import VERDICT_FILE

    path = Path(ref["dir"]) / VERDICT_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
