"""The label check and the relabel queue as cached stages: what each task's parameters are (its cache key) and what
its body does. The flow only orders these calls; every path, digest and decision is made here.

The labelcheck task is keyed by the labeled set, the model/training/labelcheck config, the selection embeddings (kNN
signal) and (heldout) the adapter it scores with, so a re-run costs nothing. The probabilities live in their own
folder keyed only by what they depend on: k-fold adapters are trained once per labeled set, whatever the detection
settings (min_oos_accuracy, knn_k, min_confidence, relabel_top_n) become.

A task's parameters are its Prefect cache key: their names and values must not change, or every cached check reruns.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import round_state as rounds_layout
from pipeline.config import AnnotateConfig, EmbeddingsConfig, LabelCheckConfig, ModelConfig, TrainConfig
from pipeline.labelcheck.base import CheckScoring, CheckSpec, HeldOut
from pipeline.labelcheck.check import check_labels
from pipeline.labelcheck.relabel import (
    export_relabel,
    issues_from_report,
    relabel_candidates,
    relabel_dir,
    relabel_queued,
)
from pipeline.round_state import RoundState
from pipeline.stage_ref import StageRef
from pipeline.store import atomic_write_jsonl, column, digest_file, digest_json, read_jsonl

# Settings that only decide what is reported or queued: never part of the probabilities' folder key.
DETECTION_KEYS = ("min_oos_accuracy", "knn_k", "min_confidence", "relabel_top_n")
QUEUE_KEYS = ("min_confidence", "relabel_top_n")


@dataclass(frozen=True)
class LabelCheckParams:
    """The labelcheck stage's parameters, built by plan_label_check and passed whole to its task and body; the cache
    key is `asdict()` (trained_ids_digest and ledger_digest are there for the key only)."""

    artifacts: str
    labeled: dict[str, Any]
    data: dict[str, Any]
    seed: int
    heldout_adapter: dict[str, Any] | None
    trained_ids_digest: str | None
    trained_ids_path: str | None
    ledger_digest: str
    space: StageRef | None  # the selection-embeddings stage's output (the kNN signal's space)
    oos_dir: str
    out_dir: str
    model: dict[str, Any]
    train: dict[str, Any]
    labelcheck: dict[str, Any]
    select: dict[str, Any]


@dataclass(frozen=True)
class RelabelParams:
    """The relabel stage's parameters (plan_relabel), passed whole to its task and body; the cache key is
    `asdict()`."""

    artifacts: str
    check: StageRef  # the labelcheck stage's output (its dir and digest only)
    prepared: StageRef  # the prepared data (the images the tasks show)
    annotate: dict[str, Any]
    answers: list[str] | None
    top_n: int
    min_confidence: float
    already_queued: list[str]
    round_index: int
    out_dir: str


def plan_label_check(
    spec: CheckSpec,
    *,
    artifacts: str | os.PathLike[str],
    labeled: Mapping[str, Any],
    previous: RoundState | None,
    round_dir: str | os.PathLike[str],
    selection_space: Callable[[], Mapping[str, Any] | None] | None = None,
) -> LabelCheckParams | None:
    """The labelcheck task's parameters for this round's labeled set (`labeled`, the labeled stage's ref) checked as
    `spec` says (its held_out and hw are not read: the heldout adapter is `previous`'s), or None
    when labelcheck.method is off or the heldout method has no earlier adapter to score with (`previous`, the last
    finished round's RoundState, has none: the first trained round); its adapter record is keyed as round.json
    holds it.

    heldout writes the IDs the previous adapter trained on to round_dir/labelcheck_trained_ids.jsonl (the task reads
    them; their digest is in the key). `selection_space` returns the selection-embeddings stage's ref; it is called
    only when the kNN signal reads that space (select.embeddings is not `model`, labelcheck.knn_k > 0, closed
    answers), and without it the check runs on the model signal alone and says so."""
    from pipeline.annotation.ledger import ledger_path

    model, train, scoring, labelcheck, seed = spec.model, spec.train, spec.scoring, spec.labelcheck, spec.seed
    answers = None if spec.answers is None else list(spec.answers)
    method = labelcheck.method
    if method == "off":
        return None
    heldout_adapter = trained_path = trained_digest = None
    if method == "heldout":
        if previous is None or not previous.adapter:
            return None
        import datasets

        prev_set = rounds_layout.round_dir(artifacts, previous.round, "labeled", "dataset")
        trained = sorted(column(datasets.load_from_disk(str(prev_set)), "sample_id"))
        trained_path = Path(round_dir) / "labelcheck_trained_ids.jsonl"
        atomic_write_jsonl(trained_path, [{"sample_id": s} for s in trained])
        heldout_adapter, trained_digest = dict(previous.adapter), digest_json(trained)
    ledger = ledger_path(artifacts)
    # The ledger is in the key for the table's annotator / source columns only; the probabilities are cached by the
    # labeled set below (fold adapters are not retrained when just the ledger changed).
    ledger_digest = digest_file(ledger) if ledger.is_file() else "none"
    # The probabilities depend on the model, training, method/folds and scoring settings only: a new detection
    # setting, relabel_top_n or select.batch_size must not retrain fold adapters.
    lc = labelcheck.model_dump(mode="json")
    check_cfg = {k: v for k, v in lc.items() if k not in QUEUE_KEYS}
    keyed: dict[str, Any] = {"length_normalize": scoring.length_normalize,
                             "score_batch_size": scoring.score_batch_size}
    if not answers:  # open answers: the check compares the label with the model's MC-dropout answers too
        keyed["mc_dropout_passes"] = scoring.mc_dropout_passes
    model_cfg, train_cfg = model.model_dump(mode="json"), train.model_dump(mode="json")
    probs_sections = {"model": model_cfg, "train": train_cfg, "select": keyed,
                      "labelcheck": {k: v for k, v in lc.items() if k not in DETECTION_KEYS}}
    oos_key = digest_json({"labeled": labeled["digest"], "heldout": heldout_adapter and
                           heldout_adapter["adapter_digest"], "method": method, **probs_sections, "seed": seed})
    space = None
    # Open answers have no kNN label-consistency signal (answers are not classes): no space to pass.
    if scoring.embeddings.source != "model" and labelcheck.knn_k and selection_space is not None and answers:
        ref = selection_space()
        space = StageRef(ref["dir"], ref["digest"]) if ref else None
    embeddings = scoring.embeddings.model_dump(mode="json")
    report_key = digest_json({"oos": oos_key, "labelcheck": check_cfg, "space": space and space.digest,
                              "embeddings": embeddings})
    labelcheck_dir = Path(artifacts) / "labelcheck"
    return LabelCheckParams(
        artifacts=str(artifacts), labeled=dict(labeled), seed=seed,
        data={"answers": answers, **({"box_labels": list(spec.box_labels)} if spec.box_labels else {})},
        heldout_adapter=heldout_adapter, trained_ids_digest=trained_digest,
        trained_ids_path=trained_path and str(trained_path), ledger_digest=ledger_digest, space=space,
        oos_dir=str(labelcheck_dir / "oos" / oos_key[:16]), out_dir=str(labelcheck_dir / report_key[:16]),
        model=model_cfg, train=train_cfg, labelcheck=check_cfg, select={**keyed, "embeddings": embeddings})


def check_spec(params: LabelCheckParams) -> CheckSpec:
    """The CheckSpec the labelcheck task runs, from its keyed parameters only. `select` carries the check's scoring
    settings, which is all CheckScoring has fields for; `labelcheck` lacks the queue's settings (QUEUE_KEYS: changing
    them must not rerun the check), which only the relabel stage reads and which take their defaults here."""
    p, select = params, params.select
    held_out = None
    if p.heldout_adapter:
        trained = frozenset(r["sample_id"] for r in read_jsonl(p.trained_ids_path)) if p.trained_ids_path else frozenset()
        held_out = HeldOut(p.heldout_adapter["adapter_dir"], trained)
    scoring = CheckScoring(select["length_normalize"], select["score_batch_size"], select.get("mc_dropout_passes"),
                           EmbeddingsConfig.model_validate(select["embeddings"]))
    answers = p.data["answers"]
    box_labels = p.data.get("box_labels")
    return CheckSpec(ModelConfig.model_validate(p.model), TrainConfig.model_validate(p.train), scoring,
                     LabelCheckConfig.model_validate(p.labelcheck), None if answers is None else tuple(answers),
                     p.seed, held_out, box_labels=None if box_labels is None else tuple(box_labels))


def check_columns(columns: Sequence[str]) -> list[str]:
    """The labeled set's columns a label check reads: each sample's pictures and question as the round trained on
    them (a sample of several images or turns: `more_prepared` and `context` too, so its fold adapters train and its
    labels are scored on every picture, not the first alone) and `image_path`: the likely errors are listed by the
    user's file name (sets saved before it had one list IDs)."""
    from pipeline.boxes.box import GEOMETRY_COLUMNS  # a box label's geometry places the model's boxes

    return ["sample_id", "prepared", "question", "answer",
            *[c for c in ("more_prepared", "context", "image_path", *GEOMETRY_COLUMNS) if c in columns]]


def run_label_check(params: LabelCheckParams) -> dict[str, Any]:
    """The labelcheck task's body, on the parameters plan_label_check made: check_labels on the labeled set, its
    ref."""
    import datasets

    from pipeline.annotation.ledger import Ledger, ledger_path
    from pipeline.embeddings import load_selection_embeddings

    p = params
    labeled = datasets.load_from_disk(p.labeled["dataset"])
    rows = list(labeled.select_columns(check_columns(labeled.column_names)))
    m = check_labels(rows, p.out_dir, Ledger(ledger_path(p.artifacts)), check_spec(p), oos_dir=p.oos_dir,
                     selection_embeddings=load_selection_embeddings(p.space.dir) if p.space else None)
    return {"dir": p.out_dir, "digest": m.key, **m.info}


def plan_relabel(*, artifacts: str | os.PathLike[str], annotate: AnnotateConfig, labelcheck: LabelCheckConfig,
                 answers: Sequence[str] | None, check: Mapping[str, Any], prepared: StageRef | Mapping[str, Any],
                 round_index: int, cap: int | None = None, box_labels: Sequence[str] | None = None) -> RelabelParams:
    """The relabel task's parameters: the likely errors of `check` (the labelcheck stage's ref) at least
    labelcheck.min_confidence likely wrong that no earlier round sent back, at most labelcheck.relabel_top_n (and at
    most `cap`, what rounds.label_budget has left: pipeline.round.stop.budget_left), go to rounds/NNN/relabel/."""
    queued = sorted({s for ids in relabel_queued(artifacts, round_index).values() for s in ids})
    # A box project's check carries its class list (its queue goes out as a box batch); a one-answer check's ref is
    # its dir and digest only, as its key always held.
    boxes = {"box_labels": list(box_labels)} if box_labels else {}
    return RelabelParams(
        artifacts=str(artifacts), check=StageRef(check["dir"], check["digest"], boxes), prepared=StageRef.of(prepared),
        annotate=annotate.model_dump(mode="json"), answers=None if answers is None else list(answers),
        top_n=labelcheck.relabel_top_n if cap is None else min(labelcheck.relabel_top_n, cap),
        min_confidence=labelcheck.min_confidence, already_queued=queued, round_index=round_index,
        out_dir=str(relabel_dir(artifacts, round_index)))


def run_relabel(params: RelabelParams) -> dict[str, Any]:
    """The relabel task's body: export the queue, its ref; {"count": 0} when there is nothing to send (an abstaining
    check reports no issue)."""
    from pipeline.preprocess import load_prepared

    p = params
    issues = relabel_candidates(issues_from_report(p.check.dir), min_confidence=p.min_confidence, top_n=p.top_n,
                                skip=p.already_queued)
    if box_labels := p.check.extra.get("box_labels"):
        from pipeline.labelcheck.boxes import export_box_relabel

        m = export_box_relabel(issues, load_prepared(p.prepared.dir), p.out_dir,
                               annotate=AnnotateConfig.model_validate(p.annotate), box_labels=box_labels,
                               artifacts=p.artifacts, round_index=p.round_index)
        return {"dir": p.out_dir, "digest": m.key, "count": m.info["count"]} if m else {"count": 0}
    m = export_relabel(issues, load_prepared(p.prepared.dir), p.out_dir,
                       annotate=AnnotateConfig.model_validate(p.annotate), answers=p.answers, artifacts=p.artifacts,
                       round_index=p.round_index)
    return {"dir": p.out_dir, "digest": m.key, "count": m.info["count"]} if m else {"count": 0}
