"""Label efficiency: how many labels each active-learning strategy needs, against random picks, through the real pipeline.

Everything goes through tamis' library (no Prefect): ingest → preprocess → quality flags, a 4-bit QLoRA tiny model,
and per round: train an adapter (fixed step budget, continuing the previous round's) → evaluate on the test split →
(score the pool when the round's selector reads uncertainty) → select a batch → export it (Label Studio tasks +
images) → the simulated annotator answers it as a Label Studio export → import into the run's label ledger.

The protocol (what makes the ratios fair):
- the baseline `random` is random from the first label; every other strategy brings its own cold start (a coverage
  selector on the selection embeddings, or random for pure uncertainty sampling);
- seeds are paired: within a seed every strategy sees the same pool, test split, selection space and training seed;
- small steps (`initial` + `rounds` × `batch` labels) and a full-data reference trained on every pool label with
  the same step budget per round, over the same seeds;
- per strategy: labels to reach 90 % / 95 % of the full-data accuracy (linear interpolation on the mean curve),
  the ratio to random's with a paired bootstrap 95 % interval (seeds resampled together with their full-data run),
  the area under the curve with its interval;
- a long-tailed variant (`longtail`): the pool subsampled so class sizes decay geometrically (imbalance 20:1 by
  default, a seeded class order), the test split unchanged (balanced), plus each strategy's recall of the rarest
  class at the last round;
- a reference learner: the same protocol with a logistic-regression probe on the selection embeddings as the model
  (milliseconds per round), which tells selection quality apart from the tiny model's learning noise.

Work is cached by content under the project's artifacts folder (embeddings, adapters, scores, evaluations), so a
killed run resumes where it stopped, and runs restricted with --seeds / --variants (e.g. two processes on two cores)
fill one cache that a final full run then reads.

    python benchmarks/label_efficiency.py --json-out benchmarks/results/label_efficiency.json
    python benchmarks/label_efficiency.py --quick          # 3 strategies, 2 seeds, 2 rounds: a few minutes
    python benchmarks/label_efficiency.py --config my.yaml # any image-classification-style manifest
    python benchmarks/label_efficiency.py --config configs/label_efficiency_open.yaml \
        --json-out benchmarks/results/label_efficiency_open.json   # open answers (data.answers: null)

Open answers (`project.data.answers: null`): the model generates its answers, the curve's metric is token F1 (SQuAD
normalisation; exact match and edit similarity are recorded beside it), the pool is scored by generation (greedy
answer + per-token entropies, MC-dropout answers for answer_disagreement), the export is a Label Studio TextArea and
the simulated annotator types the ground-truth answer. The result keys are the closed-set ones: "accuracy" fields
hold the benchmark's `metric` (named at the top of the JSON).
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import logging
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "NO_ALBUMENTATIONS_UPDATE": "1", "TOKENIZERS_PARALLELISM": "false",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1"}.items():
    os.environ.setdefault(_k, _v)

import numpy as np  # noqa: E402
import yaml  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator  # noqa: E402

from pipeline.config import ProjectConfig, ScheduleConfig, parse_config  # noqa: E402
from pipeline.errors import ConfigError, DataError  # noqa: E402
from pipeline.selection import Space  # noqa: E402
from pipeline.store import (  # noqa: E402
    MANIFEST_NAME,
    atomic_write_bytes,
    atomic_write_json,
    digest_json,
    find_valid_manifest,
    stage_key,
)

log = logging.getLogger("label_efficiency")
DEFAULT_CONFIG = ROOT / "configs" / "label_efficiency.yaml"
BENCH_VERSION = "2"
COLD_STARTS = ("random", "typical", "typiclust", "probcover", "maxherding")
VARIANTS = ("main", "longtail")


# ------------------------------------------------------------------------------------------------ config
class StrategySpec(BaseModel):
    """One strategy: its own cold start, then per round `strategy` × `diversity`, or a budget-aware schedule."""

    model_config = ConfigDict(extra="forbid")
    cold_start: Literal["random", "typical", "typiclust", "probcover", "maxherding"] = "random"
    strategy: str = "random"
    diversity: str = "top_k"
    options: dict[str, Any] = Field(default_factory=dict)
    schedule: ScheduleConfig | None = None

    @model_validator(mode="after")
    def _known(self) -> StrategySpec:
        from pipeline.strategies import HEURISTICS, SELECTORS

        if self.strategy not in HEURISTICS:
            raise ValueError(f"strategy {self.strategy!r} is not one of {sorted(HEURISTICS)}")
        if self.diversity not in SELECTORS:
            raise ValueError(f"diversity {self.diversity!r} is not one of {sorted(SELECTORS)}")
        return self

    @property
    def is_random_baseline(self) -> bool:
        return (self.strategy, self.diversity, self.cold_start, self.schedule) == ("random", "top_k", "random", None)


class LongTail(BaseModel):
    model_config = ConfigDict(extra="forbid")
    imbalance: float = Field(default=20.0, ge=1)


class Bench(BaseModel):
    model_config = ConfigDict(extra="forbid")
    build_demo_digits: bool = False
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2, 3, 4], min_length=1)
    initial: int = Field(default=20, ge=1)
    batch: int = Field(default=20, ge=1)
    rounds: int = Field(default=9, ge=1)
    train_steps: int | None = Field(default=None, ge=1)
    test_size: int | None = Field(default=None, ge=1)
    pool_size: int | None = Field(default=None, ge=2)
    annotator_noise: float = Field(default=0.0, ge=0, le=1)
    strategies: dict[str, StrategySpec]
    longtail: LongTail | None = Field(default_factory=LongTail)
    reference_learner: bool = True
    bootstrap: int = Field(default=2000, ge=100)
    # The curve's metric: accuracy (closed answer sets) or one of the open-answer metrics of pipeline.evaluate.
    metric: Literal["accuracy", "exact_match", "token_f1", "edit_similarity"] | None = None
    quick: dict[str, Any] = Field(default_factory=dict)

    @field_validator("strategies")
    @classmethod
    def _has_random(cls, v: dict[str, StrategySpec]) -> dict[str, StrategySpec]:
        if not any(s.is_random_baseline for s in v.values()):
            raise ValueError("needs the baseline {cold_start: random, strategy: random, diversity: top_k}: ratios are "
                             "measured against it")
        return v

    @property
    def baseline(self) -> str:
        return next(n for n, s in self.strategies.items() if s.is_random_baseline)


def load_bench_config(path: str | os.PathLike[str], *, quick: bool = False) -> tuple[ProjectConfig, Bench]:
    """(project config, benchmark parameters) from the YAML; `quick` applies its `benchmark.quick` overrides."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: benchmark config not found; pass an existing YAML file with --config")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict) or set(data) - {"project", "benchmark"}:
        extra = sorted(set(data) - {"project", "benchmark"}) if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"{path}: the top level must hold only 'project' and 'benchmark', got {extra}")
    project = parse_config(data.get("project"), origin=f"{path} (project)", root=ROOT)
    raw = dict(data.get("benchmark") or {})
    if quick:
        over = dict(raw.get("quick") or {})
        keep = over.pop("strategies", None)
        if keep is not None:
            missing = sorted(set(keep) - set(raw.get("strategies") or {}))
            if missing:
                raise ConfigError(f"{path}: benchmark.quick.strategies names {missing}, which benchmark.strategies "
                                  "does not define")
            raw["strategies"] = {k: v for k, v in raw["strategies"].items() if k in keep}
        raw.update(over)
    try:
        bench = Bench.model_validate(raw)
    except ValidationError as exc:
        lines = "\n".join(f"  benchmark.{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')} "
                          f"(got {e.get('input')!r})" for e in exc.errors())
        raise ConfigError(f"{path}: invalid benchmark parameters\n{lines}") from None
    if bench.train_steps is not None:
        project.train.max_steps = bench.train_steps
    if project.train.max_steps is None:
        raise ConfigError(f"{path}: project.train.max_steps is not set; the benchmark compares strategies at a fixed "
                          "step budget per round (e.g. 80)")
    if bench.metric is None:
        bench.metric = "accuracy" if project.data.answers else "token_f1"
    if not project.data.answers:
        if bench.metric == "accuracy":
            raise ConfigError(f"{path}: benchmark.metric accuracy needs a closed answer set (project.data.answers); "
                              "open answers are measured by exact_match, token_f1 or edit_similarity")
        if bench.longtail is not None or bench.reference_learner:
            raise ConfigError(f"{path}: open answers (project.data.answers: null) have no classes: set "
                              "benchmark.longtail: null and benchmark.reference_learner: false")
        bad = [n for n, sp in bench.strategies.items() if sp.strategy not in ("random", "token_entropy",
                                                                                "answer_disagreement")]
        if bad:
            raise ConfigError(f"{path}: strategies {bad} read class probabilities, which open answers do not have; "
                              "use random, token_entropy or answer_disagreement")
    elif bench.metric != "accuracy":
        raise ConfigError(f"{path}: benchmark.metric {bench.metric!r} is for open answers; a closed answer set "
                          "(project.data.answers) is measured by accuracy")
    if project.data.ground_truth is None:
        raise ConfigError(f"{path}: project.data.ground_truth is not set; the simulated annotator answers from it")
    if not project.data.sources:
        raise ConfigError(f"{path}: project.data.sources is empty; point it at the data set's manifest")
    return project, bench


def seeded(cfg: ProjectConfig, seed: int, artifacts: Path | None = None) -> ProjectConfig:
    out = cfg.model_copy(deep=True)
    out.seed = seed
    if artifacts is not None:
        out.paths.artifacts = artifacts
    return out


# ------------------------------------------------------------------------------------------------ data
@dataclass
class Data:
    prepared: Any  # datasets.Dataset: what export reads
    rows: dict[str, dict[str, Any]]  # sample_id → {sample_id, prepared, question}
    pool: list[str]  # eligible pool IDs, sorted
    test: list[dict[str, Any]]  # test rows with their answer
    known: set[str]
    digest: str  # prepared dataset's content digest
    counts: dict[str, int] = field(default_factory=dict)
    truth: dict[str, str] = field(default_factory=dict)  # pool sample_id → answer (long-tail pools, probe labels)


def _stratified(rows: list[dict[str, Any]], n: int | None, seed: int) -> list[dict[str, Any]]:
    """`n` rows spread evenly over the answers (seeded), or all of them."""
    if n is None or n >= len(rows):
        return rows
    rng = np.random.default_rng(seed)
    by: dict[str, list[dict[str, Any]]] = {}
    for i in rng.permutation(len(rows)):
        by.setdefault(rows[i]["answer"], []).append(rows[i])
    out: list[dict[str, Any]] = []
    while len(out) < n:
        for group in by.values():
            if group and len(out) < n:
                out.append(group.pop())
    return sorted(out, key=lambda r: r["sample_id"])


def prepare_data(cfg: ProjectConfig, bench: Bench) -> Data:
    """Ingest → preprocess → quality, each reused from the work folder when its manifest matches."""
    import datasets

    from pipeline import quality as qual
    from pipeline.data.ingest import INGEST_VERSION, ingest, load_ingested, source_digest
    from pipeline.preprocess import PREPROCESS_VERSION, load_prepared, preprocess_dataset, resolve_size

    src = cfg.data.sources[0]
    if bench.build_demo_digits and not src.path.is_file():
        from pipeline.data.demo import write_digits

        log.info("building the digits demo data set in %s", src.path.parent)
        write_digits(src.path.parent, open_answers=not cfg.data.answers)
    art = cfg.artifacts
    sd = source_digest(cfg.data)
    ing = art / "ingest" / sd[:16]
    m = find_valid_manifest(ing, stage_key("ingest", INGEST_VERSION, {"sources": sd}, cfg.section("data")))
    m = m or ingest(cfg, ing, digest=sd)
    size = resolve_size(cfg.preprocess, cfg.model)
    pconf = {**cfg.section("preprocess"), "size": size, "max_pixels": cfg.data.max_image_pixels}
    inputs = {"dataset": m.outputs["dataset"].digest}
    prep = art / "prepare" / stage_key("preprocess", PREPROCESS_VERSION, inputs, pconf)[:16]
    pm = find_valid_manifest(prep, stage_key("preprocess", PREPROCESS_VERSION, inputs, pconf))
    pm = pm or preprocess_dataset(load_ingested(ing), cfg.preprocess, prep, size=size,
                                  max_pixels=cfg.data.max_image_pixels, inputs=inputs)
    ds = load_prepared(prep)
    qin = {"dataset": pm.outputs["dataset"].digest}
    qkey = stage_key(qual.STAGE, qual.QUALITY_VERSION, qin, cfg.section("quality"))
    qdir = art / "quality" / qkey[:16]
    if find_valid_manifest(qdir, qkey) is None:
        qual.assess_quality(datasets.load_from_disk(str(pm.path_of("dataset", prep))), cfg.quality, qdir, inputs=qin)
    excluded = qual.excluded_ids(qdir)

    cols = ds.select_columns(["sample_id", "prepared", "question", "answer", "split"])
    rows, pool, test = {}, [], []
    for r in cols:
        rows[r["sample_id"]] = {"sample_id": r["sample_id"], "prepared": r["prepared"], "question": r["question"]}
        if r["split"] == "test" and r["answer"] is not None:
            test.append(r)
        elif r["split"] == "pool" and r["sample_id"] not in excluded:
            pool.append(r["sample_id"])
    pool.sort()
    if bench.pool_size is not None and bench.pool_size < len(pool):
        pick = np.random.default_rng(cfg.seed).choice(len(pool), bench.pool_size, replace=False)
        pool = sorted(pool[i] for i in pick)
    test = _stratified(test, bench.test_size, cfg.seed)
    need = bench.initial + bench.rounds * bench.batch
    from pipeline.annotation.simulate import load_ground_truth

    truth = {s: a for s, a in load_ground_truth(cfg.data.ground_truth)[0].items() if s in rows}
    if len(pool) < need:
        raise DataError(f"Pool too small: {len(pool)} eligible pool samples, the benchmark labels {need} "
                        f"({bench.initial} + {bench.rounds} rounds × {bench.batch}); lower benchmark.rounds/batch")
    if not test:
        raise DataError(f"{src.path}: no test rows with an answer (split: test); the benchmark evaluates on them")
    counts = {"prepared": len(ds), "pool": len(pool), "test": len(test), "quality_excluded": len(excluded),
              "ingest_quarantined": m.info["counts"].get("quarantined", 0)}
    log.info("data: %s", counts)
    return Data(ds, rows, pool, test, set(rows), pm.outputs["dataset"].digest, counts, truth)


def longtail_pool(pool: list[str], truth: dict[str, str], answers: list[str], imbalance: float,
                  seed: int) -> list[str]:
    """A seeded sub-pool whose class sizes decay geometrically from the smallest class's full size down to
    1/`imbalance` of it, in a seeded class order (which class is rarest changes with the seed)."""
    rng = np.random.default_rng(seed)
    by = {a: sorted(s for s in pool if truth.get(s) == a) for a in answers}
    present = [a for a in answers if by[a]]
    order = [present[i] for i in rng.permutation(len(present))]
    top = min(len(by[a]) for a in present)
    out: list[str] = []
    for rank, a in enumerate(order):
        n = max(1, round(top * imbalance ** (-rank / max(1, len(order) - 1))))
        out += [by[a][i] for i in rng.choice(len(by[a]), n, replace=False)]
    return sorted(out)


# ------------------------------------------------------------------------------------------------ work
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
        self._loaded: tuple[str, Any] | None = None

    def _load(self, adapter: Adapter) -> Any:
        from pipeline.model.loading import load_model

        if self._loaded is None or self._loaded[0] != adapter.digest:
            self._loaded = None
            gc.collect()
            self._loaded = (adapter.digest, load_model(self.cfg.model, adapter=adapter.dir))
        return self._loaded[1]

    def train(self, cfg: ProjectConfig, labels: dict[str, str], init: Adapter | None = None) -> Adapter:
        """An adapter for `labels`; with train.init warm, continued from `init` (the previous round's)."""
        from pipeline.model.train import train_adapter

        init = init if cfg.train.init == "warm" else None
        rows = [{**self.data.rows[s], "answer": labels[s]} for s in sorted(labels)]
        key = {"prepared": self.data.digest, "labels": sorted(labels.items()), "seed": cfg.seed,
               "model": cfg.section("model"), "weights": self.model, "train": cfg.section("train")}
        key = digest_json({**key, "init": init.digest} if init else key)
        out = self.art / "train" / key[:16]
        done = (out / MANIFEST_NAME).is_file()
        t0 = time.monotonic()
        res = train_adapter(cfg, rows, out, init_adapter=init and init.dir, progress=False)
        self.timer.add("train", t0, computed=not done, recorded_s=res.info.get("seconds"))
        return Adapter(res.adapter_dir, res.manifest.outputs["adapter"].digest)

    def evaluate(self, adapter: Adapter, metric: str = "accuracy") -> dict[str, Any]:
        """{"accuracy" (the benchmark's metric), "metrics" (all of them), "recall": {answer: recall}} on the test
        split."""
        from pipeline.evaluate import evaluate_model

        test = self.data.test
        key = {"v": 2, "adapter": adapter.digest, "test": [r["sample_id"] for r in test],
               "answers": self.cfg.data.answers, "model": self.cfg.section("model"), "weights": self.model}
        key = digest_json(key if metric == "accuracy" else {**key, "metric": metric})
        path = self.art / "eval" / f"{key[:16]}.json"
        if path.is_file():
            self.timer.add("evaluate", 0.0, computed=False)
            return json.loads(path.read_text(encoding="utf-8"))
        t0 = time.monotonic()
        res = evaluate_model(self._load(adapter), test, self.cfg.data.answers,
                             batch_size=self.cfg.select.score_batch_size, max_new_tokens=self.cfg.model.max_new_tokens)
        preds = [p["prediction"] for p in res["predictions"]]
        refs = [r["answer"] for r in test]
        out = {"accuracy": res["metrics"][metric], "recall": per_class_recall(preds, refs), "n": res["n"],
               "adapter": adapter.digest}
        if metric != "accuracy":
            out["metrics"] = res["metrics"]
        atomic_write_json(path, out)
        self.timer.add("evaluate", t0, computed=True)
        return out

    def score(self, adapter: Adapter, ids: list[str], mc_passes: int, seed: int) -> Any:
        from pipeline.scoring import SCORE_VERSION, load_scores, make_scorer, save_scores

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
            self.timer.add("score", 0.0, computed=False)
            return load_scores(folder)
        t0 = time.monotonic()
        scorer = make_scorer(self._load(adapter), self.cfg.data.answers, length_normalize=sel.length_normalize,
                             max_new_tokens=self.cfg.model.max_new_tokens)
        res = scorer.score([self.data.rows[s] for s in ids], batch_size=sel.score_batch_size, mc_passes=mc_passes,
                           seed=seed)
        save_scores(res, folder, inputs=inputs, config=config)
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
    export_selection(selection, data.prepared, run_cfg, out, round_index=round_index)
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
    from pipeline.selection import predictions

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


# ------------------------------------------------------------------------------------------------ selection space
def selection_space(cfg: ProjectConfig, data: Data, pool: list[str], work: Work) -> tuple[Space | None, float]:
    """Fit the configured selection embeddings on `pool`'s images only (never labels, never the test split), then
    embed the pool and the test rows; cached by the rows' content and the embeddings config. Returns the space
    (None for source "model": the current adapter's embeddings) and the fit's seconds."""
    from pipeline.embeddings import compute_selection_embeddings, embeddings_key, load_selection_embeddings

    source = cfg.select.embeddings.source
    if source == "model":
        return None, 0.0
    test_ids = [r["sample_id"] for r in data.test]
    keep = set(pool) | set(test_ids)
    idx = [i for i, s in enumerate(data.prepared["sample_id"]) if s in keep]
    # Only the pool's rows keep split "pool", so only they are fitted on.
    sub = data.prepared.select(idx)
    inputs = {"prepared": data.digest, "rows": digest_json(sorted(keep)), "pool": digest_json(pool)}
    key = embeddings_key(cfg, inputs)
    out = work.art / "embeddings" / key[:16]
    t0 = time.monotonic()
    computed = find_valid_manifest(out, key) is None
    if computed:
        compute_selection_embeddings(cfg, sub, out, inputs=inputs)
    work.timer.add("embeddings", t0, computed=computed)
    ids, emb = load_selection_embeddings(out)
    info = json.loads((out / MANIFEST_NAME).read_text(encoding="utf-8")).get("info", {})
    return Space(ids, emb, source), float(info.get("seconds", 0.0))


def phase_of(spec: StrategySpec, labeled: int, n_classes: int, newest: list[float]) -> tuple[str, str, str]:
    """(strategy, diversity, phase) for a round after the cold start."""
    from pipeline.strategies.schedule import choose_phase

    if spec.schedule is None:
        return spec.strategy, spec.diversity, "fixed"
    ph = choose_phase(spec.schedule, strategy=spec.strategy, diversity=spec.diversity, labeled=labeled,
                      n_classes=n_classes, newest_accuracy=newest)
    return ph.strategy, ph.diversity, ph.name


def needs_scores(strategy: str, diversity: str) -> bool:
    from pipeline.strategies import SELECTORS

    return strategy != "random" or SELECTORS[diversity].needs_scores


def pick(strategy: str, diversity: str, options: dict[str, Any], *, pool: list[str], labeled: set[str], k: int,
         seed: int, space: Space | None, probs: np.ndarray | None, model_emb: np.ndarray | None,
         n_classes: int) -> Any:
    """One batch from `pool` minus `labeled`; embeddings from the selection space (or the model's when the space is
    "model"); labeled samples seed k-center and the coverage selectors."""
    from pipeline.strategies import select_batch

    if space is not None:
        emb = space.rows(pool)
        lab = space.rows(sorted(labeled)) if labeled else None
    else:
        emb = model_emb
        at = {s: i for i, s in enumerate(pool)}
        lab = emb[[at[s] for s in sorted(labeled) if s in at]] if (emb is not None and labeled) else None
    opts = dict(options)
    if diversity == "probcover" and n_classes:
        opts.setdefault("n_classes", n_classes)
    predicted = probs.argmax(1) if probs is not None and probs.ndim == 2 and probs.dtype.kind == "f" and n_classes \
        else None
    return select_batch(pool, k=k, strategy=strategy, diversity=diversity, probs=probs, embeddings=emb,
                        predicted=predicted, exclude=labeled, seed=seed, options=opts, labeled_embeddings=lab)


def cold_pick(spec: StrategySpec, *, pool: list[str], k: int, seed: int, space: Space | None, base_emb: np.ndarray | None,
              n_classes: int) -> Any:
    if spec.cold_start == "random":
        return pick("random", "top_k", {}, pool=pool, labeled=set(), k=k, seed=seed, space=space, probs=None,
                    model_emb=None, n_classes=n_classes)
    return pick("random", spec.cold_start, {}, pool=pool, labeled=set(), k=k, seed=seed, space=space, probs=None,
                model_emb=base_emb, n_classes=n_classes)


# ------------------------------------------------------------------------------------------------ experiment
def run_key(cfg: ProjectConfig, bench: Bench, work: Work, pool: list[str], extra: Any) -> str:
    return digest_json({"v": BENCH_VERSION, "prepared": work.data.digest, "pool": pool, "seed": cfg.seed,
                        "weights": work.model,
                        "model": cfg.section("model"), "train": cfg.section("train"), "select": cfg.section("select"),
                        "bench": bench.model_dump(include={"initial", "batch", "rounds", "annotator_noise",
                                                           "test_size"}),
                        "extra": extra})[:10]


def run_strategy(name: str, spec: StrategySpec, cfg: ProjectConfig, bench: Bench, data: Data, work: Work,
                 pool: list[str], space: Space | None, tag: str) -> dict[str, Any]:
    """One strategy, one seed, through the tiny model: its cold start, then `rounds` rounds of `batch` labels."""
    run_dir = work.art / "runs" / f"{tag}-{name}-seed{cfg.seed}-{run_key(cfg, bench, work, pool, spec.model_dump())}"
    t_start = time.monotonic()
    from pipeline.selection import heuristic_input

    n_classes = len(cfg.data.answers) if cfg.data.answers else None
    mc_strategies = ("bald", "answer_disagreement")
    mc = cfg.select.mc_dropout_passes if spec.strategy in mc_strategies else 0
    if spec.strategy in mc_strategies and mc < 2:
        raise ConfigError(f"strategy {name!r} ({spec.strategy}) needs project.select.mc_dropout_passes ≥ 2, got {mc}")
    base_emb = None
    if space is None and spec.cold_start != "random":
        base_emb = work.score(Adapter(None, "base"), pool, 0, cfg.seed).embeddings
    sel = cold_pick(spec, pool=pool, k=bench.initial, seed=cfg.seed, space=space, base_emb=base_emb,
                    n_classes=n_classes)
    selection = sel.rows()
    labels_curve, acc, recall, phases, newest, asked = [], [], [], ["cold start"], [], set()
    adapter = None
    for r in range(bench.rounds + 1):
        labels = annotate(cfg, data, run_dir, selection, r, bench.annotator_noise, work.timer, asked)
        if r and selection and selection[0].get("prediction") is not None:
            newest.append(sum(x["prediction"] == labels.get(x["sample_id"]) for x in selection) / len(selection))
        adapter = work.train(cfg, labels, adapter)
        ev = work.evaluate(adapter, bench.metric)
        acc.append(ev["accuracy"])
        recall.append(ev["recall"])
        labels_curve.append(len(labels))
        log.info("%s seed %d %-18s round %d: %4d labels → %s %.4f", tag, cfg.seed, name, r, len(labels),
                 bench.metric, acc[-1])
        if r == bench.rounds:
            break
        strategy, diversity, phase = phase_of(spec, len(labels), n_classes, newest)
        phases.append(phase)
        scores = None
        if needs_scores(strategy, diversity) or space is None or (spec.schedule and
                                                                   spec.schedule.switch == "newest_accuracy"):
            scores = work.score(adapter, pool, mc if strategy in mc_strategies else 0, cfg.seed)
        probs = None
        if scores is not None and strategy != "random":
            probs = heuristic_input(scores, strategy)
        sel = pick(strategy, diversity, spec.options, pool=pool, labeled=set(labels), k=bench.batch,
                   seed=cfg.seed * 1000 + r + 1, space=space, probs=probs,
                   model_emb=None if scores is None else scores.embeddings, n_classes=n_classes)
        selection = selection_rows(sel, scores, adapter, cfg.data.answers)
    return {"labels": labels_curve, "accuracy": acc, "recall": recall, "phases": phases,
            "seconds": round(time.monotonic() - t_start, 1), "run_dir": str(run_dir),
            "class_counts": dict(Counter(labels.values()))}


def full_data(cfg: ProjectConfig, bench: Bench, data: Data, work: Work, pool: list[str], tag: str) -> dict[str, Any]:
    """Every sample of `pool` labeled (through the same export → annotator → import path) and trained with the same
    budget as a strategy's final model: one training per round, each continuing the last. Its accuracy is the last
    round's."""
    run_dir = work.art / "runs" / f"{tag}-full-seed{cfg.seed}-{run_key(cfg, bench, work, pool, 'full')}"
    selection = [{"sample_id": s, "rank": i + 1, "score": 0.0} for i, s in enumerate(pool)]
    labels = annotate(cfg, data, run_dir, selection, 0, bench.annotator_noise, work.timer, set())
    rounds = bench.rounds + 1 if cfg.train.init == "warm" else 1
    adapter, curve = None, []
    for _ in range(rounds):
        adapter = work.train(cfg, labels, adapter)
        ev = work.evaluate(adapter, bench.metric)
        curve.append(ev["accuracy"])
    log.info("%s seed %d full data: %d labels, %d × %d steps → %s %.4f", tag, cfg.seed, len(labels), rounds,
             cfg.train.max_steps, bench.metric, curve[-1])
    return {"seed": cfg.seed, "labels": len(labels), "accuracy": curve[-1], "curve": curve, "recall": ev["recall"]}


# ------------------------------------------------------------------------------------------------ reference learner
class Probe:
    """Logistic regression on the selection embeddings: the reference learner (deterministic, milliseconds)."""

    def __init__(self, answers: list[str]):
        self.answers = answers

    def fit(self, x: np.ndarray, y: list[str]) -> Probe:
        from sklearn.linear_model import LogisticRegression

        self.classes = sorted(set(y))
        self.clf = None
        if len(self.classes) > 1:
            self.clf = LogisticRegression(C=10.0, max_iter=2000).fit(x, y)
        return self

    def proba(self, x: np.ndarray) -> np.ndarray:
        out = np.zeros((len(x), len(self.answers)))
        cols = [self.answers.index(c) for c in self.classes]
        out[:, cols] = self.clf.predict_proba(x) if self.clf is not None else 1.0
        return out


def run_probe(spec: StrategySpec, cfg: ProjectConfig, bench: Bench, data: Data, pool: list[str],
              space: Space) -> dict[str, Any]:
    """The same protocol with the probe as the model (labels straight from the ground truth)."""
    answers, n_classes = list(cfg.data.answers), len(cfg.data.answers)
    test_x = space.rows([r["sample_id"] for r in data.test])
    test_y = [r["answer"] for r in data.test]
    pool_x = space.rows(pool)
    sel = cold_pick(spec, pool=pool, k=bench.initial, seed=cfg.seed, space=space, base_emb=None, n_classes=n_classes)
    labeled: list[str] = list(sel.ids)
    labels_curve, acc, recall, newest = [], [], [], []
    for r in range(bench.rounds + 1):
        probe = Probe(answers).fit(space.rows(labeled), [data.truth[s] for s in labeled])
        pred = [answers[i] for i in probe.proba(test_x).argmax(1)]
        acc.append(float(np.mean([p == y for p, y in zip(pred, test_y, strict=True)])))
        recall.append(per_class_recall(pred, test_y))
        labels_curve.append(len(labeled))
        if r == bench.rounds:
            break
        probs = probe.proba(pool_x)
        strategy, diversity, _ = phase_of(spec, len(labeled), n_classes, newest)
        sel = pick(strategy, diversity, spec.options, pool=pool, labeled=set(labeled), k=bench.batch,
                   seed=cfg.seed * 1000 + r + 1, space=space, probs=None if strategy == "random" else probs,
                   model_emb=None, n_classes=n_classes)
        at = {s: i for i, s in enumerate(pool)}
        newest.append(float(np.mean([answers[int(probs[at[s]].argmax())] == data.truth[s] for s in sel.ids])))
        labeled += sel.ids
    return {"labels": labels_curve, "accuracy": acc, "recall": recall, "seconds": 0.0,
            "class_counts": dict(Counter(data.truth[s] for s in labeled))}


def probe_full(cfg: ProjectConfig, data: Data, pool: list[str], space: Space) -> dict[str, Any]:
    answers = list(cfg.data.answers)
    probe = Probe(answers).fit(space.rows(pool), [data.truth[s] for s in pool])
    pred = [answers[i] for i in probe.proba(space.rows([r["sample_id"] for r in data.test])).argmax(1)]
    acc = float(np.mean([p == r["answer"] for p, r in zip(pred, data.test, strict=True)]))
    return {"seed": cfg.seed, "labels": len(pool), "accuracy": acc}


# ------------------------------------------------------------------------------------------------ summary
def labels_to(labels: list[float], curve: list[float], target: float) -> float | None:
    """Labels at which the curve first reaches `target` (linear between points); the first point's labels when it
    starts there; None when it never does."""
    for i, y in enumerate(curve):
        if y >= target:
            if i == 0:
                return float(labels[0])
            x0, x1, y0 = labels[i - 1], labels[i], curve[i - 1]
            return float(x0 + (x1 - x0) * (target - y0) / (y - y0))
    return None


def _area(labels: Any, curve: Any) -> float:
    """Mean accuracy over the label range (trapezoids): a strategy that is ahead everywhere has the larger area."""
    return float(np.trapezoid(curve, labels) / (labels[-1] - labels[0]))


def _ci(values: np.ndarray) -> list[float | None]:
    """Percentile 95 % interval; an upper end that is infinite (never reached) is None."""
    # inverted_cdf picks observed values: interpolating next to an infinite ratio would give NaN.
    lo, hi = np.quantile(values, [0.025, 0.975], method="inverted_cdf")
    return [round(float(lo), 3) if np.isfinite(lo) else None, round(float(hi), 3) if np.isfinite(hi) else None]


def bootstrap_ratio(acc: np.ndarray, base: np.ndarray, full: np.ndarray, labels: np.ndarray, pct: int, n: int,
                    seed: int = 0) -> tuple[list[float | None], float]:
    """Paired bootstrap over seeds of labels-to-pct % (strategy) / labels-to-pct % (random): each resample draws
    seeds with replacement and takes the strategy's, random's and the full-data run's values of the same seeds.
    A resample where the strategy never reaches the target counts as an infinite ratio; one where random never
    reaches it has no ratio and is left out (the fraction left out is returned)."""
    rng = np.random.default_rng(seed)
    s = len(acc)
    ratios, undefined = [], 0
    for idx in rng.integers(0, s, size=(n, s)):
        target = pct / 100 * full[idx].mean()
        lb = labels_to(list(labels), list(base[idx].mean(0)), target)
        if lb is None:
            undefined += 1
            continue
        ls = labels_to(list(labels), list(acc[idx].mean(0)), target)
        ratios.append(np.inf if ls is None else ls / lb)
    if not ratios:
        return [None, None], 1.0
    return _ci(np.array(ratios)), round(undefined / n, 3)


def bootstrap_ratio_to_final(acc: np.ndarray, base: np.ndarray, labels: np.ndarray, n: int,
                             seed: int = 0) -> list[float | None]:
    """Paired bootstrap over seeds of labels to reach random's final value, strategy / random (random's mean curve
    may get there before its last step): a target that needs no full-data reference. A resample where the strategy
    never gets there is an infinite ratio."""
    rng = np.random.default_rng(seed)
    s = len(acc)
    ratios = []
    for idx in rng.integers(0, s, size=(n, s)):
        base_mean = base[idx].mean(0)
        lb = labels_to(list(labels), list(base_mean), float(base_mean[-1]))
        ls = labels_to(list(labels), list(acc[idx].mean(0)), float(base_mean[-1]))
        ratios.append(np.inf if ls is None else ls / lb)
    return _ci(np.array(ratios))


def summarize(curves: dict[str, list[dict[str, Any]]], full: list[float], baseline: str, *, bootstrap: int = 2000,
              rarest: list[str] | None = None) -> dict[str, Any]:
    """Per strategy: mean/std curve over seeds, area with its interval, labels to 90 / 95 % of full-data, the ratio
    to random with its paired bootstrap interval, the area difference to random paired by seed; the final labeled
    set's class balance; with `rarest` (the rarest class of each seed), that class's recall at the last round."""
    out: dict[str, Any] = {}
    full_arr = np.asarray(full, dtype=np.float64)
    full_acc = float(full_arr.mean())
    rng = np.random.default_rng(0)
    base_runs = curves[baseline]
    for name, runs in curves.items():
        acc = np.array([r["accuracy"] for r in runs], dtype=np.float64)
        labels = np.array([r["labels"] for r in runs], dtype=np.float64).mean(0)
        mean, std = acc.mean(0), acc.std(0, ddof=1) if len(acc) > 1 else np.zeros(acc.shape[1])
        areas = np.array([_area(r["labels"], r["accuracy"]) for r in runs])
        boot_idx = rng.integers(0, len(runs), size=(bootstrap, len(runs)))
        s: dict[str, Any] = {
            "labels": [round(x, 1) for x in labels], "mean": [round(x, 4) for x in mean],
            "std": [round(x, 4) for x in std], "per_seed": [r["accuracy"] for r in runs],
            "auc": round(_area(labels, mean), 4), "auc_ci": _ci(areas[boot_idx].mean(1)),
            "seconds": round(sum(r["seconds"] for r in runs), 1)}
        band = np.percentile(acc[boot_idx].mean(1), [2.5, 97.5], axis=0)
        s["mean_ci"] = [[round(float(a), 4) for a in band[0]], [round(float(b), 4) for b in band[1]]]
        for pct in (90, 95):
            x = labels_to(list(labels), list(mean), pct / 100 * full_acc)
            s[f"labels_to_{pct}"] = None if x is None else round(x, 1)
        if name != baseline and len(runs) == len(base_runs):
            base = np.array([r["accuracy"] for r in base_runs], dtype=np.float64)
            s["ratio_to_random_95_ci"], s["ratio_95_bootstrap_undefined"] = bootstrap_ratio(
                acc, base, full_arr, labels, 95, bootstrap)
            s["ratio_to_random_90_ci"], _ = bootstrap_ratio(acc, base, full_arr, labels, 90, bootstrap)
            s["ratio_to_random_final_ci"] = bootstrap_ratio_to_final(acc, base, labels, bootstrap)
            d = areas - np.array([_area(r["labels"], r["accuracy"]) for r in base_runs])
            s["auc_minus_random"] = {"mean": round(float(d.mean()), 4), "ci": _ci(d[boot_idx].mean(1)),
                                     "per_seed": [round(float(x), 4) for x in d], "seeds_ahead": int((d > 0).sum())}
        counts = [r.get("class_counts") or {} for r in runs]
        classes = sorted({c for cc in counts for c in cc})
        if classes:
            per_class = {c: float(np.mean([cc.get(c, 0) for cc in counts])) for c in classes}
            s["final_class_counts"] = {c: round(v, 1) for c, v in per_class.items()}
            s["final_min_max_class"] = [round(min(per_class.values()), 1), round(max(per_class.values()), 1)]
        if rarest is not None:
            rec = [r["recall"][-1].get(c) for r, c in zip(runs, rarest, strict=True)]
            s["rarest_class_recall"] = round(float(np.mean(rec)), 4)
            s["rarest_class_recall_per_seed"] = rec
        if runs and "phases" in runs[0]:
            s["phases"] = runs[0]["phases"]
        out[name] = s
    random_final = out[baseline]["mean"][-1]
    random_labels = labels_to(out[baseline]["labels"], out[baseline]["mean"], random_final)
    for s in out.values():
        for pct in (90, 95):
            mine, base = s[f"labels_to_{pct}"], out[baseline][f"labels_to_{pct}"]
            s[f"ratio_to_random_{pct}"] = None if mine is None or base is None else round(mine / base, 3)
        # Labels to reach what random has at the last step, over the labels random's own mean curve needs for it:
        # the full-data reference plays no part, so this ratio still reads when that reference is weak (the
        # open-answer benchmark).
        x = labels_to(s["labels"], s["mean"], random_final)
        s["labels_to_random_final"] = None if x is None else round(x, 1)
        s["ratio_to_random_final"] = None if x is None or not random_labels else round(x / random_labels, 3)
    return out


def best_ratio(strategies: dict[str, Any], baseline: str, pct: int | str) -> tuple[str | None, float | None]:
    found = [(s[f"ratio_to_random_{pct}"], n) for n, s in strategies.items()
             if n != baseline and s[f"ratio_to_random_{pct}"] is not None]
    return (min(found)[1], min(found)[0]) if found else (None, None)


def headline(strategies: dict[str, Any], baseline: str, full: list[float]) -> dict[str, Any]:
    best95, ratio95 = best_ratio(strategies, baseline, 95)
    best90, ratio90 = best_ratio(strategies, baseline, 90)
    best_final, ratio_final = best_ratio(strategies, baseline, "final")
    random_final = strategies[baseline]["mean"][-1]
    return {"full_data_accuracy": round(float(np.mean(full)), 4),
            # A reference below what random reaches makes every "% of full data" target trivial (ratios near 1).
            "full_data_below_random_final": bool(np.mean(full) < random_final),
            "best_strategy_random_final": best_final, "best_ratio_random_final": ratio_final,
            "best_ratio_random_final_ci": strategies[best_final].get("ratio_to_random_final_ci") if best_final
            else None,
            "full_data_accuracy_std": round(float(np.std(full, ddof=1)), 4) if len(full) > 1 else 0.0,
            "strategies": strategies, "best_strategy_95": best95, "best_ratio_95": ratio95,
            "best_ratio_95_ci": strategies[best95].get("ratio_to_random_95_ci") if best95 else None,
            "best_strategy_90": best90, "best_ratio_90": ratio90}


def plot(panels: list[tuple[str, dict[str, Any], float]], baseline: str, chance: float | None, title: str,
         out_png: Path, metric: str = "accuracy") -> Path:
    """One panel per (title, strategies, full-data accuracy): mean curves with bootstrap 95 % bands, random
    dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.3 * rows), dpi=100, squeeze=False)
    try:
        for ax, (name, summary, full_acc) in zip(axes.flat, panels, strict=False):
            for sname, s in sorted(summary.items()):
                x, m = np.array(s["labels"]), np.array(s["mean"])
                lo, hi = (np.array(b) for b in s["mean_ci"])
                # The labels ratio to random: to 95 % of full data, or to random's final value when random meets
                # that target within its first two steps (a weak reference: every strategy meets it at once).
                base = summary[baseline]
                weak_reference = base["labels_to_95"] is None or base["labels_to_95"] <= base["labels"][1]
                ratio = s.get("ratio_to_random_final" if weak_reference else "ratio_to_random_95")
                target = "random's last" if weak_reference else "95 %"
                label = f"{sname} (×{ratio:.2f} to {target})" if ratio is not None and sname != baseline else sname
                ls = "--" if sname == baseline else "-"
                line, = ax.plot(x, m, ls=ls, marker="o", ms=2.5, lw=1.6 if sname == baseline else 1.2, label=label,
                                color="k" if sname == baseline else None)
                ax.fill_between(x, lo, hi, alpha=0.12, color=line.get_color())
            ax.axhline(full_acc, color="grey", lw=1, label=f"full data ({full_acc:.3f})")
            ax.axhline(0.95 * full_acc, color="grey", lw=0.8, ls=":", label="95 % of full data")
            if chance is not None:
                ax.axhline(chance, color="lightgrey", lw=0.8, ls=":")
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("labeled samples")
            ax.set_ylabel(f"test {metric.replace('_', ' ')} (mean, 95 % band)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=6.5, loc="lower right")
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        fig.suptitle(title, fontsize=9)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", metadata={"Software": None}, bbox_inches="tight")
    finally:
        plt.close(fig)
    return atomic_write_bytes(out_png, buf.getvalue())


# ------------------------------------------------------------------------------------------------ main
def run_variant(variant: str, cfg: ProjectConfig, bench: Bench, data: Data, work: Work,
                seeds: list[int]) -> dict[str, Any]:
    """Every strategy and the full-data reference over `seeds` on the variant's pools, tiny model and probe."""
    curves: dict[str, list[dict[str, Any]]] = {n: [] for n in bench.strategies}
    probes: dict[str, list[dict[str, Any]]] = {n: [] for n in bench.strategies}
    full, full_probe, rarest, pools, embed_s = [], [], [], [], []
    for seed in seeds:
        cfg_s = seeded(cfg, seed)
        pool = data.pool
        if variant == "longtail":
            pool = longtail_pool(data.pool, data.truth, list(cfg.data.answers), bench.longtail.imbalance, seed)
            sizes = Counter(data.truth[s] for s in pool)
            rarest.append(min(sizes, key=lambda a: (sizes[a], a)))
            need = bench.initial + bench.rounds * bench.batch
            if len(pool) < need:
                raise DataError(f"Long-tailed pool too small: {len(pool)} samples at imbalance "
                                f"{bench.longtail.imbalance:g}, the benchmark labels {need}; lower benchmark.rounds / "
                                "batch or the imbalance, or set benchmark.longtail: null")
        pools.append(len(pool))
        space, fit_seconds = selection_space(cfg_s, data, pool, work)
        embed_s.append(fit_seconds)
        full.append(full_data(cfg_s, bench, data, work, pool, variant))
        for name, spec in bench.strategies.items():
            curves[name].append(run_strategy(name, spec, cfg_s, bench, data, work, pool, space, variant))
        if bench.reference_learner and space is not None:
            full_probe.append(probe_full(cfg_s, data, pool, space))
            for name, spec in bench.strategies.items():
                probes[name].append(run_probe(spec, cfg_s, bench, data, pool, space))
    fa = [f["accuracy"] for f in full]
    rare = rarest if variant == "longtail" else None
    out = headline(summarize(curves, fa, bench.baseline, bootstrap=bench.bootstrap, rarest=rare), bench.baseline, fa)
    out.update(full_data_runs=full, pool_sizes=pools, embeddings_fit_seconds=[round(x, 1) for x in embed_s])
    if rare:
        out["rarest_class"] = rare
    if full_probe:
        pa = [f["accuracy"] for f in full_probe]
        out["reference_learner"] = {
            "learner": "logistic regression (C=10) on the selection embeddings, labels from the ground truth",
            **headline(summarize(probes, pa, bench.baseline, bootstrap=bench.bootstrap, rarest=rare),
                       bench.baseline, pa)}
    return out


def run(cfg: ProjectConfig, bench: Bench, *, quick: bool, seeds: list[int] | None = None,
        variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    import torch

    t0, load0 = time.monotonic(), os.getloadavg()[0]
    data = prepare_data(cfg, bench)
    work = Work(cfg, data)
    seeds = seeds or bench.seeds
    result: dict[str, Any] = {"benchmark": "label_efficiency", "quick": quick, "baseline": bench.baseline,
                              "baseline_cold_start": "random", "seeds": seeds, "metric": bench.metric,
                              "answers": "closed" if cfg.data.answers else "open",
                              "selection_embeddings": cfg.select.embeddings.source}
    if "main" in variants:
        result.update(run_variant("main", cfg, bench, data, work, seeds))
    if "longtail" in variants and bench.longtail is not None:
        result["longtail"] = {"imbalance": bench.longtail.imbalance, "test": "balanced (unchanged)",
                              **run_variant("longtail", cfg, bench, data, work, seeds)}
    chance = 1.0 / len(cfg.data.answers) if cfg.data.answers else None
    result.update({
        "chance_accuracy": None if chance is None else round(chance, 4),
        "data": {**data.counts, "source": str(cfg.data.sources[0].path.relative_to(ROOT)
                                              if cfg.data.sources[0].path.is_relative_to(ROOT)
                                              else cfg.data.sources[0].path)},
        "config": {"benchmark": bench.model_dump(exclude={"quick"}, mode="json"),
                   "model": {k: v for k, v in cfg.section("model").items() if k != "name_or_path"},
                   "train": cfg.section("train"),
                   "select": {k: cfg.section("select")[k] for k in ("score_batch_size", "mc_dropout_passes",
                                                                     "embeddings")}},
        **({} if cfg.data.answers else {"max_new_tokens": cfg.model.max_new_tokens}),
        "wall_seconds": round(time.monotonic() - t0, 1),
        "timings": work.timer.summary(),
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "load_avg_1m_start": round(load0, 2), "load_avg_1m_end": round(os.getloadavg()[0], 2)},
    })
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--quick", action="store_true", help="apply the config's benchmark.quick overrides")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--png-out", type=Path, default=None, help="default: --json-out with .png, else the work folder")
    ap.add_argument("--seeds", type=str, default=None, help="comma-separated subset of the config's seeds")
    ap.add_argument("--variants", type=str, default=",".join(VARIANTS), help="main, longtail or both")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: the tiny model's ops are too small to split, and extra threads "
                         "spin-wait on a busy machine, ~10x the CPU time per step here)")
    ap.add_argument("-v", "--verbose", action="store_true", help="also show the library's INFO logs")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    log.setLevel(logging.INFO)
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()

    cfg, bench = load_bench_config(args.config, quick=args.quick)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    if seeds and set(seeds) - set(bench.seeds):
        raise ConfigError(f"--seeds {sorted(set(seeds) - set(bench.seeds))} are not among benchmark.seeds "
                          f"{bench.seeds}")
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    if set(variants) - set(VARIANTS):
        raise ConfigError(f"--variants must name {' and/or '.join(VARIANTS)}, got {args.variants!r}")
    result = run(cfg, bench, quick=args.quick, seeds=seeds, variants=variants)
    src = args.config.resolve()
    result["config"]["file"] = str(src.relative_to(ROOT) if src.is_relative_to(ROOT) else args.config)
    png = args.png_out or (args.json_out.with_suffix(".png") if args.json_out else cfg.artifacts / "learning_curve.png")
    panels = []
    for key, name in (("", "tiny 4-bit VLM"), ("longtail", "tiny 4-bit VLM, long-tailed pool")):
        part = result.get(key) if key else result
        if part and "strategies" in part:
            panels.append((f"{name}", part["strategies"], part["full_data_accuracy"]))
            if "reference_learner" in part:
                ref = part["reference_learner"]
                panels.append((f"{name.replace('tiny 4-bit VLM', 'reference: linear probe')}", ref["strategies"],
                               ref["full_data_accuracy"]))
    title = (f"{result['data']['source']}{'' if bench.metric == 'accuracy' else ' (open answers, ' + bench.metric + ')'}"
             f": {len(result['seeds'])} seeds, random baseline from the first label, "
             f"{bench.initial} + {bench.rounds}×{bench.batch} labels, {cfg.train.max_steps} steps/round, selection "
             f"space: {cfg.select.embeddings.source}")
    if panels:
        result["png"] = str(plot(panels, bench.baseline, result["chance_accuracy"], title, png, bench.metric))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        atomic_write_json(args.json_out, result)
    return result


if __name__ == "__main__":
    main()
