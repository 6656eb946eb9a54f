"""Data-centric label checks: out-of-sample probabilities, confident-learning label-error detection, a relabel queue
and annotator agreement.

Nothing here changes a label. Likely errors are reported (with who labeled them, from which file) and sent back to
annotators as a separate task set; their answers come in through the normal import and land in the ledger as
correction entries, so the old label stays visible in `tamis labels history`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.annotation.export import (
    EXPORTERS,
    ExportContext,
    ExportItem,
    LabelStudioExporter,
    _document_relpath,
    build_items,
)
from pipeline.config import ProjectConfig
from pipeline.errors import ArtifactError, DataError
from pipeline.store import (
    Manifest,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_jsonl,
    digest_json,
    digest_path,
    find_valid_manifest,
    read_jsonl,
    read_manifest,
    stage_key,
    write_manifest,
)

log = logging.getLogger(__name__)

LABELCHECK_VERSION = "1"
# Softmax outputs of fp16/bf16 models sum to 1 only to about 1e-3.
PROB_TOL = 1e-3


class LabelCheckError(DataError):
    pass


# ------------------------------------------------------------------------------------ out-of-sample probabilities
@dataclass
class OOSResult:
    """Class probabilities of labeled samples from models that did not train on them (rows of `sample_ids`)."""

    sample_ids: list[str]
    probs: np.ndarray  # [n, c] over cfg.data.answers
    folds: np.ndarray  # [n] fold each sample was held out in; -1 for the heldout method
    method: str  # "kfold" or "heldout"
    info: dict[str, Any] = field(default_factory=dict)

    def suggestions(self, answers: Sequence[str]) -> dict[str, str]:
        """sample_id → the out-of-sample model's answer."""
        return {sid: answers[int(j)] for sid, j in zip(self.sample_ids, self.probs.argmax(1), strict=True)}


def stratified_folds(labels: Sequence[str], k: int, seed: int) -> np.ndarray:
    """Fold index per sample: each class shuffled (seeded) and dealt round-robin, continuing where the previous
    class stopped, so every fold gets about n/k samples and each class's share."""
    labels = list(labels)
    folds = np.empty(len(labels), dtype=np.int64)
    rng = np.random.default_rng(seed)
    arr = np.asarray(labels, dtype=object)
    nxt = 0
    for c in sorted(set(labels)):
        idx = rng.permutation(np.flatnonzero(arr == c))
        folds[idx] = (nxt + np.arange(len(idx))) % k
        nxt = (nxt + len(idx)) % k
    return folds


def _answers(cfg: ProjectConfig) -> list[str]:
    if not cfg.data.answers:
        raise LabelCheckError("label checks need a closed answer set: set data.answers (open answers have no class "
                              "probabilities to compare)")
    return list(cfg.data.answers)


def _check_labeled(rows: Sequence[Mapping[str, Any]], answers: Sequence[str]) -> list[dict[str, Any]]:
    allowed = set(answers)
    seen: set[str] = set()
    out = []
    for i, r in enumerate(rows):
        sid, label = r.get("sample_id"), r.get("answer")
        if not isinstance(sid, str) or not sid:
            raise LabelCheckError(f"labeled row {i}: no sample_id; pass rows from pipeline.rounds.labeled_rows")
        if sid in seen:
            raise LabelCheckError(f"labeled row {i}: sample {sid} appears twice; each sample has one current label")
        if label not in allowed:
            raise LabelCheckError(f"labeled row {i} (sample {sid}): label {label!r} is not in data.answers "
                                  f"[{', '.join(answers)}]; fix the label or the answer set")
        if not isinstance(r.get("prepared"), (bytes, bytearray)):
            raise LabelCheckError(f"labeled row {i} (sample {sid}): no 'prepared' image bytes; run the prepare stage")
        seen.add(sid)
        out.append(dict(r))
    return sorted(out, key=lambda r: r["sample_id"])


def fold_config(cfg: ProjectConfig) -> ProjectConfig:
    """The config fold adapters train with: train.max_steps replaced by labelcheck.max_steps when that is set."""
    if cfg.labelcheck.max_steps is None:
        return cfg
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps": cfg.labelcheck.max_steps})})


def _score_config(cfg: ProjectConfig, answers: list[str]) -> dict[str, Any]:
    return {"model": cfg.section("model"), "train": fold_config(cfg).section("train"), "seed": cfg.seed,
            "answers": answers, "length_normalize": cfg.select.length_normalize,
            "batch_size": cfg.select.score_batch_size, "labelcheck_version": LABELCHECK_VERSION}


def _score_held_out(cfg: ProjectConfig, adapter_dir: Path, rows: list[dict[str, Any]], answers: list[str],
                    out_dir: Path, inputs: dict[str, str], config: dict[str, Any], hw: Any) -> Any:
    from pipeline.model.loading import load_model
    from pipeline.scoring import ClosedSetScorer, save_scores

    loaded = load_model(cfg.model, adapter=adapter_dir, hw=hw)
    try:
        result = ClosedSetScorer(loaded, answers, length_normalize=cfg.select.length_normalize).score(
            rows, batch_size=cfg.select.score_batch_size)
    finally:
        del loaded
        gc.collect()
    save_scores(result, out_dir, inputs=inputs, config=config)
    return result


def out_of_sample_probs(
    cfg: ProjectConfig,
    labeled_rows: Sequence[Mapping[str, Any]],
    work_dir: str | os.PathLike[str],
    *,
    k: int | None = None,
    method: str | None = None,
    adapter: str | os.PathLike[str] | None = None,
    trained_ids: Iterable[str] = (),
    hw: Any = None,
    progress: bool = False,
) -> OOSResult:
    """Class probabilities for labeled rows ({sample_id, prepared, question, answer}) from models that never saw them.

    kfold (default `cfg.labelcheck.method`): seeded folds stratified by label; fold i's adapter is trained with
    `train_adapter` on the other folds into work_dir/fold-i and scores fold i. The scores are cached in
    work_dir/fold-i/oos, keyed by (labeled-set digest, fold, config): an unchanged labeled set costs nothing, and an
    interrupted run resumes (train_adapter resumes from its checkpoints).
    heldout: `adapter` (the round's adapter) scores the rows it did not train on (not in `trained_ids`), typically
    the ones labeled since it was trained; a cheap approximation for models too big to train k times.
    """
    from pipeline.model.train import check_rows
    from pipeline.scoring import SCORE_VERSION, load_scores

    method = method or cfg.labelcheck.method
    answers = _answers(cfg)
    rows = _check_labeled(labeled_rows, answers)
    work_dir = Path(work_dir)
    config = _score_config(cfg, answers)
    n = len(rows)

    if method == "heldout":
        if adapter is None:
            raise LabelCheckError("labelcheck.method heldout needs the round's adapter (pass adapter=...); or use kfold")
        skip = set(trained_ids)
        held = [r for r in rows if r["sample_id"] not in skip]
        info: dict[str, Any] = {"adapter": str(adapter), "scored": len(held), "skipped_trained_on": n - len(held)}
        if not held:
            log.info("heldout label check: all %d labeled samples were trained on; nothing to check", n)
            return OOSResult([], np.zeros((0, len(answers)), np.float32), np.zeros(0, np.int64), method, info)
        inputs = {"rows": check_rows(held), "adapter": digest_path(adapter)}
        out = work_dir / "heldout"
        if find_valid_manifest(out, stage_key("score", SCORE_VERSION, inputs, config)) is None:
            _score_held_out(cfg, Path(adapter), held, answers, out, inputs, config, hw)
            info["reused"] = False
        else:
            info["reused"] = True
        res = load_scores(out)
        return OOSResult(res.sample_ids, res.probs, np.full(len(held), -1, np.int64), method, info)

    if method != "kfold":
        raise LabelCheckError(f"labelcheck.method {method!r} is not one of kfold, heldout")
    from pipeline.model.train import train_adapter

    k = cfg.labelcheck.kfold if k is None else k
    if k < 2 or n < k:
        raise LabelCheckError(f"k-fold label check: {n} labeled samples cannot make {k} folds; label at least {k} "
                              "samples or lower labelcheck.kfold (≥ 2)")
    labeled_digest = check_rows(rows)
    folds = stratified_folds([r["answer"] for r in rows], k, cfg.seed)
    probs = np.full((n, len(answers)), np.nan, dtype=np.float32)
    per_fold = []
    for i in range(k):
        held_idx = np.flatnonzero(folds == i)
        train_rows = [rows[j] for j in np.flatnonzero(folds != i)]
        fold_dir = work_dir / f"fold-{i}"
        inputs = {"labeled": labeled_digest, "fold": f"{i}/{k}"}
        out = fold_dir / "oos"
        reused = find_valid_manifest(out, stage_key("score", SCORE_VERSION, inputs, config)) is not None
        if not reused:
            log.info("label check fold %d/%d: training on %d samples, scoring %d held out", i + 1, k,
                     len(train_rows), len(held_idx))
            trained = train_adapter(fold_config(cfg), train_rows, fold_dir, hw=hw, progress=progress)
            _score_held_out(cfg, trained.adapter_dir, [rows[j] for j in held_idx], answers, out, inputs, config, hw)
        res = load_scores(out)
        pos = {sid: j for j, sid in enumerate(res.sample_ids)}
        probs[held_idx] = res.probs[[pos[rows[j]["sample_id"]] for j in held_idx]]
        per_fold.append({"fold": i, "train": len(train_rows), "held_out": len(held_idx), "reused": reused})
    return OOSResult([r["sample_id"] for r in rows], probs, folds, "kfold",
                     {"k": k, "labeled_digest": labeled_digest, "folds": per_fold})


# ------------------------------------------------------------------------------------------ label-error detection
@dataclass(frozen=True)
class Issue:
    """A likely label error. margin = p(given) − max p(other): the more negative, the likelier the error."""

    index: int
    sample_id: str
    given_label: str
    suggested_label: str
    given_prob: float
    suggested_prob: float
    margin: float
    threshold: float  # the given class's threshold (mean self-confidence)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_probs(probs: Any, n: int, answers: Sequence[str]) -> np.ndarray:
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 2 or p.shape != (n, len(answers)):
        raise LabelCheckError(f"label check: probabilities have shape {p.shape}, expected ({n}, {len(answers)}) "
                              f"for {n} labels over {len(answers)} answers")
    if not np.isfinite(p).all():
        row = int(np.argwhere(~np.isfinite(p))[0, 0])
        raise LabelCheckError(f"label check: probabilities of row {row} are NaN/inf; score that sample again")
    bad = np.flatnonzero((p.min(1) < -PROB_TOL) | (np.abs(p.sum(1) - 1) > PROB_TOL))
    if len(bad):
        raise LabelCheckError(f"label check: row {int(bad[0])} is not a probability distribution (sum "
                              f"{p[bad[0]].sum():.4f}, min {p[bad[0]].min():.4f}); {len(bad)} rows like it")
    return p


def _label_index(given_labels: Sequence[str], answers: Sequence[str]) -> np.ndarray:
    pos = {a: j for j, a in enumerate(answers)}
    out = np.empty(len(given_labels), dtype=np.int64)
    for i, lab in enumerate(given_labels):
        if lab not in pos:
            raise LabelCheckError(f"label check: label {lab!r} of row {i} is not in the answer set "
                                  f"[{', '.join(answers)}]")
        out[i] = pos[lab]
    return out


def class_thresholds(probs: np.ndarray, given: np.ndarray, n_classes: int) -> np.ndarray:
    """Per-class threshold t_j = mean p_j over the samples labeled j; +inf for a class nobody was given (it can
    never be suggested: with no samples there is no estimate of how confident the model is about it)."""
    t = np.full(n_classes, np.inf)
    for j in np.unique(given):
        t[j] = probs[given == j, j].mean()
    return t


def find_label_issues(
    probs: Any,
    given_labels: Sequence[str],
    answers: Sequence[str],
    *,
    sample_ids: Sequence[str] | None = None,
) -> list[Issue]:
    """Confident learning (Northcutt et al. 2021), per sample: a likely error when some other class's probability
    reaches that class's threshold while the given label's stays below its own. Ranked by margin, most negative
    first; the suggestion is the most probable other class. Pure numpy; probs are out-of-sample [n, c]."""
    n = len(given_labels)
    p = _check_probs(probs, n, answers)
    if sample_ids is not None and len(sample_ids) != n:
        raise LabelCheckError(f"label check: {len(sample_ids)} sample IDs for {n} labels")
    if n == 0:
        return []
    given = _label_index(given_labels, answers)
    t = class_thresholds(p, given, len(answers))
    rows = np.arange(n)
    self_conf = p[rows, given]
    other = p.copy()
    other[rows, given] = -np.inf
    flagged = (other >= t[None, :]).any(1) & (self_conf < t[given])
    suggested = other.argmax(1)
    margin = self_conf - other[rows, suggested]
    ids = list(sample_ids) if sample_ids is not None else [str(i) for i in range(n)]
    hits = np.flatnonzero(flagged)
    order = hits[np.lexsort((np.asarray(ids, dtype=object)[hits].astype(str), margin[hits]))]
    return [Issue(int(i), ids[i], answers[given[i]], answers[suggested[i]], float(self_conf[i]),
                  float(p[i, suggested[i]]), float(margin[i]), float(t[given[i]])) for i in order]


def _entries(ledger: Any) -> list[dict[str, Any]]:
    return ledger.entries() if hasattr(ledger, "entries") else [dict(e) for e in ledger]


def label_issue_table(issues: Sequence[Issue], ledger: Any) -> list[dict[str, Any]]:
    """One row per issue, with who gave the label and from which file (from the ledger; `ledger` is a Ledger or
    its entries). Labels that never went through the ledger (the dataset's train split) show origin "dataset"."""
    current: dict[str, dict[str, Any]] = {}
    for e in _entries(ledger):
        if "sample_id" in e:
            current[e["sample_id"]] = e
    table = []
    for rank, iss in enumerate(issues, 1):
        e = current.get(iss.sample_id)
        row: dict[str, Any] = {
            "rank": rank, "sample_id": iss.sample_id, "given_label": iss.given_label,
            "suggested_label": iss.suggested_label, "score": round(iss.margin, 6),
            "given_prob": round(iss.given_prob, 6), "suggested_prob": round(iss.suggested_prob, 6),
            "threshold": round(iss.threshold, 6),
        }
        if e is None:
            row |= {"annotators": [], "source_file": "", "round": None, "origin": "dataset", "entry_id": None}
        else:
            voters = [v["annotator"] for v in e.get("votes") or []] or [a for a in e["annotator"].split(",") if a]
            row |= {"annotators": sorted(set(voters)), "source_file": e["source_file"], "round": e["round"],
                    "origin": e["kind"], "entry_id": e.get("entry_id")}
            if e["label"] != iss.given_label:
                # The ledger moved on since the probabilities were computed: the issue may already be fixed.
                row["ledger_label"] = e["label"]
        table.append(row)
    return table


def relabel_queued(artifacts: str | os.PathLike[str], before_round: int) -> dict[int, list[str]]:
    """Round → the sample IDs its relabel queue sent back to annotators, for rounds before `before_round`."""
    out = {}
    for d in sorted(Path(artifacts).glob("rounds/[0-9][0-9][0-9]/relabel")):
        r = int(d.parent.name)
        if r >= before_round:
            continue
        try:
            read_manifest(d)
        except ArtifactError:
            continue  # a queue whose write never finished was never handed out
        out[r] = [row["sample_id"] for row in read_jsonl(d / RELABEL_TABLE)]
    return out


def labels_spent(n_labeled: int, artifacts: str | os.PathLike[str], before_round: int) -> int:
    """Labels paid for before round `before_round`: the labeled samples plus every re-label task sent back (a
    re-label costs an annotator's time whether it changes the label or confirms it); rounds.label_budget counts this."""
    return n_labeled + sum(len(ids) for ids in relabel_queued(artifacts, before_round).values())


def annotator_agreement(ledger_entries: Any, oos_suggestions: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Per annotator: n votes on samples several people labeled, the share agreeing with the majority, and the
    share of all their labels agreeing with the out-of-sample model (n_model of them had a model suggestion).

    A confused annotator shows up low on both; one low only against the model may be right where the model is not.
    """
    stats: dict[str, dict[str, float]] = {}

    def s(who: str) -> dict[str, float]:
        return stats.setdefault(who, {"n": 0, "majority": 0, "n_model": 0, "model": 0})

    for e in _entries(ledger_entries):
        sid = e.get("sample_id")
        votes = e.get("votes") or [{"annotator": a, "label": e["label"]} for a in e["annotator"].split(",") if a]
        for v in votes:
            st = s(v["annotator"])
            if e.get("votes"):
                st["n"] += 1
                st["majority"] += v["label"] == e["label"]
            if sid in oos_suggestions:
                st["n_model"] += 1
                st["model"] += v["label"] == oos_suggestions[sid]
    return {
        who: {"n": int(st["n"]), "agree_majority": st["majority"] / st["n"] if st["n"] else None,
              "n_model": int(st["n_model"]), "agree_model": st["model"] / st["n_model"] if st["n_model"] else None}
        for who, st in sorted(stats.items())
    }


# ------------------------------------------------------------------------------------------------ relabel queue
RELABEL_TABLE = "relabel.jsonl"


def relabel_dir(artifacts: str | os.PathLike[str], round_index: int) -> Path:
    return Path(artifacts) / "rounds" / f"{round_index:03d}" / "relabel"


class RelabelLabelStudioExporter(LabelStudioExporter):
    """Two pre-annotations per task: the label the sample has now and the model's suggestion; the annotator picks."""

    def __init__(self, ctx: ExportContext, current: Mapping[str, tuple[str, float]]):
        super().__init__(ctx)
        self.current = current

    def _prediction(self, item: ExportItem) -> list[dict[str, Any]]:
        label, prob = self.current[item.sample_id]
        now = super()._prediction(dataclasses.replace(item, prediction=label, confidence=prob))
        suggested = super()._prediction(item)
        for preds, version in ((now, "current-label"), (suggested, "suggested-label")):
            for p in preds:
                p["model_version"] = version
        return now + suggested


def export_relabel(
    issues: Sequence[Issue],
    dataset: Any,
    cfg: ProjectConfig,
    out_dir: str | os.PathLike[str],
    *,
    round_index: int,
) -> Manifest | None:
    """Write the issues as a separate annotation task set (rounds/NNN/relabel/): Label Studio tasks with the
    current label and the suggestion as pre-annotations, plus the other configured formats and relabel.jsonl.
    Their import appends correction entries (labels.py); None when there is nothing to relabel."""
    if not issues:
        log.info("relabel queue for round %d: no likely label errors", round_index)
        return None
    out_dir = Path(out_dir)
    inputs = {"issues": digest_json([iss.to_dict() for iss in issues])}
    config = {"annotate": cfg.section("annotate"), "answers": cfg.data.answers}
    if (m := find_valid_manifest(out_dir, stage_key("relabel", LABELCHECK_VERSION, inputs, config))) is not None:
        return m  # already exported: annotators may be working on these files
    sel = [{"sample_id": iss.sample_id, "rank": r, "score": iss.margin, "prediction": iss.suggested_label,
            "confidence": iss.suggested_prob,
            "scores": {"margin": iss.margin, "given_prob": iss.given_prob, "suggested_prob": iss.suggested_prob}}
           for r, iss in enumerate(issues)]
    items = build_items(sel, dataset, image_source=cfg.annotate.export_images)
    ctx = ExportContext(round_index=round_index, answers=cfg.data.answers,
                        image_url_prefix=cfg.annotate.image_url_prefix,
                        export_relpath=_document_relpath(out_dir, cfg), model_version="labelcheck")
    current = {iss.sample_id: (iss.given_label, iss.given_prob) for iss in issues}
    out_dir.mkdir(parents=True, exist_ok=True)
    outputs: dict[str, str] = {}
    for name in dict.fromkeys(cfg.annotate.formats):
        exporter = RelabelLabelStudioExporter(ctx, current) if name == "label_studio" else EXPORTERS[name](ctx)
        outputs |= {rel: rel for rel in exporter.write(items, out_dir)}
    atomic_write_jsonl(out_dir / RELABEL_TABLE, [iss.to_dict() for iss in issues])
    outputs[RELABEL_TABLE] = RELABEL_TABLE
    log.info("relabel queue: %d likely label errors of round %d exported to %s", len(items), round_index, out_dir)
    return write_manifest(
        out_dir, stage="relabel", stage_version=LABELCHECK_VERSION, inputs=inputs, config=config, outputs=outputs,
        info={"round": round_index, "count": len(items)},
    )


# -------------------------------------------------------------------------------------------------- the report
def write_label_report(
    out_dir: str | os.PathLike[str],
    *,
    oos: OOSResult,
    table: Sequence[Mapping[str, Any]],
    agreement: Mapping[str, Mapping[str, Any]],
    answers: Sequence[str],
) -> Manifest:
    """issues.jsonl (the table), oos_probs.npz, agreement.json and a manifest (stage "labelcheck") in out_dir; an
    identical report already there is left as it is (a re-run never rewrites a finished stage's outputs)."""
    import io

    out_dir = Path(out_dir)
    inputs = {"oos": digest_json({"ids": oos.sample_ids, "probs": np.round(oos.probs, 6).tolist()}),
              "table": digest_json([dict(r) for r in table]),
              "agreement": digest_json({k: dict(v) for k, v in agreement.items()})}
    config = {"answers": list(answers), "method": oos.method}
    if (m := find_valid_manifest(out_dir, stage_key("labelcheck", LABELCHECK_VERSION, inputs, config))) is not None:
        return m
    atomic_write_jsonl(out_dir / "issues.jsonl", [dict(r) for r in table])
    buf = io.BytesIO()
    np.savez(buf, probs=oos.probs, folds=oos.folds, sample_ids=np.asarray(oos.sample_ids, dtype=str))
    atomic_write_bytes(out_dir / "oos_probs.npz", buf.getvalue())
    atomic_write_json(out_dir / "agreement.json", {k: dict(v) for k, v in agreement.items()})
    return write_manifest(
        out_dir, stage="labelcheck", stage_version=LABELCHECK_VERSION, inputs=inputs, config=config,
        outputs={"issues": "issues.jsonl", "oos_probs": "oos_probs.npz", "agreement": "agreement.json"},
        info={"method": oos.method, "checked": len(oos.sample_ids), "issues": len(table), **oos.info},
    )


def label_report_markdown(table: Sequence[Mapping[str, Any]], agreement: Mapping[str, Mapping[str, Any]], *,
                          method: str, checked: int, top: int = 10) -> str:
    """The round summary's "Label quality" section."""
    how = "k-fold adapters" if method == "kfold" else "the round's adapter on samples it did not train on"
    lines = ["## Label quality", "", f"{len(table)} likely label errors among {checked} labeled samples "
             f"(out-of-sample probabilities from {how}).", ""]
    if table:
        lines += ["| rank | sample | given | suggested | score | annotators | source |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['rank']} | {r['sample_id']} | {r['given_label']} | {r['suggested_label']} | "
                  f"{r['score']:.3f} | {', '.join(r['annotators']) or r['origin']} | "
                  f"{Path(r['source_file']).name} |" for r in table[:top]]
    if agreement:
        def pct(x: Any) -> str:
            return "–" if x is None else f"{100 * x:.0f}%"

        lines += ["", "| annotator | votes on shared samples | agree with majority | labels checked | "
                  "agree with model |", "|---|---|---|---|---|"]
        lines += [f"| {who} | {a['n']} | {pct(a['agree_majority'])} | {a['n_model']} | {pct(a['agree_model'])} |"
                  for who, a in agreement.items()]
    return "\n".join(lines)


def check_labels(
    cfg: ProjectConfig,
    labeled_rows: Sequence[Mapping[str, Any]],
    out_dir: str | os.PathLike[str],
    ledger: Any,
    *,
    adapter: str | os.PathLike[str] | None = None,
    trained_ids: Iterable[str] = (),
    hw: Any = None,
) -> Manifest:
    """One round's label check: out-of-sample probabilities (cfg.labelcheck.method; fold adapters under
    out_dir/oos), the confident-learning issues with who gave each label, annotator agreement, written by
    write_label_report to out_dir. `adapter` / `trained_ids` are for the heldout method (see out_of_sample_probs)."""
    answers = _answers(cfg)
    oos = out_of_sample_probs(cfg, labeled_rows, Path(out_dir) / "oos", adapter=adapter, trained_ids=trained_ids,
                              hw=hw)
    given = {r["sample_id"]: r["answer"] for r in labeled_rows}
    issues = find_label_issues(oos.probs, [given[s] for s in oos.sample_ids], answers, sample_ids=oos.sample_ids)
    table = label_issue_table(issues, ledger)
    agreement = annotator_agreement(ledger, oos.suggestions(answers))
    log.info("label check (%s): %d likely label errors among %d labeled samples checked", oos.method, len(issues),
             len(oos.sample_ids))
    return write_label_report(out_dir, oos=oos, table=table, agreement=agreement, answers=answers)


def issues_from_report(report_dir: str | os.PathLike[str]) -> list[Issue]:
    """The Issue list behind a report's issues.jsonl (the relabel export needs the probabilities, not just the table)."""
    out = []
    for row in read_jsonl(Path(report_dir) / "issues.jsonl"):
        out.append(Issue(row["rank"] - 1, row["sample_id"], row["given_label"], row["suggested_label"],
                         row["given_prob"], row["suggested_prob"], row["score"], row["threshold"]))
    return out
