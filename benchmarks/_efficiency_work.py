"""The label-efficiency benchmark's content-keyed work: train / evaluate / score steps cached under the work folder
(each recording the code version that made it), and one round's export → simulated annotator → import.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._efficiency_config import seeded
from benchmarks._results import code_version
from pipeline.config import ProjectConfig
from pipeline.store import MANIFEST_NAME, atomic_write_json, digest_json, find_valid_manifest, stage_key

log = logging.getLogger("label_efficiency")


@dataclass
class Data:
    prepared: Any  # datasets.Dataset: what export reads
    rows: dict[str, dict[str, Any]]  # sample_id → {sample_id, prepared, question}
    pool: list[str]  # eligible pool IDs, sorted
    test: list[dict[str, Any]]  # test rows with their answer
    known: set[str]
    digest: str  # prepared dataset's content digest
    counts: dict[str, int] = field(default_factory=dict)
    truth: dict[str, str] = field(default_factory=dict)  # sample_id → answer (long-tail pools, probe labels)


@dataclass
class Adapter:
    dir: Path | None  # None: the base model
    digest: str


@dataclass
class Timer:
    seconds: dict[str, float] = field(default_factory=Counter)
    computed: dict[str, int] = field(default_factory=Counter)
    reused: dict[str, int] = field(default_factory=Counter)
    # What the reused results cost when they were computed (as their manifests recorded it): a run that reads a
    # full cache still says what the measurement took.
    recorded: dict[str, float] = field(default_factory=Counter)
    # The code version (commit, "+dirty" when the tree was) that made each cached entry this run used, computed or
    # reused: a result assembled from entries of several versions says so (benchmarks/_results.py).
    versions: dict[str, int] = field(default_factory=Counter)

    def add(self, what: str, t0: float, computed: bool, recorded_s: float | None = None) -> None:
        if computed:
            self.seconds[what] += time.monotonic() - t0
            self.computed[what] += 1
        else:
            self.reused[what] += 1
            self.recorded[what] += recorded_s or 0.0

    def summary(self) -> dict[str, Any]:
        keys = sorted(set(self.computed) | set(self.reused))
        out = {k: {"computed": self.computed[k], "reused": self.reused[k], "seconds": round(self.seconds[k], 1),
                   "mean_s": round(self.seconds[k] / self.computed[k], 2) if self.computed[k] else None}
               for k in keys}
        for k, s in self.recorded.items():
            if s:
                out[k]["reused_recorded_seconds"] = round(s, 1)
        return out


def model_digest(cfg: ProjectConfig) -> str:
    """Content digest of the base model's folder (built first when it is a missing tiny model), so cached adapters,
    scores and evaluations never outlive the weights they were made with."""
    from pipeline.model.tiny import make_tiny_model
    from pipeline.store import digest_path

    path = Path(cfg.model.name_or_path)
    if not path.is_absolute():
        return cfg.model.name_or_path  # a hub ID: its revision is the user's to pin
    if not path.exists() and cfg.model.build_tiny_if_missing and cfg.model.family:
        make_tiny_model(cfg.model.family, path)
    return digest_path(path)


class Work:
    """Content-keyed train / evaluate / score steps of the experiment, each cached under the work folder."""

    def __init__(self, cfg: ProjectConfig, data: Data):
        self.cfg, self.data, self.art = cfg, data, cfg.artifacts
        self.model = model_digest(cfg)
        self.timer = Timer()
        self.code = code_version()
        self._loaded: tuple[str, Any] | None = None

    # Every entry this benchmark computes gets a small record beside the cache (its own file, so two runs filling
    # one cache never race on a shared one): the code version that made it and what it cost. Entries cached before
    # these records existed count as "unrecorded".
    def _made_by(self, kind: str, key: str) -> Path:
        return self.art / "made_by" / f"{kind}-{key[:16]}.json"

    def made(self, kind: str, key: str, seconds: float | None) -> None:
        atomic_write_json(self._made_by(kind, key), {"code_version": self.code,
                                                     "seconds": None if seconds is None else round(seconds, 2)})
        self.timer.versions[self.code] += 1

    def reused(self, kind: str, key: str) -> float | None:
        """The reused entry's recorded seconds (None when unknown); counts its code version."""
        try:
            rec = json.loads(self._made_by(kind, key).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            rec = {}
        self.timer.versions[rec.get("code_version") or "unrecorded"] += 1
        return rec.get("seconds")

    def _load(self, adapter: Adapter) -> Any:
        from pipeline.model.loading import load_model

        if self._loaded is None or self._loaded[0] != adapter.digest:
            self._loaded = None
            gc.collect()
            self._loaded = (adapter.digest, load_model(self.cfg.model, adapter=adapter.dir))
        return self._loaded[1]

    def train(self, cfg: ProjectConfig, labels: dict[str, str], init: Adapter | None = None) -> Adapter:
        """An adapter for `labels`; with train.init warm, continued from `init` (the previous round's)."""
        from pipeline.model.train import TrainSpec, train_adapter

        init = init if cfg.train.init == "warm" else None
        rows = [{**self.data.rows[s], "answer": labels[s]} for s in sorted(labels)]
        key = {"prepared": self.data.digest, "labels": sorted(labels.items()), "seed": cfg.seed,
               "model": cfg.section("model"), "weights": self.model, "train": cfg.section("train")}
        key = digest_json({**key, "init": init.digest} if init else key)
        out = self.art / "train" / key[:16]
        done = (out / MANIFEST_NAME).is_file()
        t0 = time.monotonic()
        res = train_adapter(TrainSpec.of(cfg), rows, out, init_adapter=init and init.dir, progress=False)
        if done:
            self.reused("train", key)
        else:
            self.made("train", key, time.monotonic() - t0)
        self.timer.add("train", t0, computed=not done, recorded_s=res.info.get("seconds"))
        return Adapter(res.adapter_dir, res.manifest.outputs["adapter"].digest)

    def evaluate(self, adapter: Adapter, metric: str = "accuracy") -> dict[str, Any]:
        """{"accuracy" (the benchmark's metric), "metrics" (all of them), "recall": {answer: recall}, "predictions"}
        on the test split."""
        from pipeline.evaluate import evaluate_model

        test = self.data.test
        key = {"v": 3, "adapter": adapter.digest, "test": [r["sample_id"] for r in test],
               "answers": self.cfg.data.answers, "model": self.cfg.section("model"), "weights": self.model}
        key = digest_json(key if metric == "accuracy" else {**key, "metric": metric})
        path = self.art / "eval" / f"{key[:16]}.json"
        if path.is_file():
            self.timer.add("evaluate", 0.0, computed=False, recorded_s=self.reused("evaluate", key))
            return json.loads(path.read_text(encoding="utf-8"))
        t0 = time.monotonic()
        res = evaluate_model(self._load(adapter), test, self.cfg.data.answers,
                             batch_size=self.cfg.select.score_batch_size, max_new_tokens=self.cfg.model.max_new_tokens)
        preds = [p["prediction"] for p in res["predictions"]]
        refs = [r["answer"] for r in test]
        # The predictions: successive adapters' agreement on these never-selected rows is the label-free stop
        # signal benchmarks/annotators.py evaluates (the rule reads the predictions only, never `refs`).
        out = {"accuracy": res["metrics"][metric], "recall": per_class_recall(preds, refs), "n": res["n"],
               "adapter": adapter.digest, "predictions": preds}
        if metric != "accuracy":
            out["metrics"] = res["metrics"]
        atomic_write_json(path, out)
        self.made("evaluate", key, time.monotonic() - t0)
        self.timer.add("evaluate", t0, computed=True)
        return out

    def score(self, adapter: Adapter, ids: list[str], mc_passes: int, seed: int) -> Any:
        from pipeline.score_stage import SCORE_VERSION
        from pipeline.scoring import load_scores, make_scorer, save_scores

        sel = self.cfg.select
        seed = seed if mc_passes else 0  # only MC dropout draws random numbers
        config = {"answers": self.cfg.data.answers, "length_normalize": sel.length_normalize,
                  "mc_dropout_passes": mc_passes, "seed": seed, "model": self.cfg.section("model"),
                  "weights": self.model}
        if not self.cfg.data.answers:  # generation: its batches and budget shape the answers and MC draws
            config |= {"score_batch_size": sel.score_batch_size, "max_new_tokens": self.cfg.model.max_new_tokens}
        inputs = {"adapter": adapter.digest, "prepared": self.data.digest, "ids": digest_json(ids)}
        key = stage_key("score", SCORE_VERSION, inputs, config)
        folder = self.art / "scores" / key[:16]
        if find_valid_manifest(folder, key) is not None:
            self.timer.add("score", 0.0, computed=False, recorded_s=self.reused("score", key))
            return load_scores(folder)
        t0 = time.monotonic()
        scorer = make_scorer(self._load(adapter), self.cfg.data.answers, length_normalize=sel.length_normalize,
                             max_new_tokens=self.cfg.model.max_new_tokens)
        res = scorer.score([self.data.rows[s] for s in ids], batch_size=sel.score_batch_size, mc_passes=mc_passes,
                           seed=seed)
        save_scores(res, folder, version=SCORE_VERSION, inputs=inputs, config=config)
        self.made("score", key, time.monotonic() - t0)
        self.timer.add("score_mc" if mc_passes else "score", t0, computed=True)
        return res


def annotate(cfg: ProjectConfig, data: Data, run_dir: Path, selection: list[dict[str, Any]], round_index: int,
             noise: float, timer: Timer, asked: set[str]) -> dict[str, str]:
    """Export → simulated annotator (a Label Studio export in the inbox) → import into the run's ledger; returns
    the ledger's labels of the samples asked so far (`asked` grows by this selection). Re-running a round writes
    the same bytes, which the importer skips; a resumed run's ledger may already hold later rounds' labels."""
    from pipeline.annotation.export import export_dir, export_selection
    from pipeline.annotation.labels import import_labels
    from pipeline.annotation.ledger import Ledger, ledger_path
    from pipeline.annotation.simulate import simulate_annotator

    t0 = time.monotonic()
    run_cfg = seeded(cfg, cfg.seed, run_dir)
    out = export_dir(run_dir, round_index)
    export_selection(selection, data.prepared, run_cfg.annotate, run_cfg.data.answers, run_cfg.artifacts, out, round_index=round_index)
    answered = simulate_annotator(out, cfg.data.ground_truth, run_dir / "inbox", round_index=round_index,
                                  noise=noise, seed=cfg.seed)
    ledger = Ledger(ledger_path(run_dir))
    rep = import_labels(answered, known_ids=data.known, answers=cfg.data.answers, ledger=ledger,
                        round_index=round_index, rejections_dir=run_dir / "rejections")
    if not rep.already_imported and (rep.rejected or rep.skipped_cancelled):
        log.warning("%s round %d: %s", run_dir.name, round_index, rep.summary())
    timer.add("annotate", t0, computed=not rep.already_imported)
    asked.update(r["sample_id"] for r in selection)
    return {sid: label for sid, label in ledger.labels().items() if sid in asked}


def selection_rows(sel: Any, scores: Any, adapter: Adapter, answers: list[str] | None) -> list[dict[str, Any]]:
    """Selection rows as the select stage writes them: rank, score, the model's answer and confidence (when the
    round scored the pool; open answers: the greedy answer, confidence exp(mean token log-prob))."""
    from pipeline.scoring import predictions

    rows = sel.rows()
    if scores is None or (scores.probs is None and scores.answers is None):
        return [{**row, "adapter_digest": adapter.digest} for row in rows]
    pred, conf = predictions(scores, answers)
    for row, i in zip(rows, sel.positions, strict=True):
        row.update(adapter_digest=adapter.digest, confidence=conf[i], prediction=pred[i])
    return rows


def per_class_recall(preds: list[Any], refs: list[str]) -> dict[str, float]:
    """Recall of every reference answer (how many of its test rows the model got right)."""
    out: dict[str, float] = {}
    for a in sorted(set(refs)):
        rows = [p == r for p, r in zip(preds, refs, strict=True) if r == a]
        out[a] = round(sum(rows) / len(rows), 4)
    return out
