"""Candidate restriction where it bites (issue 52): the default selector with and without `select.candidates` on a
pool above `auto_above`, labels to 95 % of full-data accuracy and the time per round of each.

The pool: --pool distinct 28×28 PNGs on disk (ingest_scale's generator, as pool_scale.py's flow and defaults parts:
a digit upscaled, shifted and noised), drawn from the pool split of scikit-learn's digits only; the test set: one
jittered copy of each test-split digit (write_digits' split), with a labels.csv. `tamis init` (the library call it
runs) writes the project config for that folder and the tiny model, and the benchmark reads its select section
unedited: batch size, selection space (pixels above 20,000 images), Uncertainty Herding, `candidates: auto`.

Per seed (paired: every arm sees the same pool, space and seed), through pipeline.selection as a round selects:
- random from the first label (the baseline of every ratio);
- the default selector scoring every eligible sample (`all`);
- the same with `candidates: auto`, which restricts above auto_above (pipeline.strategies.candidates: the labeled
  set's neighbours, k-means clusters, a random fill; 10 × the batch);
- any --extra candidate settings (JSON of select.candidates fields, e.g. '{"shares": {"clusters": 1.0}}').

The learner is the label-efficiency benchmark's reference probe (logistic regression on the selection embeddings,
labels from the ground truth): the tiny 4-bit VLM scoring 24,000 samples a round for 10 rounds, 3 arms and enough
seeds does not fit 2 shared cores; what restriction can cost is which samples the selector may pick, which the probe
measures without the tiny model's training noise. The time per round of each arm is its selection (candidates +
selector, measured in the probe runs) plus the tiny VLM's scoring of what the arm scores (measured once on this pool:
every eligible sample, and the candidates + labeled of one restricted round).

    nice -n 15 python benchmarks/candidates_scale.py --json-out benchmarks/results/candidates_scale.json
    python benchmarks/candidates_scale.py --seeds 0,1,2,3 --seeds-only &   # seeds in two processes, one folder
    python benchmarks/candidates_scale.py --seeds 4,5,6,7 --seeds-only; python benchmarks/candidates_scale.py ...
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "NO_ALBUMENTATIONS_UPDATE": "1", "TOKENIZERS_PARALLELISM": "false",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1", "OMP_WAIT_POLICY": "PASSIVE"}.items():
    os.environ.setdefault(_k, _v)

import numpy as np  # noqa: E402

from benchmarks import _efficiency_candidates as ec  # noqa: E402
from benchmarks import label_efficiency as le  # noqa: E402
from benchmarks._curves import summarize  # noqa: E402
from benchmarks._efficiency_config import Bench, StrategySpec, seeded  # noqa: E402
from benchmarks._efficiency_work import Adapter, Work  # noqa: E402
from benchmarks._results import write_result  # noqa: E402
from benchmarks.ingest_scale import write_pool  # noqa: E402
from pipeline.config import CandidatesConfig, ProjectConfig, parse_config  # noqa: E402
from pipeline.strategies.candidates import candidates_choice, shares_for  # noqa: E402

log = logging.getLogger("candidates_scale")
QUESTION = "Which digit is shown in the image?"
DEFAULT = "uncertainty_herding"
RESTRICTED = f"{DEFAULT}+candidates"


# ------------------------------------------------------------------------------------------------ the project
def write_project(root: Path, n: int, seed: int) -> tuple[Path, Path]:
    """The pool folder (n PNGs of pool-split digits), the test folder (a jittered copy of each test-split digit, its
    labels.csv) and the pool's ground truth keyed by file name; written once per (n, seed). Returns (pool, test
    labels.csv)."""
    from sklearn.datasets import load_digits

    from pipeline.data.demo import _stratified_test

    target = load_digits().target
    is_test = _stratified_test(target, 0.25, 0)  # write_digits' split: the digits benchmark's pool / test
    pool_bases, test_bases = np.flatnonzero(~is_test), np.flatnonzero(is_test)
    pool, test = root / "pool", root / "test"
    marker = root / "written.json"
    want = {"n": n, "seed": seed, "test": len(test_bases)}
    if not marker.is_file() or json.loads(marker.read_text()) != want:
        write_pool(pool, 0, n, seed, bases=pool_bases)
        # Test files numbered after the pool's, so no file name is both a pool and a test image.
        write_pool(test, n, n + len(test_bases), seed, bases=test_bases)
        rows = ["file,category"] + [f"{i:07d}.png,{target[test_bases[i % len(test_bases)]]}"
                                    for i in range(n, n + len(test_bases))]
        (test / "labels.csv").write_text("\n".join(rows) + "\n")
        (root / "ground_truth.jsonl").write_text("".join(
            json.dumps({"image": f"{i:07d}.png", "answer": str(int(target[pool_bases[i % len(pool_bases)]]))}) + "\n"
            for i in range(n)))
        marker.write_text(json.dumps(want))
    return pool, test / "labels.csv"


def init_config(root: Path, pool: Path, labels: Path, model: Path) -> tuple[ProjectConfig, str]:
    """The config `tamis init` writes for the pool (pipeline.project_init, the CLI's library call), with the
    benchmark's ground truth added (the probe's labels) and the artifacts under `root`; and the YAML as written."""
    import yaml

    from pipeline.model.tiny import make_tiny_model
    from pipeline.project_init import init_project

    if not (model / "config.json").is_file():
        make_tiny_model("idefics3", model)
    out = root / "tamis.yaml"
    init_project(pool, test=labels, model=str(model), out=out, force=True, question=QUESTION, answer_mode="closed")
    text = out.read_text(encoding="utf-8")
    raw = yaml.safe_load(text)
    raw.setdefault("data", {})["ground_truth"] = str(root / "ground_truth.jsonl")
    raw.setdefault("paths", {})["artifacts"] = str(root / "artifacts")
    return parse_config(raw, origin=str(out), root=root), text


def bench_of(cfg: ProjectConfig, args: argparse.Namespace) -> Bench:
    """The protocol: init's batch size per round (its cold start too), random and init's selector."""
    sel = cfg.select
    return Bench(seeds=args.seeds, initial=sel.batch_size, batch=sel.batch_size, rounds=args.rounds,
                 bootstrap=args.bootstrap, longtail=None, strategies={
                     "random": StrategySpec(),
                     DEFAULT: StrategySpec(cold_start=sel.cold_start, strategy=sel.strategy,
                                           diversity=sel.diversity)})


# ------------------------------------------------------------------------------------------------ the arms
def timed_restrictor(cfg_s: ProjectConfig, bench: Bench, cand: CandidatesConfig, space: Any, pool: list[str],
                     work: Work, log_to: list[dict[str, Any]]) -> Any:
    """The round's candidates as a project's round chooses them under `cand` (auto resolved per round by
    candidates_choice: all up to auto_above eligible, restrict above), each call's seconds and choice in `log_to`."""
    spec = bench.strategies[DEFAULT]
    sel_cfg = ec.with_candidates(le.select_config(cfg_s, spec, bench.batch), cand.model_copy(update={"method":
                                                                                                   "restrict"}))
    restrict = ec.restrictor(sel_cfg, pool=pool, space=space, seed=cfg_s.seed, cache_dir=work.art / "candidates",
                             n_classes=len(cfg_s.data.answers))

    def pick(labeled: list[str], phase: Any) -> list[str]:
        t0 = time.perf_counter()
        choice = candidates_choice(cand, eligible=len(pool) - len(labeled), embeddings_source=space.source)
        ids = restrict(labeled, phase) if choice.method == "restrict" else [s for s in pool if s not in set(labeled)]
        log_to.append({"s": time.perf_counter() - t0, "scored": len(ids), "method": choice.method,
                       "reason": choice.reason})
        return ids

    return pick


def run_arm(name: str, cand: CandidatesConfig | None, cfg_s: ProjectConfig, bench: Bench, data: Any, work: Work,
            space: Any) -> dict[str, Any]:
    """One arm of one seed: its probe run (run_probe), its selection seconds per round and, restricted, what its
    candidates cost and chose."""
    spec = bench.strategies["random" if name == "random" else DEFAULT]
    calls: list[dict[str, Any]] = []
    restrict = None if cand is None else timed_restrictor(cfg_s, bench, cand, space, data.pool, work, calls)
    t0 = time.perf_counter()
    le.cold_batch(spec, pool=data.pool, k=bench.initial, seed=cfg_s.seed, space=space, base_emb=None,
                  n_classes=len(cfg_s.data.answers))
    cold_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    run = le.run_probe(spec, cfg_s, bench, data, data.pool, space, restrict=restrict)
    # Per round: the probe's fit and class probabilities (milliseconds), the candidates, the selector; the cold
    # start (the same call again inside run_probe) is not a round's.
    out: dict[str, Any] = {"run": run, "cold_start_s": round(cold_s, 2),
                           "seconds": round(max(0.0, time.perf_counter() - t0 - cold_s) / bench.rounds, 3)}
    if calls:
        out["candidates"] = {"s_per_round": round(float(np.mean([c["s"] for c in calls])), 3),
                             "scored_per_round": [c["scored"] for c in calls],
                             "methods": sorted({c["method"] for c in calls}), "reason": calls[0]["reason"]}
    log.info("seed %d %-40s %.1f s/round, accuracy at %s labels: %.3f", cfg_s.seed, name, out["seconds"],
             run["labels"][-1], run["accuracy"][-1])
    return out


def earlier_arm(folder: Path, seed: int, name: str, rounds: int) -> Path | None:
    """--assemble: the newest file of this seed and arm with this protocol's rounds, whatever data digest keyed it.
    Arms measured at another commit keyed their prepared data with that commit's ingest and preprocess code versions
    (an edit to pipeline/config/sections.py moves both: its closure holds the whole config module), so the same unchanged
    files give another digest with byte-identical rows; without this every arm would re-run."""
    found = []
    for p in folder.glob(f"seed{seed}-{name}-*.json"):
        r = json.loads(p.read_text(encoding="utf-8"))["result"]
        if name == "full" or len(r["run"]["labels"]) == rounds + 1:
            found.append((p.stat().st_mtime, p))
    return max(found)[1] if found else None


def seed_result(cfg: ProjectConfig, bench: Bench, data: Any, work: Work, arms: dict[str, CandidatesConfig | None],
                seed: int, folder: Path, only: set[str] | None = None, assemble: bool = False) -> dict[str, Any]:
    """One seed (paired: one pool, space and seed for every arm): the full-data probe, then each of `arms` (name →
    its select.candidates, None to score all; `random` is the baseline). Each arm is kept in `folder` under a key of everything it
    depends on (the data, the config init wrote, the protocol, its candidates) with the code version that made it
    (counted in the result's code_versions): processes running other seeds or arms fill one folder that a final
    run reads, and an arm added later runs alone."""
    from pipeline.store import atomic_write_json, digest_json

    cfg_s = seeded(cfg, seed)
    space, fit_s = le.selection_space(cfg_s, data, data.pool, work)
    out: dict[str, Any] = {"fit_s": fit_s, "runs": {}, "seconds": {}, "candidates": {}}
    base = {"data": data.digest, "select": cfg.section("select"), "seed": seed,
            "bench": bench.model_dump(mode="json", exclude={"seeds", "bootstrap"})}
    for name, cand in {"full": None, **arms}.items():
        if only is not None and name not in only | {"full"}:
            continue
        key = digest_json({**base, "arm": name, "candidates": cand and cand.model_dump(mode="json")})[:16]
        path = folder / f"seed{seed}-{name}-{key}.json"
        if assemble and not path.is_file():
            path = earlier_arm(folder, seed, name, bench.rounds) or path
        if path.is_file():
            saved = json.loads(path.read_text(encoding="utf-8"))
            work.timer.versions[saved["code_version"]] += 1
            arm = saved["result"]
        else:
            arm = json.loads(json.dumps(le.probe_full(cfg_s, data, data.pool, space) if name == "full"
                                        else run_arm(name, cand, cfg_s, bench, data, work, space)))
            work.timer.versions[work.code] += 1
            atomic_write_json(path, {"code_version": work.code, "result": arm})
        if name == "full":
            out["full"] = arm["accuracy"]
            continue
        out["runs"][name], out["seconds"][name] = arm["run"], arm["seconds"]
        if "candidates" in arm:
            out["candidates"][name] = arm["candidates"]
    return out


def scoring_seconds(cfg: ProjectConfig, data: Any, work: Work, sizes: dict[str, int], folder: Path) -> dict[str, Any]:
    """The tiny 4-bit VLM's scoring seconds for each of `sizes` (name → rows, the first rows of the pool), with the
    base model (an adapter scores at the same cost) at init's score_batch_size: what an arm's round pays for its
    scored set. Measured once per (data, sizes, model) and kept in `folder`, with the load it ran under."""
    from pipeline.scoring import make_scorer
    from pipeline.store import atomic_write_json, digest_json

    key = digest_json({"data": data.digest, "sizes": sizes, "weights": work.model, "model": cfg.section("model"),
                       "score_batch_size": cfg.select.score_batch_size})[:16]
    path = folder / f"scoring-{key}.json"
    if path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        work.timer.versions[saved["code_version"]] += 1
        return {**saved["result"], "measured_earlier": True}
    scorer = make_scorer(work._load(Adapter(None, "base")), cfg.data.answers,
                         length_normalize=cfg.select.length_normalize, max_new_tokens=cfg.model.max_new_tokens)
    out: dict[str, Any] = {}
    for name, n in sizes.items():
        rows = [data.rows[s] for s in data.pool[:n]]
        load0, t0 = os.getloadavg()[0], time.perf_counter()
        scorer.score(rows, batch_size=cfg.select.score_batch_size, mc_passes=0, seed=0)
        s = time.perf_counter() - t0
        out[name] = {"rows": n, "seconds": round(s, 1), "rows_per_s": round(n / s, 1),
                     "load_1m": [round(load0, 2), round(os.getloadavg()[0], 2)]}
        log.info("tiny VLM scoring %s: %d rows in %.1f s", name, n, s)
    work.timer.versions[work.code] += 1
    atomic_write_json(path, {"code_version": work.code, "result": out})
    return out


# ------------------------------------------------------------------------------------------------ the figures
def arm_row(name: str, summary: dict[str, Any], runs: dict[str, list[dict[str, Any]]], full: list[float],
            per_seed: list[dict[str, Any]], bench: Bench, scoring: dict[str, Any]) -> dict[str, Any]:
    """One arm's figures: labels to 95 % / to random's final accuracy and their ratios to random's, the area, the
    selection seconds per round, what it scores a round and what that scoring costs the tiny VLM."""
    s = summary[name]
    keys = ("labels_to_95", "ratio_to_random_95", "ratio_to_random_95_ci", "labels_to_random_final",
            "ratio_to_random_final", "ratio_to_random_final_ci", "auc", "auc_ci")
    row: dict[str, Any] = {k: s.get(k) for k in keys}
    row["mean_curve"] = [round(float(x), 4) for x in s["mean"]]
    row["select_s_per_round"] = round(float(np.mean([p["seconds"][name] for p in per_seed])), 3)
    cand = [p["candidates"][name] for p in per_seed if name in p["candidates"]]
    if name == "random":
        return {**row, "scored_per_round": 0, "round_s_estimate": row["select_s_per_round"]}
    if not cand:  # scoring all: every pool sample, labeled ones included, each round
        scored = float(scoring["pool_rows"])
        score_s = scored / scoring["all"]["rows_per_s"]
    else:  # the candidates and the labeled samples (their mean over the rounds that select)
        scored = (float(np.mean([np.mean(c["scored_per_round"]) for c in cand])) + bench.initial
                  + bench.batch * (bench.rounds - 1) / 2)
        score_s = scored / scoring["candidates"]["rows_per_s"]
        row["candidates"] = {"s_per_round": round(float(np.mean([c["s_per_round"] for c in cand])), 3),
                             "methods": cand[0]["methods"], "reason": cand[0]["reason"]}
        row["vs_all_95"] = ec.paired_ratio(runs, full, name, DEFAULT, 95, bench.bootstrap)
        row["within_all_ci_95"] = _within(s.get("ratio_to_random_95"), summary[DEFAULT].get("ratio_to_random_95_ci"))
        row["within_all_ci_random_final"] = _within(s.get("ratio_to_random_final"),
                                                    summary[DEFAULT].get("ratio_to_random_final_ci"))
    return {**row, "scored_per_round": round(scored, 1), "score_s_per_round": round(score_s, 1),
            "round_s_estimate": round(score_s + row["select_s_per_round"], 1)}


def _within(x: float | None, ci: list[float | None] | None) -> bool | None:
    if x is None or not ci or None in ci:
        return None
    return bool(ci[0] <= x <= ci[1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    root = Path(args.work_dir) / f"pool-{args.pool}"
    pool, labels = write_project(root, args.pool, args.data_seed)
    cfg, yaml_text = init_config(root, pool, labels, Path(args.work_dir) / "model")
    bench = bench_of(cfg, args)
    data = le.prepare_data(cfg, bench)
    work = Work(cfg, data)
    cand = cfg.select.candidates
    size = cand.size_for(bench.batch)
    scoring = None
    if not (args.seeds_only or args.arms):  # first: it needs no seed, and seeds may still be running elsewhere
        scoring = scoring_seconds(cfg, data, work, {"candidates": size + bench.initial + bench.batch,
                                                    "all": args.score_rows or len(data.pool)}, root / "seeds")
    arms: dict[str, CandidatesConfig | None] = {
        "random": None, DEFAULT: None, RESTRICTED: cand.model_copy(update=args.restricted),
        **{f"{DEFAULT}+{k}": cand.model_copy(update=v) for k, v in args.extra.items()}}
    only = set(args.arms.split(",")) if args.arms else None
    per_seed = [seed_result(cfg, bench, data, work, arms, seed, root / "seeds", only, args.assemble)
                for seed in args.seeds]
    if args.seeds_only or only:
        return {"benchmark": "candidates_scale", "seeds_only": args.seeds, "folder": str(root / "seeds")}
    names = list(per_seed[0]["runs"])
    runs = {n: [p["runs"][n] for p in per_seed] for n in names}
    full = [p["full"] for p in per_seed]
    summary = summarize(runs, full, "random", bootstrap=bench.bootstrap)
    scoring["pool_rows"] = len(data.pool)
    rows = {n: arm_row(n, summary, runs, full, per_seed, bench, scoring) for n in names}
    head, base = rows[args.headline], summary[DEFAULT]
    for n, c in arms.items():
        if c is not None:  # the sources each restricted arm drew from (pipeline.strategies.candidates.shares_for)
            rows[n]["shares"] = shares_for(c, cfg.select.diversity)
    return {
        "benchmark": "candidates_scale", "pool_size": len(data.pool), "seeds": args.seeds, "data": data.counts,
        "selector": DEFAULT, "select_candidates": {**cand.model_dump(mode="json"), "size_used": size,
                                                    "shares_resolved": shares_for(cand, cfg.select.diversity)},
        "headline_arm": args.headline, "restricted_override": args.restricted, "assembled": args.assemble,
        "ratio_candidates": head["ratio_to_random_95"], "ratio_all": base.get("ratio_to_random_95"),
        "ratio_all_ci": base.get("ratio_to_random_95_ci"), "ratio_candidates_ci": head["ratio_to_random_95_ci"],
        "within_ci": head["within_all_ci_95"], "candidates_vs_all_95": head["vs_all_95"],
        "round_s_estimate": {n: r["round_s_estimate"] for n, r in rows.items()},
        "full_data_accuracy": round(float(np.mean(full)), 4), "full_data_accuracy_std": round(float(np.std(full)), 4),
        "arms": rows, "scoring": scoring, "labels": runs["random"][0]["labels"],
        "embeddings_fit_seconds": [round(p["fit_s"], 1) for p in per_seed],
        "init_config": yaml_text,
        "reference_learner": "logistic regression (C=10) on the selection embeddings, labels from the ground truth, "
                             "on the selections pipeline.selection makes (benchmarks/label_efficiency.py run_probe)",
        "protocol": f"{bench.initial} (each arm's own cold start over the whole pool) + {bench.rounds} × "
                    f"{bench.batch} labels, paired seeds; ratios: labels to 95 % of full-data accuracy (mean "
                    "curve) ÷ random's, paired bootstrap 95 % interval; round_s_estimate: selection seconds (probe "
                    "runs) + the tiny VLM's scoring seconds for what the arm scores (measured once, `scoring`)",
        "wall_seconds": round(time.monotonic() - t0, 1), "timings": work.timer.summary(),
        "cache_code_versions": dict(sorted(work.timer.versions.items())),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    started = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", type=int, default=24_000, help="pool images (init picks pixels above 20,000)")
    ap.add_argument("--seeds", type=lambda v: [int(s) for s in v.split(",")], default=list(range(8)))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--data-seed", type=int, default=0, help="the jitter of the generated images")
    ap.add_argument("--extra", type=json.loads, default={},
                    help='more restricted arms: JSON {name: select.candidates fields}, e.g. \'{"size2000": '
                         '{"size": 2000}}\'')
    ap.add_argument("--work-dir", type=str, default="/tmp/tamis-candidates-scale")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--restricted", type=json.loads, default={},
                    help="select.candidates fields that replace init's for the +candidates arm (e.g. the shares of an "
                         "earlier default, to keep its runs)")
    ap.add_argument("--headline", type=str, default=RESTRICTED, help="the restricted arm the top-level "
                    "ratio_candidates reports")
    ap.add_argument("--assemble", action="store_true", help="an arm without a file under this run's data digest "
                    "is read from the newest file of its seed and name with the same rounds (see earlier_arm)")
    ap.add_argument("--arms", type=str, default=None, help="with --seeds-only: only these arms (comma-separated "
                    "names, e.g. an --extra arm added later)")
    ap.add_argument("--score-rows", type=int, default=None, help="rows the all-arm scoring time is measured on "
                    "(default: the whole pool; fewer for a quick look)")
    ap.add_argument("--seeds-only", action="store_true", help="run (or reuse) the seeds' arms and stop: seeds in "
                    "several processes fill one folder, a final run without it summarizes them and times the scoring")
    args = ap.parse_args(argv)
    import datasets
    import torch

    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    for name in ("candidates_scale", "label_efficiency"):
        logging.getLogger(name).setLevel(logging.INFO)
    result = run(args)
    if "seeds_only" in result:
        return result
    return write_result(result, args.json_out, started=started, config=vars(args) | {"json_out": None},
                        code_versions=list(result["cache_code_versions"]))


if __name__ == "__main__":
    main()
