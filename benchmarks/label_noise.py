"""Label-error detection under planted noise (none included), and what re-labeling the flagged samples buys.

Digits (scikit-learn's 8×8, upscaled to 32 px RGB) with the tiny random-weight idefics3 model in 4-bit + LoRA. Each
seed draws an unlabeled pool (`--n` labeled + `--pool-n` never labeled) and a test slice. For each noise rate the
simulated annotator labels the `--n` training samples with that fraction of answers flipped (through the real
export → simulate → import path); the label check runs as a round runs it (pipeline.labelcheck.detect_label_issues):
k-fold out-of-sample probabilities, calibrated, abstaining when too weak, combined with kNN label consistency in the
selection embedding space (`--embeddings`, fitted on the pool's images only, never the test slice), issues bounded
by confident learning's noise-rate estimate. The flips recorded in the annotator's sidecar are the ground truth:

- precision / recall of what the check reports; false_alarms_at_zero_noise: reported / checked at 0 % noise;
  precision_at_flipped: precision of its top-m for m planted flips (chance = the noise rate);
- queued: the issues above labelcheck.min_confidence (what a round would send back), and their precision;
- expected_false_alarms: the check's own estimate of how many reported labels are right ("about N of these may be
  correct labels"), next to the true count (false_alarms);
- accuracy on a held-out test slice of an adapter trained on the noisy labels, on the labels after re-labeling the
  flagged samples (the true answer from the ground truth, as an annotator would give), and after re-labeling as
  many random samples (the same label budget spent blindly); plus the clean-label accuracy for reference;
- ablation (free: the same probabilities): the model signal alone, and the kNN signal alone.

    python benchmarks/label_noise.py --json-out benchmarks/results/label_noise.json
    python benchmarks/label_noise.py --quick      # noise 0.1, seed 0, no random baseline

Top-level lists are means over the seeds (each seed its own data split, flips and folds), one value per noise rate;
`per_seed` holds every run. A training whose labels equal an earlier one's (0 % noise, nothing flagged) is not
repeated: training is seeded, so its accuracy is the same. `--work-dir` keeps adapters, so a re-run after changing
only the detector re-trains only the re-labeled runs whose labels changed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
for k, v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
             "NO_ALBUMENTATIONS_UPDATE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(k, v)

from benchmarks._results import CacheFolder, write_result  # noqa: E402

DIGITS = [str(d) for d in range(10)]
log = logging.getLogger("label_noise")
KEYS = ("precision", "recall", "precision_at_flipped", "flagged", "flipped", "false_alarms", "expected_false_alarms",
        "queued", "precision_queued", "oos_accuracy", "abstained", "accuracy_noisy", "accuracy_relabeled",
        "accuracy_random_relabel", "accuracy_gain")


def _config(args: argparse.Namespace, work: Path):
    from pipeline.config import ProjectConfig

    return ProjectConfig.model_validate({
        "seed": args.seed,
        "paths": {"artifacts": str(work / "artifacts")},
        "data": {"answers": DIGITS},
        "model": {"name_or_path": str(work / "tiny-idefics3"), "family": "idefics3", "build_tiny_if_missing": True,
                  "mode": "qlora", "lora_r": args.lora_r, "lora_alpha": 2 * args.lora_r, "lora_dropout": 0.0},
        "train": {"max_steps": args.steps, "learning_rate": args.lr, "batch_size": args.batch,
                  "effective_batch_size": args.batch, "gradient_checkpointing": False, "warmup_ratio": 0.05,
                  "checkpoint_every": 10_000},
        "labelcheck": {"kfold": args.k},
        "select": {"score_batch_size": 64, "embeddings": args.embeddings},
        "annotate": {"formats": ["label_studio", "images"]},
    })


def digits_dataset(out: Path, n_train: int, n_pool: int, n_test: int, seed: int):
    """(datasets.Dataset of prepared rows, ground-truth path, training IDs): the demo digits, 32 px RGB, square-padded;
    split "pool" (n_train + n_pool, the training slice a seeded class-balanced draw from it) and "test"."""
    import numpy as np
    from datasets import Dataset

    from pipeline.config import PreprocessConfig
    from pipeline.data.demo import write_digits
    from pipeline.preprocess import encode_png, prepare_image

    total = n_train + n_pool + n_test
    write_digits(out, limit=total, test_fraction=n_test / total, seed=seed)
    truth = {json.loads(line)["image"]: json.loads(line) for line in (out / "ground_truth.jsonl").open()}
    pre = PreprocessConfig(size=32, pad="square")
    rows = []
    for line in (out / "manifest.jsonl").open():
        m = json.loads(line)
        data = (out / m["image"]).read_bytes()
        rows.append({"sample_id": truth[m["image"]]["sample_id"], "question": m["question"],
                     "answer": truth[m["image"]]["answer"], "split": m["split"], "image_path": str(out / m["image"]),
                     "prepared": encode_png(prepare_image(data, pre, size=32, max_pixels=1 << 26))})
    by_class: dict[str, list[str]] = {}
    for i in np.random.default_rng(seed).permutation(len(rows)):
        if rows[i]["split"] == "pool":
            by_class.setdefault(rows[i]["answer"], []).append(rows[i]["sample_id"])
    dealt = [ids[j] for j in range(max(map(len, by_class.values()))) for _, ids in sorted(by_class.items())
             if j < len(ids)]
    return Dataset.from_list(rows), out / "ground_truth.jsonl", sorted(dealt[:n_train])


def selection_embeddings(cfg, ds, out: Path) -> tuple[list[str], object]:
    """The selection embeddings of every row (fitted on the pool split only), cached in `out`."""
    from pipeline.embeddings import (
        compute_selection_embeddings,
        embeddings_key,
        embeddings_spec,
        load_selection_embeddings,
    )
    from pipeline.store import find_valid_manifest

    inputs = {"prepared": "label-noise-benchmark"}
    if find_valid_manifest(out, embeddings_key(embeddings_spec(cfg), inputs)) is None:
        compute_selection_embeddings(embeddings_spec(cfg), ds, out, inputs=inputs)
    return load_selection_embeddings(out)


def noisy_labels(cfg, ds, gt: Path, train_ids: list[str], noise: float, work: Path) -> tuple[dict[str, str], set[str]]:
    """Labels of the training slice as the simulated annotator gives them, and the IDs it flipped."""
    from pipeline.annotation import Ledger, export_selection, import_labels, simulate_annotator
    from pipeline.annotation.simulate import sidecar_path

    export = work / "artifacts" / "rounds" / "000" / "export"
    export_selection([{"sample_id": s, "rank": i, "score": 0.0} for i, s in enumerate(train_ids)], ds, cfg.annotate, cfg.data.answers, cfg.artifacts, export,
                     round_index=0)
    f = simulate_annotator(export, gt, work / "inbox", round_index=0, noise=noise, seed=cfg.seed)
    ledger = Ledger(work / "labels.jsonl")
    import_labels(f, known_ids=set(train_ids), answers=DIGITS, ledger=ledger, round_index=0,
                  rejections_dir=work / "rejections")
    flipped = {x["sample_id"] for x in json.loads(sidecar_path(f).read_text())["flipped"]}
    return ledger.labels(), flipped


class Trainer:
    """Test accuracy of an adapter trained on a label set; a label set trained on before is not trained again."""

    def __init__(self, cfg, by_id: dict, test: list[dict], root: Path):
        self.cfg, self.by_id, self.test, self.root = cfg, by_id, test, root
        self.done: dict[str, float] = {}

    def rows(self, labels: dict[str, str]) -> list[dict]:
        return [{"sample_id": s, "prepared": self.by_id[s]["prepared"], "question": self.by_id[s]["question"],
                 "answer": lab} for s, lab in sorted(labels.items())]

    def accuracy(self, labels: dict[str, str]) -> float:
        from pipeline.model.loading import load_model
        from pipeline.model.train import TrainSpec, train_adapter
        from pipeline.scoring import ClosedSetScorer
        from pipeline.store import digest_json

        key = digest_json(sorted(labels.items()))[:16]
        if key not in self.done:
            res = train_adapter(TrainSpec.of(self.cfg), self.rows(labels), self.root / f"train-{key}", progress=False)
            loaded = load_model(self.cfg.model, adapter=res.adapter_dir)
            probs = ClosedSetScorer(loaded, DIGITS).score(self.test, batch_size=64).probs
            self.done[key] = float((probs.argmax(1) == [DIGITS.index(r["answer"]) for r in self.test]).mean())
        return self.done[key]


def _scores(flagged: set[str], flipped: set[str], checked: int) -> dict:
    hit = len(flagged & flipped)
    return {"flagged": len(flagged), "precision": round(hit / len(flagged), 4) if flagged else None,
            "recall": round(hit / len(flipped), 4) if flipped else None,
            "flagged_share": round(len(flagged) / checked, 4) if checked else None}


def detect(oos, given: list[str], space, lc, use: tuple[str, ...]):
    """The round's label check on these probabilities, with the signals in `use` ("model", "knn")."""
    from pipeline.labelcheck import detect_label_issues

    return detect_label_issues(oos.probs, given, DIGITS, sample_ids=oos.sample_ids,
                               knn=space if "knn" in use else None, use_model="model" in use,
                               min_oos_accuracy=lc.min_oos_accuracy, knn_k=lc.knn_k)


def run_seed(args: argparse.Namespace, seed: int, work_root: Path) -> dict:
    """One seed: its own data split, flips, folds and trainings; lists aligned with the noise rates."""
    from pipeline.embeddings import lookup
    from pipeline.labelcheck import CheckSpec, KnnSpace, out_of_sample_probs

    args = argparse.Namespace(**{**vars(args), "seed": seed})
    base_cfg = _config(args, work_root)
    ds, gt, train_ids = digits_dataset(work_root / "digits", args.n, args.pool_n, args.test_n, seed)
    by_id = {r["sample_id"]: r for r in ds}
    test = [r for r in ds if r["split"] == "test"]
    truth = {s: by_id[s]["answer"] for s in train_ids}
    emb_ids, emb_all = selection_embeddings(base_cfg, ds, work_root / f"embeddings-{args.embeddings}")
    trainer = Trainer(base_cfg, by_id, test, work_root)
    lc = base_cfg.labelcheck

    clean_acc = trainer.accuracy(truth)
    log.info("seed %d clean labels: test accuracy %.3f", seed, clean_acc)
    result: dict = {"seed": seed, **{k: [] for k in KEYS}, "ablation": {"model_only": [], "knn_only": []},
                    "seconds": [], "accuracy_clean": round(clean_acc, 4), "n_test": len(test), "checked": len(train_ids)}
    for noise in args.rates:
        t0 = time.monotonic()
        work = work_root / f"noise-{noise:g}"
        cfg = base_cfg.model_copy(update={"paths": base_cfg.paths.model_copy(update={"artifacts": work / "artifacts"})})
        labels, flipped = noisy_labels(cfg, ds, gt, train_ids, noise, work)
        rows = trainer.rows(labels)
        oos = out_of_sample_probs(rows, work / "oos", CheckSpec.of(
            model=cfg.model, train=cfg.train, select=cfg.select, labelcheck=cfg.labelcheck, answers=cfg.data.answers,
            seed=cfg.seed))
        given = [labels[s] for s in oos.sample_ids]
        space = KnnSpace(oos.sample_ids, lookup(emb_ids, emb_all, oos.sample_ids), given,
                         source=f"{args.embeddings} embeddings")

        det = detect(oos, given, space, lc, ("model", "knn"))
        flagged = {i.sample_id for i in det.issues}
        queued = {i.sample_id for i in det.issues if i.confidence >= lc.min_confidence}
        ranked = det.ranking[: len(flipped)]
        sc = _scores(flagged, flipped, len(oos.sample_ids))
        result["flipped"].append(len(flipped))
        result["flagged"].append(sc["flagged"])
        result["precision"].append(sc["precision"])
        result["recall"].append(sc["recall"])
        result["false_alarms"].append(len(flagged - flipped))
        result["expected_false_alarms"].append(round(det.expected_false_alarms, 2))
        result["queued"].append(len(queued))
        result["precision_queued"].append(round(len(queued & flipped) / len(queued), 4) if queued else None)
        result["precision_at_flipped"].append(round(len(set(ranked) & flipped) / len(flipped), 4) if flipped else None)
        result["oos_accuracy"].append(round(det.oos_accuracy, 4) if det.oos_accuracy is not None else None)
        result["abstained"].append(det.abstained is not None)
        for name, use in (("model_only", ("model",)), ("knn_only", ("knn",))):
            alone = detect(oos, given, space, lc, use)
            result["ablation"][name].append({**_scores({i.sample_id for i in alone.issues}, flipped, len(given)),
                                             "abstained": alone.abstained is not None})

        acc_noisy = trainer.accuracy(labels)
        acc_fixed = trainer.accuracy({**labels, **{s: truth[s] for s in flagged}})
        result["accuracy_noisy"].append(round(acc_noisy, 4))
        result["accuracy_relabeled"].append(round(acc_fixed, 4))
        result["accuracy_gain"].append(round(acc_fixed - acc_noisy, 4))
        if not args.quick:
            blind = random.Random(f"{seed}:{noise}").sample(sorted(labels), len(flagged))
            result["accuracy_random_relabel"].append(round(trainer.accuracy({**labels, **{s: truth[s] for s in blind}}),
                                                           4))
        else:
            result["accuracy_random_relabel"].append(None)
        result["seconds"].append(round(time.monotonic() - t0, 1))
        log.info("seed %d noise %.2f: %d flipped, %d flagged (%s), precision %s, recall %s, P@flipped %s; accuracy "
                 "%.3f → %.3f", seed, noise, len(flipped), len(flagged), det.summary(), result["precision"][-1],
                 result["recall"][-1], result["precision_at_flipped"][-1], acc_noisy, acc_fixed)
    return result


def _mean(values: list) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return round(sum(vals) / len(vals), 4) if vals else None


def summarize(runs: list[dict], rates: list[float]) -> dict:
    """Means over the seeds per noise rate, the zero-noise false-alarm share and the ablation means."""
    out: dict = {k: [_mean([r[k][i] for r in runs]) for i in range(len(rates))] for k in KEYS}
    if 0.0 in rates:
        i = rates.index(0.0)
        out["false_alarms_at_zero_noise"] = _mean([r["flagged"][i] / r["checked"] for r in runs])
    else:
        out["false_alarms_at_zero_noise"] = None
    out["ablation"] = {
        name: {k: [_mean([r["ablation"][name][i][k] for r in runs]) for i in range(len(rates))]
               for k in ("flagged", "precision", "recall", "flagged_share", "abstained")}
        for name in ("model_only", "knn_only")
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--noise-rates", default="0,0.05,0.1,0.2")
    ap.add_argument("--n", type=int, default=150, help="labeled (training) samples")
    ap.add_argument("--pool-n", type=int, default=450, help="unlabeled pool samples (embeddings are fitted on the "
                                                             "whole pool, as in a project)")
    ap.add_argument("--test-n", type=int, default=300)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--embeddings", default="pool", choices=["pool", "pixels"],
                    help="select.embeddings source of the kNN signal")
    ap.add_argument("--seeds", default="0,1,2", help="each seed draws its own data split, flips and folds")
    ap.add_argument("--quick", action="store_true", help="noise 0.1 and seed 0 only, no random baseline")
    ap.add_argument("--work-dir", type=Path, default=None, help="keep models/adapters here (default: a temp dir)")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.noise_rates, args.seeds = "0.1", "0"
    args.rates = [float(x) for x in args.noise_rates.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("httpx", "pipeline.model", "pipeline.annotation", "pipeline.data", "pipeline.scoring"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    started, started_wall = time.monotonic(), time.time()
    work_root = args.work_dir or Path(tempfile.mkdtemp(prefix="tamis-label-noise-"))
    cache = CacheFolder(work_root)  # --work-dir: adapters and embeddings of an earlier run are reused
    runs = [run_seed(args, seed, work_root / f"seed-{seed}") for seed in seeds]
    lc = _config(argparse.Namespace(**{**vars(args), "seed": seeds[0]}), work_root).labelcheck
    result: dict = {"noise_rates": args.rates, **summarize(runs, args.rates)}
    result |= {
        "accuracy_clean": _mean([r["accuracy_clean"] for r in runs]),
        "chance_precision": args.rates,
        "per_seed": runs,
        "settings": {"n_train": args.n, "n_pool_unlabeled": args.pool_n, "n_test": args.test_n, "k": args.k,
                     "steps": args.steps, "lr": args.lr, "lora_r": args.lora_r, "batch": args.batch, "seeds": seeds,
                     "model": "tiny idefics3, qlora", "quick": args.quick, "oos_method": "kfold",
                     "embeddings": args.embeddings, "labelcheck": lc.model_dump(mode="json")},
        "total_seconds": round(time.monotonic() - started, 1),
    }
    write_result(result, args.json_out, cache=cache, started=started_wall,
                 config={"settings": result["settings"], "noise_rates": args.rates})


if __name__ == "__main__":
    main()
