"""Label-error detection under planted noise, and what re-labeling the flagged samples buys.

Digits (scikit-learn's 8×8, upscaled to 32 px RGB) with the tiny random-weight idefics3 model in 4-bit + LoRA. For
each noise rate the simulated annotator labels the training slice with that fraction of answers flipped (through
the real export → simulate → import path), k-fold out-of-sample probabilities feed the confident-learning detector,
and the flips recorded in the annotator's sidecar are the ground truth:

- precision / recall: of everything the detector flags (its own cut-off), and precision_at_flipped: of its top-m
  for m planted flips (chance = the noise rate);
- accuracy on a held-out test slice of an adapter trained on the noisy labels, on the labels after re-labeling the
  flagged samples (the true answer from the ground truth, as an annotator would give), and after re-labeling as
  many random samples (the same label budget spent blindly); plus the clean-label accuracy for reference.

    python benchmarks/label_noise.py --json-out benchmarks/results/label_noise.json
    python benchmarks/label_noise.py --quick      # noise 0.1, seed 0, no random baseline: 6 trainings, ~3 min

Top-level lists are means over the seeds (each seed its own data split, flips and folds), one value per noise rate;
`per_seed` holds every run. About 300 optimizer steps of batch 16 per training (~20 s on one core here); the full
run (3 rates × 3 seeds) trains 57 times.
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

DIGITS = [str(d) for d in range(10)]
log = logging.getLogger("label_noise")


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
        "select": {"score_batch_size": 64},
        "annotate": {"formats": ["label_studio", "images"]},
    })


def digits_dataset(out: Path, n_train: int, n_test: int, seed: int):
    """(datasets.Dataset of prepared rows, ground-truth path): the demo digits, 32 px RGB, square-padded."""
    from datasets import Dataset

    from pipeline.config import PreprocessConfig
    from pipeline.data.demo import write_digits
    from pipeline.preprocess import encode_png, prepare_image

    total = n_train + n_test
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
    return Dataset.from_list(rows), out / "ground_truth.jsonl"


def noisy_labels(cfg, ds, gt: Path, noise: float, work: Path) -> tuple[dict[str, str], set[str]]:
    """Labels of the training slice as the simulated annotator gives them, and the IDs it flipped."""
    from pipeline.annotation import Ledger, export_selection, import_labels, simulate_annotator
    from pipeline.annotation.simulate import sidecar_path

    train_ids = [s for s, sp in zip(ds["sample_id"], ds["split"], strict=True) if sp == "pool"]
    export = work / "artifacts" / "rounds" / "000" / "export"
    export_selection([{"sample_id": s, "rank": i, "score": 0.0} for i, s in enumerate(train_ids)], ds, cfg, export,
                     round_index=0)
    f = simulate_annotator(export, gt, work / "inbox", round_index=0, noise=noise, seed=cfg.seed)
    ledger = Ledger(work / "labels.jsonl")
    import_labels(f, known_ids=set(train_ids), answers=DIGITS, ledger=ledger, round_index=0,
                  rejections_dir=work / "rejections")
    flipped = {x["sample_id"] for x in json.loads(sidecar_path(f).read_text())["flipped"]}
    return ledger.labels(), flipped


def train_and_test(cfg, rows: list[dict], test: list[dict], out: Path) -> float:
    from pipeline.model.loading import load_model
    from pipeline.model.train import train_adapter
    from pipeline.scoring import ClosedSetScorer

    res = train_adapter(cfg, rows, out, progress=False)
    loaded = load_model(cfg.model, adapter=res.adapter_dir)
    probs = ClosedSetScorer(loaded, DIGITS).score(test, batch_size=64).probs
    return float((probs.argmax(1) == [DIGITS.index(r["answer"]) for r in test]).mean())


def run_seed(args: argparse.Namespace, seed: int, work_root: Path) -> dict:
    """One seed: its own data split, flips, folds and trainings; lists aligned with the noise rates."""
    from pipeline.labelcheck import find_label_issues, out_of_sample_probs

    args = argparse.Namespace(**{**vars(args), "seed": seed})
    base_cfg = _config(args, work_root)
    ds, gt = digits_dataset(work_root / "digits", args.n, args.test_n, seed)
    by_id = {r["sample_id"]: r for r in ds}
    test = [r for r in ds if r["split"] == "test"]
    truth = {s: r["answer"] for s, r in by_id.items() if r["split"] == "pool"}

    def rows_for(labels: dict[str, str]) -> list[dict]:
        return [{"sample_id": s, "prepared": by_id[s]["prepared"], "question": by_id[s]["question"], "answer": lab}
                for s, lab in sorted(labels.items())]

    clean_acc = train_and_test(base_cfg, rows_for(truth), test, work_root / "train-clean")
    log.info("seed %d clean labels: test accuracy %.3f", seed, clean_acc)
    result: dict = {"seed": seed, "precision": [], "recall": [], "precision_at_flipped": [], "flagged": [],
                    "flipped": [], "accuracy_noisy": [], "accuracy_relabeled": [], "accuracy_random_relabel": [],
                    "accuracy_gain": [], "seconds": [], "accuracy_clean": round(clean_acc, 4), "n_test": len(test)}
    for noise in args.rates:
        t0 = time.monotonic()
        work = work_root / f"noise-{noise:g}"
        cfg = base_cfg.model_copy(update={"paths": base_cfg.paths.model_copy(update={"artifacts": work / "artifacts"})})
        labels, flipped = noisy_labels(cfg, ds, gt, noise, work)
        oos = out_of_sample_probs(cfg, rows_for(labels), work / "oos")
        issues = find_label_issues(oos.probs, [labels[s] for s in oos.sample_ids], DIGITS, sample_ids=oos.sample_ids)
        flagged = {i.sample_id for i in issues}
        top = {i.sample_id for i in issues[: len(flipped)]}
        hit = len(flagged & flipped)
        result["flipped"].append(len(flipped))
        result["flagged"].append(len(flagged))
        result["precision"].append(round(hit / len(flagged), 4) if flagged else None)
        result["recall"].append(round(hit / len(flipped), 4) if flipped else None)
        result["precision_at_flipped"].append(round(len(top & flipped) / len(flipped), 4) if flipped else None)
        acc_noisy = train_and_test(cfg, rows_for(labels), test, work / "train-noisy")
        fixed = {**labels, **{s: truth[s] for s in flagged}}
        acc_fixed = train_and_test(cfg, rows_for(fixed), test, work / "train-relabeled")
        result["accuracy_noisy"].append(round(acc_noisy, 4))
        result["accuracy_relabeled"].append(round(acc_fixed, 4))
        result["accuracy_gain"].append(round(acc_fixed - acc_noisy, 4))
        if not args.quick:
            blind = random.Random(f"{seed}:{noise}").sample(sorted(labels), len(flagged))
            acc_rand = train_and_test(cfg, rows_for({**labels, **{s: truth[s] for s in blind}}), test,
                                      work / "train-random")
            result["accuracy_random_relabel"].append(round(acc_rand, 4))
        else:
            result["accuracy_random_relabel"].append(None)
        result["seconds"].append(round(time.monotonic() - t0, 1))
        log.info("seed %d noise %.2f: %d flipped, %d flagged, precision %s, recall %s, P@flipped %s; accuracy %.3f → "
                 "%.3f", seed, noise, len(flipped), len(flagged), result["precision"][-1], result["recall"][-1],
                 result["precision_at_flipped"][-1], acc_noisy, acc_fixed)
    return result


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return round(sum(vals) / len(vals), 4) if vals else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--noise-rates", default="0.05,0.1,0.2")
    ap.add_argument("--n", type=int, default=150, help="labeled (training) samples")
    ap.add_argument("--test-n", type=int, default=300)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
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

    started = time.monotonic()
    work_root = args.work_dir or Path(tempfile.mkdtemp(prefix="tamis-label-noise-"))
    runs = [run_seed(args, seed, work_root / f"seed-{seed}") for seed in seeds]
    keys = ("precision", "recall", "precision_at_flipped", "flagged", "flipped", "accuracy_noisy",
            "accuracy_relabeled", "accuracy_random_relabel", "accuracy_gain")
    # Top-level lists: the mean over seeds per noise rate; per_seed keeps every run.
    result: dict = {"noise_rates": args.rates}
    result |= {k: [_mean([r[k][i] for r in runs]) for i in range(len(args.rates))] for k in keys}
    result |= {
        "accuracy_clean": _mean([r["accuracy_clean"] for r in runs]),
        "chance_precision": args.rates,
        "per_seed": runs,
        "settings": {"n_train": args.n, "n_test": args.test_n, "k": args.k, "steps": args.steps, "lr": args.lr,
                     "lora_r": args.lora_r, "batch": args.batch, "seeds": seeds, "model": "tiny idefics3, qlora",
                     "quick": args.quick, "oos_method": "kfold"},
        "total_seconds": round(time.monotonic() - started, 1),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        from pipeline.store import atomic_write_text

        atomic_write_text(args.json_out, text + "\n")


if __name__ == "__main__":
    main()
