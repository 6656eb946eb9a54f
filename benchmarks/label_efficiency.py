"""Label efficiency: how many labels each active-learning strategy needs, against random picks, through the real pipeline.

Everything goes through tamis' library (no Prefect): ingest → preprocess → quality flags, a 4-bit QLoRA tiny model,
and per round: train an adapter (fixed step budget) → evaluate on the test split → score the pool → select a batch →
export it (Label Studio tasks + images) → the simulated annotator answers it as a Label Studio export → import into
the run's label ledger → retrain. Every strategy starts from the same cold-start batch (per seed) and runs `rounds`
rounds of `batch` labels; a full-data run (every eligible pool sample labeled, same step budget) is the reference.

Output: per strategy the mean ± std learning curve over seeds, its area (mean accuracy over the label range), the
labels needed to reach 90 % / 95 % of the full-data accuracy (linear interpolation on the mean curve; null when never
reached), and that number divided by random's; a learning-curve PNG. Work is cached by content under the project's
artifacts folder (adapters, scores, evaluations), so the cold-start round is trained once per seed for all strategies
and a killed run resumes where it stopped.

    python benchmarks/label_efficiency.py --json-out benchmarks/results/label_efficiency.json
    python benchmarks/label_efficiency.py --quick          # 2 strategies, 1 seed, 2 rounds: a few minutes
    python benchmarks/label_efficiency.py --config my.yaml # any image-classification-style manifest
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

from pipeline.config import ProjectConfig, parse_config  # noqa: E402
from pipeline.errors import ConfigError, DataError  # noqa: E402
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
BENCH_VERSION = "1"


# ------------------------------------------------------------------------------------------------ config
class StrategySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    strategy: str
    diversity: str = "top_k"
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known(self) -> StrategySpec:
        from pipeline.strategies import HEURISTICS, SELECTORS

        if self.strategy not in HEURISTICS:
            raise ValueError(f"strategy {self.strategy!r} is not one of {sorted(HEURISTICS)}")
        if self.diversity not in SELECTORS or self.diversity == "typical":
            raise ValueError(f"diversity {self.diversity!r} is not one of {sorted(set(SELECTORS) - {'typical'})}")
        return self


class Bench(BaseModel):
    model_config = ConfigDict(extra="forbid")
    build_demo_digits: bool = False
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    cold_start: Literal["typical", "random"] = "typical"
    initial: int = Field(default=40, ge=1)
    batch: int = Field(default=40, ge=1)
    rounds: int = Field(default=4, ge=1)
    train_steps: int | None = Field(default=None, ge=1)
    test_size: int | None = Field(default=300, ge=1)
    pool_size: int | None = Field(default=None, ge=2)
    annotator_noise: float = Field(default=0.0, ge=0, le=1)
    full_data_seeds: list[int] | None = None
    strategies: dict[str, StrategySpec]
    quick: dict[str, Any] = Field(default_factory=dict)

    @field_validator("strategies")
    @classmethod
    def _has_random(cls, v: dict[str, StrategySpec]) -> dict[str, StrategySpec]:
        if not any(s.strategy == "random" and s.diversity == "top_k" for s in v.values()):
            raise ValueError("needs the baseline {strategy: random, diversity: top_k}: ratios are measured against it")
        return v

    @property
    def baseline(self) -> str:
        return next(n for n, s in self.strategies.items() if s.strategy == "random" and s.diversity == "top_k")


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
    if not project.data.answers:
        raise ConfigError(f"{path}: project.data.answers is empty; the benchmark needs a closed answer set")
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
        write_digits(src.path.parent)
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
    if len(pool) < need:
        raise DataError(f"Pool too small: {len(pool)} eligible pool samples, the benchmark labels {need} "
                        f"({bench.initial} + {bench.rounds} rounds × {bench.batch}); lower benchmark.rounds/batch")
    if not test:
        raise DataError(f"{src.path}: no test rows with an answer (split: test); the benchmark evaluates on them")
    counts = {"prepared": len(ds), "pool": len(pool), "test": len(test), "quality_excluded": len(excluded),
              "ingest_quarantined": m.info["counts"].get("quarantined", 0)}
    log.info("data: %s", counts)
    return Data(ds, rows, pool, test, set(rows), pm.outputs["dataset"].digest, counts)


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

    def add(self, what: str, t0: float, computed: bool) -> None:
        if computed:
            self.seconds[what] += time.monotonic() - t0
            self.computed[what] += 1
        else:
            self.reused[what] += 1

    def summary(self) -> dict[str, Any]:
        keys = sorted(set(self.computed) | set(self.reused))
        return {k: {"computed": self.computed[k], "reused": self.reused[k], "seconds": round(self.seconds[k], 1),
                    "mean_s": round(self.seconds[k] / self.computed[k], 2) if self.computed[k] else None}
                for k in keys}


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
        self.timer.add("train", t0, computed=not done)
        return Adapter(res.adapter_dir, res.manifest.outputs["adapter"].digest)

    def evaluate(self, adapter: Adapter) -> float:
        from pipeline.evaluate import evaluate_model

        test = self.data.test
        key = digest_json({"adapter": adapter.digest, "test": [r["sample_id"] for r in test],
                           "answers": self.cfg.data.answers, "model": self.cfg.section("model"),
                           "weights": self.model})
        path = self.art / "eval" / f"{key[:16]}.json"
        if path.is_file():
            self.timer.add("evaluate", 0.0, computed=False)
            return json.loads(path.read_text(encoding="utf-8"))["accuracy"]
        t0 = time.monotonic()
        res = evaluate_model(self._load(adapter), test, self.cfg.data.answers,
                             batch_size=self.cfg.select.score_batch_size)
        atomic_write_json(path, {"accuracy": res["metrics"]["accuracy"], "n": res["n"], "adapter": adapter.digest})
        self.timer.add("evaluate", t0, computed=True)
        return res["metrics"]["accuracy"]

    def score(self, adapter: Adapter, ids: list[str], mc_passes: int, seed: int) -> Any:
        from pipeline.scoring import SCORE_VERSION, ClosedSetScorer, load_scores, save_scores

        sel = self.cfg.select
        seed = seed if mc_passes else 0  # only MC dropout draws random numbers
        config = {"answers": self.cfg.data.answers, "length_normalize": sel.length_normalize,
                  "mc_dropout_passes": mc_passes, "seed": seed, "model": self.cfg.section("model"),
                  "weights": self.model}
        inputs = {"adapter": adapter.digest, "prepared": self.data.digest, "ids": digest_json(ids)}
        key = stage_key("score", SCORE_VERSION, inputs, config)
        folder = self.art / "scores" / key[:16]
        if find_valid_manifest(folder, key) is not None:
            self.timer.add("score", 0.0, computed=False)
            return load_scores(folder)
        t0 = time.monotonic()
        scorer = ClosedSetScorer(self._load(adapter), self.cfg.data.answers, length_normalize=sel.length_normalize)
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


def selection_rows(sel: Any, scores: Any, adapter: Adapter, answers: list[str]) -> list[dict[str, Any]]:
    """Selection rows as the select stage writes them: rank, score, the model's answer and confidence."""
    rows = sel.rows()
    for row, i in zip(rows, sel.positions, strict=True):
        row.update(adapter_digest=adapter.digest, confidence=float(scores.probs[i].max()),
                   prediction=answers[int(scores.probs[i].argmax())])
    return rows


def pick(spec: StrategySpec, scores: Any, labeled: set[str], k: int, seed: int) -> Any:
    from pipeline.strategies import select_batch

    probs = {"bald": scores.mc_probs, "random": None}.get(spec.strategy, scores.probs)
    kwargs: dict[str, Any] = {}
    if spec.diversity == "k_center":
        at = {s: i for i, s in enumerate(scores.sample_ids)}
        kwargs["labeled_embeddings"] = scores.embeddings[[at[s] for s in sorted(labeled) if s in at]]
    return select_batch(scores.sample_ids, k=k, strategy=spec.strategy, diversity=spec.diversity, probs=probs,
                        embeddings=scores.embeddings, predicted=scores.probs.argmax(1), exclude=labeled, seed=seed,
                        options=spec.options, **kwargs)


# ------------------------------------------------------------------------------------------------ experiment
def run_key(cfg: ProjectConfig, bench: Bench, work: Work, extra: Any) -> str:
    return digest_json({"v": BENCH_VERSION, "prepared": work.data.digest, "pool": work.data.pool, "seed": cfg.seed,
                        "weights": work.model,
                        "model": cfg.section("model"), "train": cfg.section("train"), "select": cfg.section("select"),
                        "bench": bench.model_dump(exclude={"quick", "strategies", "seeds", "full_data_seeds"}),
                        "extra": extra})[:10]


def cold_start(cfg: ProjectConfig, bench: Bench, data: Data, work: Work) -> list[dict[str, Any]]:
    """The initial batch every strategy of this seed starts from: TypiClust on the base model's embeddings, or
    random."""
    from pipeline.strategies import select_batch

    if bench.cold_start == "random":
        sel = select_batch(data.pool, k=bench.initial, strategy="random", diversity="top_k", seed=cfg.seed)
    else:
        base = work.score(Adapter(None, "base"), data.pool, 0, cfg.seed)
        sel = select_batch(base.sample_ids, k=bench.initial, strategy="random", diversity="typical",
                           embeddings=base.embeddings, seed=cfg.seed)
    return sel.rows()


def run_strategy(name: str, spec: StrategySpec, cfg: ProjectConfig, bench: Bench, data: Data, work: Work,
                 initial: list[dict[str, Any]]) -> dict[str, Any]:
    """One strategy, one seed: cold start, then `rounds` rounds of `batch` labels. Returns labels + accuracy."""
    run_dir = work.art / "runs" / f"{name}-seed{cfg.seed}-{run_key(cfg, bench, work, spec.model_dump())}"
    t_start = time.monotonic()
    selection, labels_curve, acc, asked = initial, [], [], set()
    mc = cfg.select.mc_dropout_passes if spec.strategy == "bald" else 0
    if spec.strategy == "bald" and mc < 2:
        raise ConfigError(f"strategy {name!r} (bald) needs project.select.mc_dropout_passes ≥ 2, got {mc}")
    adapter = None
    for r in range(bench.rounds + 1):
        labels = annotate(cfg, data, run_dir, selection, r, bench.annotator_noise, work.timer, asked)
        adapter = work.train(cfg, labels, adapter)
        acc.append(work.evaluate(adapter))
        labels_curve.append(len(labels))
        log.info("seed %d %-15s round %d: %4d labels → accuracy %.4f", cfg.seed, name, r, len(labels), acc[-1])
        if r == bench.rounds:
            break
        scores = work.score(adapter, data.pool, mc, cfg.seed)
        sel = pick(spec, scores, set(labels), bench.batch, cfg.seed * 1000 + r + 1)
        selection = selection_rows(sel, scores, adapter, cfg.data.answers)
    return {"labels": labels_curve, "accuracy": acc, "seconds": round(time.monotonic() - t_start, 1),
            "run_dir": str(run_dir), "class_counts": dict(Counter(labels.values()))}


def full_data(cfg: ProjectConfig, bench: Bench, data: Data, work: Work, seeds: list[int]) -> list[dict[str, Any]]:
    """Every eligible pool sample labeled (through the same export → annotator → import path) and trained with the
    same budget as a strategy's final model: one training per round (each continuing the last when train.init is
    warm), once per seed. Its accuracy is the last round's; `curve` has every round's."""
    run_dir = work.art / "runs" / f"full-{run_key(cfg, bench, work, 'full')}"
    selection = [{"sample_id": s, "rank": i + 1, "score": 0.0} for i, s in enumerate(data.pool)]
    labels = annotate(cfg, data, run_dir, selection, 0, bench.annotator_noise, work.timer, set())
    rounds = bench.rounds + 1 if cfg.train.init == "warm" else 1
    out = []
    for s in seeds:
        adapter, curve = None, []
        for _ in range(rounds):
            adapter = work.train(seeded(cfg, s), labels, adapter)
            curve.append(work.evaluate(adapter))
        log.info("seed %d full data: %d labels, %d × %d steps → accuracy %.4f", s, len(labels), rounds,
                 cfg.train.max_steps, curve[-1])
        out.append({"seed": s, "labels": len(labels), "accuracy": curve[-1], "curve": curve})
    return out


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


def summarize(curves: dict[str, list[dict[str, Any]]], full_acc: float, baseline: str) -> dict[str, Any]:
    """Per strategy: mean/std curve over seeds, normalised area, labels to 90 / 95 % of full-data, ratio to random;
    the area difference to random paired by seed (same cold start, so its luck cancels); the final labeled set's
    class balance (uncertainty sampling can pile up a few confusable classes)."""
    out: dict[str, Any] = {}
    areas: dict[str, np.ndarray] = {}
    for name, runs in curves.items():
        acc = np.array([r["accuracy"] for r in runs], dtype=np.float64)
        labels = np.array([r["labels"] for r in runs], dtype=np.float64).mean(0)
        mean, std = acc.mean(0), acc.std(0, ddof=1) if len(acc) > 1 else np.zeros(acc.shape[1])
        areas[name] = np.array([_area(r["labels"], r["accuracy"]) for r in runs])
        out[name] = {"labels": [round(x, 1) for x in labels], "mean": [round(x, 4) for x in mean],
                     "std": [round(x, 4) for x in std], "per_seed": [r["accuracy"] for r in runs],
                     "auc": round(_area(labels, mean), 4), "seconds": round(sum(r["seconds"] for r in runs), 1)}
        out[name]["curve"] = [{"labels": x, "mean": m, "std": sd} for x, m, sd in
                              zip(out[name]["labels"], out[name]["mean"], out[name]["std"], strict=True)]
        for pct in (90, 95):
            x = labels_to(list(labels), list(mean), pct / 100 * full_acc)
            out[name][f"labels_to_{pct}"] = None if x is None else round(x, 1)
        counts = [r.get("class_counts") or {} for r in runs]
        classes = sorted({c for cc in counts for c in cc})
        if classes:
            per_class = {c: float(np.mean([cc.get(c, 0) for cc in counts])) for c in classes}
            out[name]["final_class_counts"] = {c: round(v, 1) for c, v in per_class.items()}
            out[name]["final_min_max_class"] = [round(min(per_class.values()), 1), round(max(per_class.values()), 1)]
    for name, s in out.items():
        for pct in (90, 95):
            mine, base = s[f"labels_to_{pct}"], out[baseline][f"labels_to_{pct}"]
            s[f"ratio_to_random_{pct}"] = None if mine is None or base is None else round(mine / base, 3)
        if name != baseline and len(areas[name]) == len(areas[baseline]):
            d = areas[name] - areas[baseline]
            s["auc_minus_random"] = {"mean": round(float(d.mean()), 4),
                                     "std": round(float(d.std(ddof=1)), 4) if len(d) > 1 else 0.0,
                                     "per_seed": [round(float(x), 4) for x in d], "seeds_ahead": int((d > 0).sum())}
    return out


def best_ratio(strategies: dict[str, Any], baseline: str, pct: int) -> tuple[str | None, float | None]:
    found = [(s[f"ratio_to_random_{pct}"], n) for n, s in strategies.items()
             if n != baseline and s[f"ratio_to_random_{pct}"] is not None]
    return (min(found)[1], min(found)[0]) if found else (None, None)


def plot(summary: dict[str, Any], full_acc: float, chance: float, title: str, out_png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    try:
        for name, s in sorted(summary.items()):
            x, m, sd = np.array(s["labels"]), np.array(s["mean"]), np.array(s["std"])
            ax.plot(x, m, marker="o", ms=3, label=f"{name} (AUC {s['auc']:.3f})")
            ax.fill_between(x, m - sd, m + sd, alpha=0.15)
        ax.axhline(full_acc, color="k", lw=1, label=f"full data ({full_acc:.3f})")
        ax.axhline(0.95 * full_acc, color="k", lw=0.8, ls="--", label="95 % of full data")
        ax.axhline(chance, color="grey", lw=0.8, ls=":", label=f"chance ({chance:.2f})")
        ax.set_xlabel("labeled samples")
        ax.set_ylabel("test accuracy (mean ± std over seeds)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
        buf = io.BytesIO()
        fig.savefig(buf, format="png", metadata={"Software": None}, bbox_inches="tight")
    finally:
        plt.close(fig)
    return atomic_write_bytes(out_png, buf.getvalue())


# ------------------------------------------------------------------------------------------------ main
def run(cfg: ProjectConfig, bench: Bench, *, quick: bool) -> dict[str, Any]:
    import torch

    t0, load0 = time.monotonic(), os.getloadavg()[0]
    data = prepare_data(cfg, bench)
    work = Work(cfg, data)
    full_seeds = bench.full_data_seeds if bench.full_data_seeds is not None else bench.seeds
    full = full_data(cfg, bench, data, work, full_seeds)
    full_acc = float(np.mean([f["accuracy"] for f in full]))
    curves: dict[str, list[dict[str, Any]]] = {n: [] for n in bench.strategies}
    for seed in bench.seeds:
        cfg_s = seeded(cfg, seed)
        initial = cold_start(cfg_s, bench, data, work)
        for name, spec in bench.strategies.items():
            curves[name].append(run_strategy(name, spec, cfg_s, bench, data, work, initial))
    chance = 1.0 / len(cfg.data.answers)
    strategies = summarize(curves, full_acc, bench.baseline)
    best95, ratio95 = best_ratio(strategies, bench.baseline, 95)
    best90, ratio90 = best_ratio(strategies, bench.baseline, 90)
    return {
        "benchmark": "label_efficiency",
        "quick": quick,
        "full_data_accuracy": round(full_acc, 4),
        "full_data_accuracy_std": round(float(np.std([f["accuracy"] for f in full], ddof=1)) if len(full) > 1
                                        else 0.0, 4),
        "full_data_runs": full,
        "chance_accuracy": round(chance, 4),
        "full_data_over_chance": round(full_acc / chance, 2),
        "baseline": bench.baseline,
        "strategies": strategies,
        "best_ratio_95": ratio95,
        "best_strategy_95": best95,
        "best_ratio_90": ratio90,
        "best_strategy_90": best90,
        "data": {**data.counts, "source": str(cfg.data.sources[0].path.relative_to(ROOT)
                                              if cfg.data.sources[0].path.is_relative_to(ROOT)
                                              else cfg.data.sources[0].path)},
        "config": {"benchmark": bench.model_dump(exclude={"quick"}),
                   "model": {k: v for k, v in cfg.section("model").items() if k != "name_or_path"},
                   "train": cfg.section("train"),
                   "select": {k: cfg.section("select")[k] for k in ("score_batch_size", "mc_dropout_passes")}},
        "wall_seconds": round(time.monotonic() - t0, 1),
        "timings": work.timer.summary(),
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "load_avg_1m_start": round(load0, 2), "load_avg_1m_end": round(os.getloadavg()[0], 2)},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--quick", action="store_true", help="apply the config's benchmark.quick overrides")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--png-out", type=Path, default=None, help="default: --json-out with .png, else the work folder")
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
    result = run(cfg, bench, quick=args.quick)
    result["config"]["file"] = str(args.config.resolve().relative_to(ROOT) if args.config.resolve().is_relative_to(ROOT)
                                   else args.config)
    png = args.png_out or (args.json_out.with_suffix(".png") if args.json_out else cfg.artifacts / "learning_curve.png")
    title = (f"{result['data']['source']}: {len(bench.seeds)} seed(s), cold start {bench.cold_start} "
             f"{bench.initial} + {bench.rounds}×{bench.batch}, {cfg.train.max_steps} steps/round "
             f"({'continuing the last adapter' if cfg.train.init == 'warm' else 'fresh adapter'})")
    result["png"] = str(plot(result["strategies"], result["full_data_accuracy"], result["chance_accuracy"], title,
                             png))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        atomic_write_json(args.json_out, result)
    return result


if __name__ == "__main__":
    main()
