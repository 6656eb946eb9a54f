"""The consensus section of the annotators benchmark: Dawid–Skene against majority vote on a simulated crowd.

Protocol (the label-efficiency benchmark's fairness rules):
- the digits pool (pipeline.data.demo.write_digits: sklearn's 1,797 digits, a stratified quarter held out as test);
- a simulated crowd of 3 annotators, 95 / 80 / 60 % accurate (a wrong answer drawn uniformly from the other nine),
  2 of them per sample, drawn per sample; the crowd's answers go through the real path: a Label Studio export of
  the pool → `simulate_annotators` → a Label Studio JSON in the inbox → `import_labels` (votes log + ledger) →
  `apply_consensus` with each method;
- seeds are paired: within a seed every method decides the same votes;
- methods: majority vote with ties broken at random (the usual baseline: the number `majority_accuracy`), tamis's
  importer rule (ties rejected: its coverage and accuracy reported beside), Dawid–Skene (full confusion matrices),
  and one-coin Dawid–Skene (one accuracy per annotator), both from crowd-kit;
- label accuracy over every pool sample (an undecided one counts as wrong); a model trained on each method's labels:
  the label-efficiency benchmark's reference learner (logistic regression, C = 10, on the selection embeddings —
  here the `pixels` embedder, PCA-whitened pixels fitted on the pool), accuracy on the test split;
- the annotators' estimated accuracies against what each actually got right (per seed; mean absolute error);
- intervals: a paired bootstrap (2,000 draws) over seeds and, within each drawn seed, over samples.

`run(quick)` returns the section's dict; benchmarks/annotators.py writes it (with provenance) into
benchmarks/results/annotators.json. Alone: `python benchmarks/_annotators_consensus.py [--quick] [--json-out F]`.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "NO_ALBUMENTATIONS_UPDATE": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)

log = logging.getLogger("bench.consensus")

CROWD = [("careful", 0.95), ("average", 0.80), ("careless", 0.60)]
LABELS_PER_SAMPLE = 2
METHODS = ("majority", "dawid_skene", "one_coin")
DIGITS = [str(i) for i in range(10)]
BOOTSTRAP = 2000


def _digits(root: Path, limit: int | None) -> tuple[Any, dict[str, str], list[str], list[str]]:
    """(pool dataset with the prepared-schema columns, truth by sample_id, pool IDs, test IDs)."""
    from datasets import Dataset

    from pipeline.data.demo import write_digits

    out = write_digits(root / "digits", limit=limit, seed=0)
    manifest = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
    truth_rows = [json.loads(x) for x in (out / "ground_truth.jsonl").read_text().splitlines()]
    rows, pool, test = [], [], []
    for m, t in zip(manifest, truth_rows, strict=True):
        data = (out / m["image"]).read_bytes()
        rows.append({"sample_id": t["sample_id"], "image": data, "image_path": str(out / m["image"]),
                     "question": m["question"], "answer": None, "split": m["split"], "prepared": data})
        (pool if m["split"] == "pool" else test).append(t["sample_id"])
    return Dataset.from_list(rows), {t["sample_id"]: t["answer"] for t in truth_rows}, pool, test


def _embeddings(ds: Any, pool: list[str]) -> dict[str, np.ndarray]:
    """The `pixels` selection embeddings (pipeline.embedders.PixelsEmbedder), fitted on the pool images."""
    from PIL import Image

    from pipeline.embedders import PixelsEmbedder

    ids = list(ds["sample_id"])
    images = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in ds["prepared"]]
    in_pool = set(pool)
    emb = PixelsEmbedder(side=16, dim=32).fit([im for s, im in zip(ids, images, strict=True) if s in in_pool])
    return dict(zip(ids, emb.embed(images), strict=True))


def _probe_accuracy(labels: dict[str, str], emb: dict[str, np.ndarray], test: list[str],
                    truth: dict[str, str]) -> float:
    from sklearn.linear_model import LogisticRegression

    ids = sorted(labels)
    clf = LogisticRegression(C=10.0, max_iter=2000).fit(np.stack([emb[s] for s in ids]), [labels[s] for s in ids])
    pred = clf.predict(np.stack([emb[s] for s in test]))
    return float(np.mean([p == truth[s] for p, s in zip(pred, test, strict=True)]))


def _one_seed(seed: int, ds: Any, truth: dict[str, str], pool: list[str], test: list[str],
              emb: dict[str, np.ndarray], work: Path) -> dict[str, Any]:
    from pipeline.annotation.consensus import apply_consensus, read_votes
    from pipeline.annotation.export import export_selection
    from pipeline.annotation.labels import import_labels
    from pipeline.annotation.ledger import Ledger, ledger_path
    from pipeline.annotation.simulate import simulate_annotators
    from pipeline.config import SimulatedAnnotator, parse_config

    gt = work / "ground_truth.jsonl"
    work.mkdir(parents=True, exist_ok=True)
    gt.write_text("".join(json.dumps({"sample_id": s, "answer": truth[s]}) + "\n" for s in pool))
    cfg = parse_config({"paths": {"artifacts": str(work / "artifacts")},
                        "data": {"answers": DIGITS, "ground_truth": str(gt)},
                        "annotate": {"formats": ["label_studio"]}}, root=work)
    export = work / "artifacts" / "rounds" / "000" / "export"
    sel = [{"sample_id": s, "rank": k, "score": 0.0, "scores": {}} for k, s in enumerate(pool)]
    export_selection(sel, ds.filter(lambda r: r["split"] == "pool"), cfg.annotate, cfg.data.answers, cfg.artifacts, export, round_index=0)
    crowd = [SimulatedAnnotator(name=n, accuracy=a, seconds=30.0) for n, a in CROWD]
    f = simulate_annotators(export, gt, cfg.artifacts / "inbox", annotators=crowd, redundancy=LABELS_PER_SAMPLE,
                            round_index=0, seed=seed)
    ledger = Ledger(ledger_path(cfg.artifacts))
    rep = import_labels(f, known_ids=set(pool), answers=DIGITS, ledger=ledger, round_index=0,
                        rejections_dir=cfg.artifacts / "rejections")
    votes = read_votes(cfg.artifacts)
    real = {n: float(np.mean([v.label == truth[v.sample_id] for vs in votes.values() for v in vs
                              if v.annotator == n])) for n, _ in CROWD}
    tie_rng = random.Random(f"bench-consensus-ties:{seed}")
    correct: dict[str, np.ndarray] = {}
    out: dict[str, Any] = {"seed": seed, "votes": sum(len(v) for v in votes.values()), "real_accuracy": real,
                           "ties": sum(c.outcome == "tie" for c in rep.conflicts)}
    # tamis's importer rule, as the ledger holds it after the import: ties rejected.
    imported = ledger.labels()
    out["majority_ties_rejected"] = {
        "coverage": len(imported) / len(pool),
        "accuracy_of_labeled": float(np.mean([imported[s] == truth[s] for s in imported])),
        "accuracy_over_all": float(np.mean([imported.get(s) == truth[s] for s in pool])),
        "model_accuracy": _probe_accuracy(imported, emb, test, truth)}
    for method in METHODS:
        t0 = time.time()
        # Each method decides the same votes from the same ledger: the import's entries, before any consensus.
        led_copy = ledger_path(cfg.artifacts).read_bytes()
        rec = apply_consensus(cfg.artifacts, cfg.annotate.model_copy(update={"consensus": method}), answers=DIGITS,
                              round_index=0)
        labels = {s: d.label for s, d in rec.samples.items()}
        if method == "majority":  # the usual baseline: a tie broken at random
            labels = {s: lab if lab is not None else tie_rng.choice(sorted(rec.samples[s].votes))
                      for s, lab in labels.items()}
        else:
            assert labels == {s: lab for s, lab in Ledger(ledger_path(cfg.artifacts)).labels().items()
                              if s in labels}, "the ledger must hold the derived consensus"
        ledger_path(cfg.artifacts).write_bytes(led_copy)
        correct[method] = np.array([labels.get(s) == truth[s] for s in pool], dtype=float)
        est = {n: rec.annotators[n].accuracy for n, _ in CROWD}
        out[method] = {"accuracy": float(correct[method].mean()), "seconds": round(time.time() - t0, 2),
                       "model_accuracy": _probe_accuracy(labels, emb, test, truth),
                       **({"annotator_accuracy": est,
                           "annotator_abs_error": {n: abs(est[n] - real[n]) for n in real}}
                          if method != "majority" else {})}
    out["_correct"] = correct
    return out


def _paired_ci(per_seed: list[dict[str, Any]], a: str, b: str, n: int = BOOTSTRAP) -> list[float]:
    """95 % interval of mean(a) − mean(b): seeds resampled, then samples within each drawn seed, pairs kept."""
    rng = np.random.default_rng(0)
    diffs = [r["_correct"][a] - r["_correct"][b] for r in per_seed]
    stats = []
    for _ in range(n):
        pick = rng.integers(0, len(diffs), len(diffs))
        stats.append(np.mean([diffs[i][rng.integers(0, len(diffs[i]), len(diffs[i]))].mean() for i in pick]))
    return [round(float(np.percentile(stats, 2.5)), 4), round(float(np.percentile(stats, 97.5)), 4)]


def _seed_ci(values: list[float], n: int = BOOTSTRAP) -> list[float]:
    rng = np.random.default_rng(1)
    v = np.asarray(values)
    stats = [v[rng.integers(0, len(v), len(v))].mean() for _ in range(n)]
    return [round(float(np.percentile(stats, 2.5)), 4), round(float(np.percentile(stats, 97.5)), 4)]


def run(quick: bool = False) -> dict[str, Any]:
    """The consensus section: {majority_accuracy, dawid_skene_accuracy, dawid_skene_minus_majority (a fraction),
    its paired bootstrap interval, one_coin_*, annotator_accuracy_estimates vs truth, model_accuracy per consensus,
    seeds, per_seed}."""
    seeds = [0, 1] if quick else [0, 1, 2, 3, 4]
    with tempfile.TemporaryDirectory(prefix="tamis-bench-consensus-") as tmp:
        root = Path(tmp)
        ds, truth, pool, test = _digits(root, 400 if quick else None)
        emb = _embeddings(ds, pool)
        truth_model = _probe_accuracy({s: truth[s] for s in pool}, emb, test, truth)
        per_seed = []
        for seed in seeds:
            per_seed.append(_one_seed(seed, ds, truth, pool, test, emb, root / f"seed{seed}"))
            log.info("seed %d: %s", seed, {m: round(per_seed[-1][m]["accuracy"], 4) for m in METHODS})

    def mean(method: str, key: str = "accuracy") -> float:
        return round(float(np.mean([r[method][key] for r in per_seed])), 4)

    def estimates(method: str) -> dict[str, Any]:
        return {n: {"true": round(float(np.mean([r["real_accuracy"][n] for r in per_seed])), 4),
                    "estimated": round(float(np.mean([r[method]["annotator_accuracy"][n] for r in per_seed])), 4),
                    "mean_abs_error": round(float(np.mean([r[method]["annotator_abs_error"][n] for r in per_seed])),
                                            4)}
                for n, _ in CROWD}

    rejected = {k: round(float(np.mean([r["majority_ties_rejected"][k] for r in per_seed])), 4)
                for k in ("coverage", "accuracy_of_labeled", "accuracy_over_all", "model_accuracy")}
    return {
        "crowd": {n: a for n, a in CROWD}, "labels_per_sample": LABELS_PER_SAMPLE, "pool": len(pool),
        "test": len(test), "seeds": seeds, "quick": quick,
        "majority_accuracy": mean("majority"),
        "dawid_skene_accuracy": mean("dawid_skene"),
        "one_coin_accuracy": mean("one_coin"),
        "dawid_skene_minus_majority": round(mean("dawid_skene") - mean("majority"), 4),
        "dawid_skene_minus_majority_ci": _paired_ci(per_seed, "dawid_skene", "majority"),
        "one_coin_minus_majority": round(mean("one_coin") - mean("majority"), 4),
        "one_coin_minus_majority_ci": _paired_ci(per_seed, "one_coin", "majority"),
        "majority_ties_rejected": rejected,
        "annotator_accuracy_estimates": {"dawid_skene": estimates("dawid_skene"), "one_coin": estimates("one_coin")},
        "model_accuracy": {"true_labels": round(truth_model, 4),
                           **{m: mean(m, "model_accuracy") for m in METHODS},
                           "majority_ties_rejected": rejected["model_accuracy"]},
        "model_accuracy_ci": {m: _seed_ci([r[m]["model_accuracy"] for r in per_seed]) for m in METHODS},
        "model": "logistic regression (C=10) on pixels PCA-32 embeddings, test split",
        "per_seed": [{k: v for k, v in r.items() if k != "_correct"} for r in per_seed],
    }


def main() -> None:
    from benchmarks._results import write_result

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("pipeline", "datasets", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    started = time.time()
    result = run(quick=args.quick)
    write_result({"benchmark": "annotators.consensus", **result}, args.json_out,
                 config={"quick": args.quick, "crowd": CROWD, "labels_per_sample": LABELS_PER_SAMPLE},
                 started=started)


if __name__ == "__main__":
    main()
