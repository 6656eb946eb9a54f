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

Selection goes through the library as a round's does (pipeline.selection: the cold-start choice, the schedule's
phase, one selection step). Work is cached by content under the project's artifacts folder (embeddings, adapters,
scores, evaluations), each entry with a record of the code version that made it, and every finished seed's results
are written to `seeds/` at once: a killed run resumes after the seeds it finished, runs restricted with --seeds /
--variants (e.g. two processes on two cores) fill one cache that a final full run then reads, and the results JSON
(benchmarks/_results.py) says when the entries it was assembled from came from several code versions.

The ground truth (project.data.ground_truth) may key its answers by sample_id or by image path, as the simulated
annotator reads it; a pool sample without an answer is refused before any work starts.

    python benchmarks/label_efficiency.py --json-out benchmarks/results/label_efficiency.json
    python benchmarks/label_efficiency.py --quick          # 3 strategies, 2 seeds, 2 rounds: a few minutes
    python benchmarks/label_efficiency.py --config my.yaml # any image-classification-style manifest
    python benchmarks/label_efficiency.py --strategies margin,uncertainty_herding   # a subset (+ the random baseline)
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
import json
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "NO_ALBUMENTATIONS_UPDATE": "1", "TOKENIZERS_PARALLELISM": "false",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1"}.items():
    os.environ.setdefault(_k, _v)

import numpy as np  # noqa: E402

from benchmarks._curves import headline, plot, summarize  # noqa: E402
from benchmarks._efficiency_config import DEFAULT_CONFIG, Bench, StrategySpec, load_bench_config, seeded  # noqa: E402
from benchmarks._efficiency_work import Adapter, Data, Work, annotate, per_class_recall, selection_rows  # noqa: E402
from benchmarks._results import write_result  # noqa: E402
from pipeline.config import ProjectConfig, ScheduleConfig, SelectConfig  # noqa: E402
from pipeline.errors import ConfigError, DataError  # noqa: E402
from pipeline.selection import Space, cold_start_choice, round_phase, select_step  # noqa: E402
from pipeline.stopping import agreement  # noqa: E402
from pipeline.store import (  # noqa: E402
    MANIFEST_NAME,
    atomic_write_json,
    digest_json,
    find_valid_manifest,
    stage_key,
)
from pipeline.strategies import get_heuristic, get_selector  # noqa: E402
from pipeline.strategies.schedule import phase_label  # noqa: E402

MC_INPUTS = ("mc_probs", "agreement", "meanings")  # heuristics that read MC-dropout samples or sampled answers

log = logging.getLogger("label_efficiency")
BENCH_VERSION = "3"  # 3: curves carry the test rows' agreement between successive adapters
COLD_STARTS = ("random", "typical", "typiclust", "probcover", "maxherding")
VARIANTS = ("main", "longtail")


# ------------------------------------------------------------------------------------------------ data
def ground_truth_answers(path: str | os.PathLike[str], ids: list[str], image_paths: list[str | None]) -> dict[str, str]:
    """sample_id → answer from the ground-truth JSONL, matched as the simulated annotator matches a task: by
    sample_id first, else by the image's file name (a ground truth keyed by image path, as a manifest data set
    brings it). `image_paths` are row-aligned with `ids` (the ingested image_path column)."""
    from pipeline.annotation.simulate import load_ground_truth

    by_id, by_image = load_ground_truth(path)
    out: dict[str, str] = {}
    for sid, image in zip(ids, image_paths, strict=True):
        answer = by_id.get(sid)
        if answer is None and image:
            answer = by_image.get(os.path.basename(str(image).replace("\\", "/")))
        if answer is not None:
            out[sid] = answer
    return out


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
    from pipeline.data.ingest import INGEST_VERSION, ingest, ingest_key_config, load_ingested, source_digest
    from pipeline.preprocess import PREPROCESS_VERSION, load_prepared, preprocess_dataset, resolve_size

    src = cfg.data.sources[0]
    if bench.build_demo_digits and not src.path.is_file():
        from pipeline.data.demo import write_digits

        log.info("building the digits demo data set in %s", src.path.parent)
        write_digits(src.path.parent, open_answers=not cfg.data.answers)
    art = cfg.artifacts
    sd = source_digest(cfg.data, art)
    ing = art / "ingest" / sd[:16]
    m = find_valid_manifest(ing, stage_key("ingest", INGEST_VERSION, {"sources": sd},
                                           ingest_key_config(cfg.section("data"))))
    m = m or ingest(cfg.data, cfg.artifacts, ing, digest=sd)
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
    ids = list(ds["sample_id"])
    paths = list(ds["image_path"]) if "image_path" in ds.column_names else [None] * len(ids)
    truth = ground_truth_answers(cfg.data.ground_truth, ids, paths)
    missing = [s for s in pool if s not in truth]
    if missing:
        where = dict(zip(ids, paths, strict=True))
        raise DataError(f"{cfg.data.ground_truth}: no answer for {len(missing)} of {len(pool)} pool samples (e.g. "
                        f"sample_id {missing[0]!r}, image {where[missing[0]]!r}); the simulated annotator and the "
                        "reference learner answer every pool sample from it, matched by sample_id or by image file "
                        "name: add those rows, or remove their images from data.sources")
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


# ------------------------------------------------------------------------------------------------ selection space
def selection_space(cfg: ProjectConfig, data: Data, pool: list[str], work: Work) -> tuple[Space | None, float]:
    """Fit the configured selection embeddings on `pool`'s images only (never labels, never the test split), then
    embed the pool and the test rows; cached by the rows' content and the embeddings config. Returns the space
    (None for source "model": the current adapter's embeddings) and the fit's seconds."""
    from pipeline.embeddings import (
        compute_selection_embeddings,
        embeddings_key,
        embeddings_spec,
        load_selection_embeddings,
    )

    source = cfg.select.embeddings.source
    if source == "model":
        return None, 0.0
    test_ids = [r["sample_id"] for r in data.test]
    keep = set(pool) | set(test_ids)
    idx = [i for i, s in enumerate(data.prepared["sample_id"]) if s in keep]
    # Only the pool's rows keep split "pool", so only they are fitted on.
    sub = data.prepared.select(idx)
    inputs = {"prepared": data.digest, "rows": digest_json(sorted(keep)), "pool": digest_json(pool)}
    key = embeddings_key(embeddings_spec(cfg), inputs)
    out = work.art / "embeddings" / key[:16]
    t0 = time.monotonic()
    computed = find_valid_manifest(out, key) is None
    if computed:
        compute_selection_embeddings(embeddings_spec(cfg), sub, out, inputs=inputs)
        work.made("embeddings", key, time.monotonic() - t0)
    else:
        work.reused("embeddings", key)
    ids, emb = load_selection_embeddings(out)
    info = json.loads((out / MANIFEST_NAME).read_text(encoding="utf-8")).get("info", {})
    work.timer.add("embeddings", t0, computed=computed, recorded_s=info.get("seconds"))
    return Space(ids, emb, source), float(info.get("seconds", 0.0))


def needs_scores(strategy: str, diversity: str) -> bool:
    return get_heuristic(strategy).input != "none" or get_selector(diversity).needs_scores


def select_config(cfg: ProjectConfig, spec: StrategySpec, batch: int) -> SelectConfig:
    """The project's select section with the strategy's choices in it: what the round's library calls read."""
    return cfg.select.model_copy(update={"cold_start": spec.cold_start, "strategy": spec.strategy,
                                         "diversity": spec.diversity, "batch_size": batch,
                                         "schedule": spec.schedule or ScheduleConfig()})


def cold_batch(spec: StrategySpec, *, pool: list[str], k: int, seed: int, space: Space | None,
               base_emb: np.ndarray | None, n_classes: int | None) -> Any:
    """The strategy's own first batch, before any model exists (pipeline.selection.cold_start_choice)."""
    strategy, diversity = cold_start_choice(spec.cold_start)
    return select_step(pool, k=k, strategy=strategy, diversity=diversity, seed=seed, space=space,
                       embeddings=base_emb, n_classes=n_classes)


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
    """One strategy, one seed, through the tiny model: its cold start, then `rounds` rounds of `batch` labels, each
    round's phase and batch chosen by pipeline.selection as a project's round chooses them."""
    run_dir = work.art / "runs" / f"{tag}-{name}-seed{cfg.seed}-{run_key(cfg, bench, work, pool, spec.model_dump())}"
    t_start = time.monotonic()
    from pipeline.selection import heuristic_input

    n_classes = len(cfg.data.answers) if cfg.data.answers else None
    sel_cfg = select_config(cfg, spec, bench.batch)
    # Heuristics that read MC-dropout samples or sampled answers say so (Heuristic.input).
    needs_mc = get_heuristic(spec.strategy).input in MC_INPUTS
    mc = cfg.select.mc_dropout_passes if needs_mc else 0
    if needs_mc and mc < 2:
        raise ConfigError(f"strategy {name!r} ({spec.strategy}) needs project.select.mc_dropout_passes ≥ 2, got {mc}")
    base_emb = None
    if space is None and spec.cold_start != "random":
        base_emb = work.score(Adapter(None, "base"), pool, 0, cfg.seed).embeddings
    sel = cold_batch(spec, pool=pool, k=bench.initial, seed=cfg.seed, space=space, base_emb=base_emb,
                     n_classes=n_classes)
    selection = sel.rows()
    labels_curve, acc, recall, phases, previous, asked = [], [], [], ["cold start"], [], set()
    agree: list[float] = []  # agreement[r - 1]: rounds r and r - 1 on the test rows (pipeline.stopping.agreement)
    adapter, preds = None, None
    for r in range(bench.rounds + 1):
        labels = annotate(cfg, data, run_dir, selection, r, bench.annotator_noise, work.timer, asked)
        if r:
            previous.append(selection)
        adapter = work.train(cfg, labels, adapter)
        ev = work.evaluate(adapter, bench.metric)
        acc.append(ev["accuracy"])
        recall.append(ev["recall"])
        labels_curve.append(len(labels))
        if preds is not None:
            agree.append(agreement(preds, ev["predictions"], closed=bool(cfg.data.answers))["agreement"])
        preds = ev["predictions"]
        log.info("%s seed %d %-18s round %d: %4d labels → %s %.4f", tag, cfg.seed, name, r, len(labels),
                 bench.metric, acc[-1])
        if r == bench.rounds:
            break
        phase = round_phase(sel_cfg, labels=labels, n_classes=n_classes, previous_selections=previous)
        phases.append(phase_label(phase.as_dict()))
        strategy, diversity = phase.strategy, phase.diversity
        scores = None
        reads_newest = spec.schedule is not None and spec.schedule.switch == "newest_accuracy"
        if needs_scores(strategy, diversity) or space is None or reads_newest:
            scores = work.score(adapter, pool, mc if get_heuristic(strategy).input in MC_INPUTS else 0, cfg.seed)
        probs = heuristic_input(scores, strategy) if scores is not None else None  # None for random
        predicted = scores.probs.argmax(1) if scores is not None and scores.probs is not None else None
        sel = select_step(pool, k=bench.batch, strategy=strategy, diversity=diversity, seed=cfg.seed * 1000 + r + 1,
                          labeled=labels, space=space, probs=probs, predicted=predicted,
                          # The selection space when there is one, as a project's round selects (select_round).
                          embeddings=None if scores is None or space is not None else scores.embeddings,
                          n_classes=n_classes,
                          options=spec.options)
        selection = selection_rows(sel, scores, adapter, cfg.data.answers)
    return {"labels": labels_curve, "accuracy": acc, "recall": recall, "phases": phases, "agreement": agree,
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
              space: Space, restrict: Any = None) -> dict[str, Any]:
    """The same protocol with the probe as the model (labels straight from the ground truth), its phases and
    batches chosen by pipeline.selection from the probe's class probabilities. `restrict(labeled, phase) -> ids`: the
    round's candidates (select.candidates, benchmarks/_efficiency_candidates.py): only they are scored and
    selected from; None scores the whole pool."""
    answers, n_classes = list(cfg.data.answers), len(cfg.data.answers)
    sel_cfg = select_config(cfg, spec, bench.batch)
    test_x = space.rows([r["sample_id"] for r in data.test])
    test_y = [r["answer"] for r in data.test]
    pool_x = space.rows(pool)
    sel = cold_batch(spec, pool=pool, k=bench.initial, seed=cfg.seed, space=space, base_emb=None,
                     n_classes=n_classes)
    labeled: list[str] = list(sel.ids)
    labels_curve, acc, recall, previous, scored_n = [], [], [], [], []
    at = {s: i for i, s in enumerate(pool)}
    for r in range(bench.rounds + 1):
        probe = Probe(answers).fit(space.rows(labeled), [data.truth[s] for s in labeled])
        pred = [answers[i] for i in probe.proba(test_x).argmax(1)]
        acc.append(float(np.mean([p == y for p, y in zip(pred, test_y, strict=True)])))
        recall.append(per_class_recall(pred, test_y))
        labels_curve.append(len(labeled))
        if r == bench.rounds:
            break
        phase = round_phase(sel_cfg, labels={s: data.truth[s] for s in labeled}, n_classes=n_classes,
                            previous_selections=previous)
        scored = pool if restrict is None else restrict(labeled, phase)
        at_scored = at if restrict is None else {s: i for i, s in enumerate(scored)}
        probs = probe.proba(pool_x if restrict is None else space.rows(scored))
        scored_n.append(len(scored))
        sel = select_step(scored, k=bench.batch, strategy=phase.strategy, diversity=phase.diversity,
                          seed=cfg.seed * 1000 + r + 1, labeled=labeled, space=space,
                          probs=None if get_heuristic(phase.strategy).input == "none" else probs,
                          predicted=probs.argmax(1),
                          n_classes=n_classes, options=spec.options)
        # The probe's answers on the batch before it is labeled: the newest-labels accuracy a schedule reads.
        previous.append([{"sample_id": s, "prediction": answers[int(probs[at_scored[s]].argmax())]}
                         for s in sel.ids])
        labeled += sel.ids
    return {"labels": labels_curve, "accuracy": acc, "recall": recall, "seconds": 0.0,
            "class_counts": dict(Counter(data.truth[s] for s in labeled)),
            **({} if restrict is None else {"scored_per_round": scored_n})}


def probe_full(cfg: ProjectConfig, data: Data, pool: list[str], space: Space) -> dict[str, Any]:
    answers = list(cfg.data.answers)
    probe = Probe(answers).fit(space.rows(pool), [data.truth[s] for s in pool])
    pred = [answers[i] for i in probe.proba(space.rows([r["sample_id"] for r in data.test])).argmax(1)]
    acc = float(np.mean([p == r["answer"] for p, r in zip(pred, data.test, strict=True)]))
    return {"seed": cfg.seed, "labels": len(pool), "accuracy": acc}


# ------------------------------------------------------------------------------------------------ main
def run_seed(variant: str, seed: int, cfg: ProjectConfig, bench: Bench, data: Data, work: Work) -> dict[str, Any]:
    """One seed of a variant: its pool, selection space, full-data reference, every strategy, and the probe's."""
    cfg_s = seeded(cfg, seed)
    pool, rarest = data.pool, None
    if variant == "longtail":
        pool = longtail_pool(data.pool, data.truth, list(cfg.data.answers), bench.longtail.imbalance, seed)
        sizes = Counter(data.truth[s] for s in pool)
        rarest = min(sizes, key=lambda a: (sizes[a], a))
        need = bench.initial + bench.rounds * bench.batch
        if len(pool) < need:
            raise DataError(f"Long-tailed pool too small: {len(pool)} samples at imbalance "
                            f"{bench.longtail.imbalance:g}, the benchmark labels {need}; lower benchmark.rounds / "
                            "batch or the imbalance, or set benchmark.longtail: null")
    space, fit_seconds = selection_space(cfg_s, data, pool, work)
    out: dict[str, Any] = {"pool_size": len(pool), "embeddings_fit_seconds": fit_seconds, "rarest": rarest,
                           "full": full_data(cfg_s, bench, data, work, pool, variant),
                           "curves": {name: run_strategy(name, spec, cfg_s, bench, data, work, pool, space, variant)
                                      for name, spec in bench.strategies.items()}}
    if bench.reference_learner and space is not None:
        out["full_probe"] = probe_full(cfg_s, data, pool, space)
        out["probes"] = {name: run_probe(spec, cfg_s, bench, data, pool, space)
                         for name, spec in bench.strategies.items()}
    return out


def seed_key(variant: str, seed: int, cfg: ProjectConfig, bench: Bench, data: Data, work: Work) -> str:
    """Everything a seed's results depend on: the data (prepared content, eligible pool, test rows, answers), the
    model's weights and config, the selection config, the benchmark's protocol and strategies."""
    return digest_json({
        "v": BENCH_VERSION, "variant": variant, "seed": seed, "prepared": data.digest, "pool": data.pool,
        "test": [r["sample_id"] for r in data.test], "truth": digest_json(sorted(data.truth.items())),
        "answers": cfg.data.answers, "weights": work.model, "model": cfg.section("model"),
        "train": cfg.section("train"), "select": cfg.section("select"),
        "bench": bench.model_dump(mode="json", exclude={"quick", "seeds", "bootstrap", "build_demo_digits"})})


def seed_results(variant: str, seed: int, cfg: ProjectConfig, bench: Bench, data: Data, work: Work) -> dict[str, Any]:
    """A seed's results, from its file when an earlier run finished that seed, else computed and written at once:
    a crash late in a long run loses at most the seed it was in, and the re-run resumes after the seeds done."""
    key = seed_key(variant, seed, cfg, bench, data, work)
    path = work.art / "seeds" / f"{variant}-seed{seed}-{key[:12]}.json"
    if path.is_file():
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            saved = {}
        if saved.get("key") == key:
            log.info("%s seed %d: results of an earlier run (%s, %.0f s) from %s", variant, seed,
                     saved["code_version"], saved["seconds"], path)
            work.timer.add("seed", 0.0, computed=False, recorded_s=saved["seconds"])
            work.timer.versions.update(saved["versions"])
            return saved["result"]
        log.warning("%s: not a finished seed's results (unreadable or another key); computing seed %d again",
                    path, seed)
    t0, before = time.monotonic(), Counter(work.timer.versions)
    # Through JSON, so a computed seed and a resumed one give the same values to the summary.
    result = json.loads(json.dumps(run_seed(variant, seed, cfg, bench, data, work)))
    seconds = time.monotonic() - t0
    atomic_write_json(path, {"key": key, "variant": variant, "seed": seed, "code_version": work.code,
                             "seconds": round(seconds, 1), "versions": dict(Counter(work.timer.versions) - before),
                             "result": result})
    work.timer.add("seed", t0, computed=True)
    return result


def run_variant(variant: str, cfg: ProjectConfig, bench: Bench, data: Data, work: Work,
                seeds: list[int]) -> dict[str, Any]:
    """Every strategy and the full-data reference over `seeds` on the variant's pools, tiny model and probe."""
    per_seed = [seed_results(variant, seed, cfg, bench, data, work) for seed in seeds]
    curves = {n: [r["curves"][n] for r in per_seed] for n in bench.strategies}
    full = [r["full"] for r in per_seed]
    fa = [f["accuracy"] for f in full]
    rare = [r["rarest"] for r in per_seed] if variant == "longtail" else None
    out = headline(summarize(curves, fa, bench.baseline, bootstrap=bench.bootstrap, rarest=rare), bench.baseline, fa)
    out.update(full_data_runs=full, pool_sizes=[r["pool_size"] for r in per_seed],
               embeddings_fit_seconds=[round(r["embeddings_fit_seconds"], 1) for r in per_seed])
    if rare:
        out["rarest_class"] = rare
    full_probe = [r["full_probe"] for r in per_seed if "full_probe" in r]
    if full_probe:
        probes = {n: [r["probes"][n] for r in per_seed] for n in bench.strategies}
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
        # Cache entries (adapters, evaluations, scores, embeddings, finished seeds) by the code version that made
        # them; "unrecorded": made before the benchmark recorded versions.
        "cache_code_versions": dict(sorted(work.timer.versions.items())),
        "machine": {"torch_threads": torch.get_num_threads(), "load_avg_1m_start": round(load0, 2)},
    })
    return result


def candidates_check(cfg: ProjectConfig, bench: Bench, names: list[str], *, seeds: list[int] | None = None,
                     candidates: Any = None) -> dict[str, Any]:
    """Each strategy of `names` with the project's select.candidates (`candidates`, default `auto` as `tamis init`
    writes it; forced to restrict at its size where auto would score the whole pool, and labelled so) beside the same
    strategy scoring the whole pool, and the random baseline, on the reference probe over paired seeds
    (benchmarks/_efficiency_candidates.py). The first name is the headline row; the others go under `others`."""
    from benchmarks import _efficiency_candidates as ec
    from pipeline.strategies.candidates import shares_for

    t0 = time.monotonic()
    missing = [n for n in names if n not in bench.strategies]
    if missing:
        raise ConfigError(f"--candidates-check names {missing}, which benchmark.strategies does not define "
                          f"({sorted(bench.strategies)})")
    data = prepare_data(cfg, bench)
    work = Work(cfg, data)
    seeds = seeds or bench.seeds
    cand, resolved = ec.resolve(candidates or cfg.select.candidates, eligible=len(data.pool),
                                embeddings_source=cfg.select.embeddings.source, batch=bench.batch)
    runs: dict[str, list[dict[str, Any]]] = {bench.baseline: []}
    full, pools = [], []
    for seed in seeds:
        cfg_s = seeded(cfg, seed)
        space, _ = selection_space(cfg_s, data, data.pool, work)
        if space is None:
            raise ConfigError("--candidates-check: select.candidates needs selection embeddings; set "
                              "project.select.embeddings to pool, pixels, vision_tower or file")
        full.append(probe_full(cfg_s, data, data.pool, space)["accuracy"])
        pools.append(len(data.pool))
        runs[bench.baseline].append(run_probe(bench.strategies[bench.baseline], cfg_s, bench, data, data.pool, space))
        for name in names:
            spec = bench.strategies[name]
            sel_cfg = ec.with_candidates(select_config(cfg_s, spec, bench.batch), cand)
            restrict = ec.restrictor(sel_cfg, pool=data.pool, space=space, seed=seed, cache_dir=work.art / "candidates",
                                     n_classes=len(cfg.data.answers))
            runs.setdefault(name, []).append(run_probe(spec, cfg_s, bench, data, data.pool, space))
            runs.setdefault(f"{name}+candidates", []).append(
                run_probe(spec, cfg_s, bench, data, data.pool, space, restrict=restrict))
        log.info("candidates check seed %d done (%.0f s)", seed, time.monotonic() - t0)
    summary = summarize(runs, full, bench.baseline, bootstrap=bench.bootstrap)
    rows = [ec.check_row(n, summary, restricted=f"{n}+candidates", baseline=bench.baseline, candidates=cand,
                         batch=bench.batch, scored=[r["scored_per_round"] for r in runs[f"{n}+candidates"]],
                         pool_sizes=pools, seeds=seeds,
                         shares=shares_for(cand, bench.strategies[n].diversity)) for n in names]
    for row, n in zip(rows, names, strict=True):
        row["candidates_vs_all_95"] = ec.paired_ratio(runs, full, f"{n}+candidates", n, 95, bench.bootstrap)
    return {**rows[0], "others": rows[1:], "pool_size": len(data.pool), "candidates_resolution": resolved,
            "learner": "reference probe: logistic regression (C=10) on the selection embeddings, labels from the "
                       "ground truth (the tiny VLM is too slow for enough seeds on 2 shared cores)",
            "protocol": f"{bench.initial} + {bench.rounds} × {bench.batch} labels; each strategy's own cold start on "
                        "the whole pool, then every round restricted (candidates) or not (all); a coverage phase's "
                        "candidates are its selector's own batch, picked over the whole pool (pipeline.selection."
                        "coverage_picker), other rounds' the select.candidates.shares sources",
            "full_data_accuracy": round(float(np.mean(full)), 4), "wall_seconds": round(time.monotonic() - t0, 1),
            "timings": work.timer.summary(), "cache_code_versions": dict(sorted(work.timer.versions.items()))}


def reused_seconds(timings: dict[str, Any]) -> float:
    """Seconds of earlier work this run took from the cache (what those entries recorded when they were made)."""
    return round(sum(t.get("reused_recorded_seconds", 0.0) for t in timings.values()), 1)


def config_digest_input(cfg: ProjectConfig, bench: Bench, seeds: list[int], variants: tuple[str, ...]) -> Any:
    """What the run was configured with, with this checkout's root taken out of paths, so the same config digests
    the same on another machine."""
    text = json.dumps({"project": cfg.model_dump(mode="json"), "benchmark": bench.model_dump(mode="json"),
                       "seeds": seeds, "variants": list(variants)}, sort_keys=True)
    return json.loads(text.replace(json.dumps(str(ROOT))[1:-1] + "/", ""))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    started = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--quick", action="store_true", help="apply the config's benchmark.quick overrides")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--png-out", type=Path, default=None, help="default: --json-out with .png, else the work folder")
    ap.add_argument("--seeds", type=str, default=None, help="comma-separated subset of the config's seeds")
    ap.add_argument("--strategies", type=str, default=None,
                    help="comma-separated subset of the config's strategies (the baseline is always kept)")
    ap.add_argument("--variants", type=str, default=",".join(VARIANTS), help="main, longtail or both")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: the tiny model's ops are too small to split, and extra threads "
                         "spin-wait on a busy machine, ~10x the CPU time per step here)")
    ap.add_argument("--candidates-check", type=str, default=None, metavar="STRATEGIES",
                    help="only the candidates_check: these strategies (comma-separated, the first is the headline) "
                         "with select.candidates: restrict beside all, on the probe; written into --json-out under "
                         "candidates_check, the file's other keys kept")
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

    keep = [n.strip() for n in args.strategies.split(",") if n.strip()] if args.strategies else None
    cfg, bench = load_bench_config(args.config, quick=args.quick, strategies=keep)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    if seeds and set(seeds) - set(bench.seeds):
        raise ConfigError(f"--seeds {sorted(set(seeds) - set(bench.seeds))} are not among benchmark.seeds "
                          f"{bench.seeds}")
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    if set(variants) - set(VARIANTS):
        raise ConfigError(f"--variants must name {' and/or '.join(VARIANTS)}, got {args.variants!r}")
    if args.candidates_check:
        from benchmarks._efficiency_candidates import merge_into

        names = [n.strip() for n in args.candidates_check.split(",") if n.strip()]
        section = candidates_check(cfg, bench, names, seeds=seeds)
        return merge_into(args.json_out or cfg.artifacts / "candidates_check.json", section, started=started,
                          config=config_digest_input(cfg, bench, section["seeds"], ("candidates_check", *names)),
                          code_versions=list(section["cache_code_versions"]))
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
    return write_result(result, args.json_out, started=started, reused_s=reused_seconds(result["timings"]),
                        config=config_digest_input(cfg, bench, result["seeds"], variants),
                        code_versions=list(result["cache_code_versions"]))


if __name__ == "__main__":
    main()
