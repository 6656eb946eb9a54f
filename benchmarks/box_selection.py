"""What box selection buys against random: mAP@0.5 per labeled budget on generated scenes, paired seeds.

The learner is a REFERENCE learner, not the VLM: a tiny CenterNet-style detector trained from scratch on the CPU
(benchmarks/_box_learner.py), retrained from scratch at each budget. tamis's tiny test model does not learn boxes,
and a VLM round per budget would take hours here; the reference learner answers with boxes as a VLM does, so the
library's parts run on its answers unchanged:

- `random`: the next images drawn at random (the baseline);
- `augment_consistency+balanced`: pipeline.boxes.uncertainty's `augment_consistency` (the image against its
  horizontal flip and its 0.75 rescale, `VIEWS`, boxes mapped back with `View.to_original`), then
  pipeline.boxes.selection.class_balanced over the predicted boxes;
- `sample_agreement+balanced`: `sample_agreement` over MC-dropout answers (`--samples` passes with the learner's
  Dropout2d on), then class_balanced.

An answer is the learner's boxes scoring ≥ `--answer-score` (what a VLM would state; the scores themselves are the
reference learner's, a VLM has none); the test mAP uses every box ≥ 0.05 with its score, as detectors are scored.
Scenes (pipeline/boxes/scenes.py): 1–4 shapes, sides 20–45 % of the shorter side, canvases 2:1 to 1:2. Each seed
draws its own pool, test set and first random `--start` images, shared by every strategy (paired); each budget step
adds `--step` images. mAP@0.5 by faster-coco-eval (pipeline.boxes.evaluation.box_map). Intervals: 95 % t-intervals
over the seeds, of each strategy's mAP and of its paired difference from random.

    nice -n 15 python benchmarks/box_selection.py --json-out benchmarks/results/box_selection.json
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._results import write_result  # noqa: E402

T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}
SCENE_KW = {"size": (0.2, 0.45), "objects": (1, 4)}


@dataclass
class Pool:
    scenes: list  # Scene
    prepared: list  # Prepared, the learner's input
    views: list  # per VIEW: the Prepared of each scene's view


def _pool(n: int, seed: int) -> Pool:
    from benchmarks._box_learner import prepare
    from pipeline.boxes.scenes import make_scenes, render
    from pipeline.boxes.uncertainty import VIEWS

    scenes = make_scenes(n, seed=seed, **SCENE_KW)
    prepared, views = [], [[] for _ in VIEWS]
    for s in scenes:
        image = render(s)
        prepared.append(prepare(image))
        for v, view in enumerate(VIEWS):
            views[v].append(prepare(view.apply(image)))
    return Pool(scenes, prepared, views)


def _answer(boxes, min_score: float):
    return [b for b in boxes if (b.score or 0.0) >= min_score]


def _evidence(net, pool: Pool, ids: Sequence[int], args, kind: str) -> tuple[dict, dict]:
    """(id → BoxEvidence, id → the answer's boxes) for the unlabeled `ids`."""
    from benchmarks._box_learner import predict
    from pipeline.boxes.scenes import SHAPES
    from pipeline.boxes.uncertainty import VIEWS, BoxEvidence

    images = [pool.prepared[i] for i in ids]
    answers = [_answer(b, args.answer_score) for b in predict(net, images, SHAPES)]
    others: list[list[list]] = [[] for _ in ids]
    if kind == "augment_consistency":
        for v, view in enumerate(VIEWS):
            got = predict(net, [pool.views[v][i] for i in ids], SHAPES)
            for j, (i, boxes) in enumerate(zip(ids, got, strict=True)):
                s = pool.scenes[i]
                others[j].append(view.to_original(_answer(boxes, args.answer_score), s.width, s.height))
    else:
        for _ in range(args.samples):
            for j, boxes in enumerate(predict(net, images, SHAPES, dropout=True)):
                others[j].append(_answer(boxes, args.answer_score))
    field = "views" if kind == "augment_consistency" else "samples"
    evidence = {i: BoxEvidence(boxes=a, **{field: o}) for i, a, o in zip(ids, answers, others, strict=True)}
    return evidence, dict(zip(ids, answers, strict=True))


def _select(strategy: str, net, pool: Pool, labeled: list[int], k: int, rng: random.Random, args) -> list[int]:
    from pipeline.boxes.scenes import SHAPES
    from pipeline.boxes.selection import class_balanced
    from pipeline.boxes.uncertainty import get_box_uncertainty

    unlabeled = sorted(set(range(len(pool.scenes))) - set(labeled))
    if strategy == "random":
        return rng.sample(unlabeled, k)
    kind = strategy.split("+")[0]
    evidence, answers = _evidence(net, pool, unlabeled, args, kind)
    part = get_box_uncertainty(kind)
    scores = {str(i): part.score(e).image for i, e in evidence.items()}
    counts: dict[str, int] = {}
    for i in labeled:
        for b in pool.scenes[i].boxes:
            counts[b.label] = counts.get(b.label, 0) + 1
    picks = class_balanced(scores, {str(i): a for i, a in answers.items()}, k, labels=SHAPES, labeled_counts=counts)
    return [int(p) for p in picks]


def _map50(net, test: Pool) -> float:
    from benchmarks._box_learner import predict
    from pipeline.boxes.evaluation import box_map
    from pipeline.boxes.scenes import SHAPES

    got = predict(net, test.prepared, SHAPES)
    truth = {s.name: list(s.boxes) for s in test.scenes}
    return box_map(truth, {s.name: b for s, b in zip(test.scenes, got, strict=True)}, SHAPES, resamples=0)["map50"]


def run_seed(seed: int, strategies: Sequence[str], args, log: Callable[[str], None]) -> dict:
    """One seed: its pool, test set and first random images; each strategy's mAP@0.5 per budget."""
    from benchmarks._box_learner import train
    from pipeline.boxes.scenes import SHAPES

    pool, test = _pool(args.pool, seed), _pool(args.test, 10_000 + seed)
    start = random.Random(seed).sample(range(args.pool), args.start)

    def fit(ids: list[int], tag: int):
        return train([(pool.prepared[i], pool.scenes[i].boxes) for i in ids], SHAPES, steps=args.steps,
                     seed=seed * 100 + tag)

    first = fit(start, 0)
    first_map = _map50(first, test)
    out = {}
    for strategy in strategies:
        rng, labeled, net, curve = random.Random(seed + 1), list(start), first, [first_map]
        for step in range(1, args.rounds + 1):
            labeled += _select(strategy, net, pool, labeled, args.step, rng, args)
            net = fit(labeled, step)
            curve.append(_map50(net, test))
            log(f"seed {seed} {strategy} {len(labeled)} labeled: map50 {curve[-1]:.3f}")
        out[strategy] = curve
    return out


def _interval(values: Sequence[float]) -> list[float]:
    n = len(values)
    if n < 2:
        return [values[0], values[0]] if values else [math.nan, math.nan]
    half = T95.get(n - 1, 1.96) * statistics.stdev(values) / math.sqrt(n)
    mean = statistics.fmean(values)
    return [round(mean - half, 4), round(mean + half, 4)]


def summarise(runs: dict[int, dict[str, list[float]]], budgets: list[int]) -> dict:
    """Per strategy and budget: the mean mAP@0.5 over seeds with its interval, and the paired difference from
    random with its interval; the same for the mean over the budgets after the first (the curve's area)."""
    strategies = list(next(iter(runs.values())))
    out = {}
    for s in strategies:
        rows = []
        for b, budget in enumerate(budgets):
            vals = [runs[seed][s][b] for seed in runs]
            diff = [runs[seed][s][b] - runs[seed]["random"][b] for seed in runs]
            rows.append({"labeled": budget, "map50": round(statistics.fmean(vals), 4), "map50_ci95": _interval(vals),
                         "minus_random": round(statistics.fmean(diff), 4), "minus_random_ci95": _interval(diff)})
        area = [statistics.fmean(runs[seed][s][1:]) - statistics.fmean(runs[seed]["random"][1:]) for seed in runs]
        out[s] = {"per_budget": rows, "mean_minus_random_after_start": round(statistics.fmean(area), 4),
                  "mean_minus_random_after_start_ci95": _interval(area)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--strategies", nargs="+",
                    default=["random", "augment_consistency+balanced", "sample_agreement+balanced"])
    ap.add_argument("--pool", type=int, default=400)
    ap.add_argument("--test", type=int, default=150)
    ap.add_argument("--start", type=int, default=30)
    ap.add_argument("--step", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200, help="training steps (batch 16) per budget, from scratch")
    ap.add_argument("--samples", type=int, default=6, help="MC-dropout answers for sample_agreement")
    ap.add_argument("--answer-score", type=float, default=0.3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--add-to", default=None, help="a results JSON of this benchmark with the same settings: its "
                    "seeds' runs are kept and summarised with this run's (other seeds)")
    args = ap.parse_args()
    if "random" not in args.strategies:
        ap.error("--strategies must include random: every other strategy is compared with it")
    import torch

    torch.set_num_threads(args.threads)
    started = time.time()
    log = lambda msg: print(f"[{time.time() - started:6.0f} s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    earlier, before = _earlier(args)
    runs = {**earlier, **{seed: run_seed(seed, args.strategies, args, log) for seed in args.seeds}}
    budgets = [args.start + args.step * r for r in range(args.rounds + 1)]
    write_result({"learner": "reference: tiny CenterNet-style CNN from scratch (benchmarks/_box_learner.py), "
                             "not the VLM", "budgets": budgets, "summary": summarise(runs, budgets),
                  "runs": {str(k): v for k, v in runs.items()}, "settings": _settings(args), **before}, args.json_out,
                 config=vars(args),
                 started=started)


def _earlier(args) -> tuple[dict[int, dict[str, list[float]]], dict]:
    """The runs of `--add-to` (same settings, other seeds) and where they came from."""
    if not args.add_to:
        return {}, {}
    import json

    old = json.loads(Path(args.add_to).read_text(encoding="utf-8"))
    mine, theirs = _settings(args), old["settings"]
    moved = [k for k in mine if k not in ("seeds", "threads") and theirs.get(k) != mine[k]]
    seeds = sorted(int(k) for k in old["runs"])
    if moved or set(seeds) & set(args.seeds):
        sys.exit(f"--add-to {args.add_to}: settings {moved} differ or seeds overlap ({seeds}); run with its "
                 "settings and other seeds")
    return ({int(k): v for k, v in old["runs"].items()},
            {"earlier_runs": [*old.get("earlier_runs", []), {"seeds": seeds, "commit": old["commit"],
                                                               "wall_s": old["wall_s"], "machine": old["machine"]}]})


def _settings(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("json_out", "add_to")}


if __name__ == "__main__":
    main()
