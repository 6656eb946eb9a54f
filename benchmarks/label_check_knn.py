"""The label check while the model is still at chance: do the neighbours (pipeline.labelcheck, step 6 of
detect_label_issues) find planted label errors in a first labeled round, and how often do they cry wolf?

Two image sets, neither needing a model: generated letter tiles (8 letters A–H drawn in Pillow's font at random
sizes, offsets, grey levels, with pixel noise) and scikit-learn's 8×8 digits (10 classes, upscaled to 32 px). For each
labeled-set size and seed, each `--noise` rate of the labels is flipped to another answer (at least one label
unless the rate is 0: the clean labels' false alarms); the model's
out-of-sample probabilities are a chance-level model's (softmax of small random logits, as the tiny random-weight
model gives), so the model abstains and the neighbours judge alone, in the labeled images' HOG space
(check.neighbour_space with select.embeddings: model: their gradient histograms). Measured: recall (planted flips reported), false-alarm rate
(correct labels reported / correct labels), precision, and how often the neighbours abstained (too weak); beside
them, the same check without the neighbours (what a round did before: the model at chance abstains, nothing found).

    python benchmarks/label_check_knn.py --json-out benchmarks/results/label_check_knn.json
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import write_result  # noqa: E402

LETTERS = list("ABCDEFGH")


def letter_tile(letter: str, rng, side: int = 32) -> bytes:
    """One letter tile as PNG bytes: random font size, offset, ink and paper grey, Gaussian pixel noise."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    paper, ink = int(rng.integers(200, 256)), int(rng.integers(0, 70))
    img = Image.new("L", (side, side), paper)
    font = ImageFont.load_default(size=int(rng.integers(18, 26)))
    draw = ImageDraw.Draw(img)
    left, top, right, bottom = draw.textbbox((0, 0), letter, font=font)
    x = (side - (right - left)) / 2 - left + rng.integers(-3, 4)
    y = (side - (bottom - top)) / 2 - top + rng.integers(-3, 4)
    draw.text((x, y), letter, fill=ink, font=font)
    arr = np.asarray(img, np.float32) + rng.normal(0, 12, (side, side))
    buf = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def letter_rows(n: int, seed: int) -> list[dict]:
    """`n` labeled rows (sample_id, prepared PNG, answer), classes in turn."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [{"sample_id": f"t{seed}-{i:04d}", "prepared": letter_tile(LETTERS[i % len(LETTERS)], rng),
             "answer": LETTERS[i % len(LETTERS)]} for i in range(n)]


def digit_rows(n: int, seed: int) -> list[dict]:
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    pick = np.random.default_rng(seed).choice(len(d.target), n, replace=False)
    rows = []
    for i in pick:
        buf = io.BytesIO()
        Image.fromarray((d.images[i] * 255 / 16).astype(np.uint8)).resize((32, 32), Image.NEAREST).convert(
            "RGB").save(buf, format="PNG")
        rows.append({"sample_id": f"d{seed}-{i:04d}", "prepared": buf.getvalue(), "answer": str(d.target[i])})
    return rows


def flip(rows: list[dict], answers: list[str], noise: float, seed: int) -> set[str]:
    """Flip max(1, noise·n) labels (none at noise 0) in place to another answer; the flipped IDs."""
    import numpy as np

    rng = np.random.default_rng(seed + 1000)
    chosen = rng.choice(len(rows), max(1, round(noise * len(rows))) if noise else 0, replace=False)
    for i in chosen:
        others = [a for a in answers if a != rows[i]["answer"]]
        rows[i]["answer"] = others[int(rng.integers(len(others)))]
    return {rows[i]["sample_id"] for i in chosen}


def chance_probs(n: int, k: int, seed: int):
    """A chance-level model's out-of-sample probabilities: softmax of small random logits."""
    import numpy as np

    z = np.random.default_rng(seed + 2000).normal(0, 0.1, (n, k))
    p = np.exp(z)
    return p / p.sum(1, keepdims=True)


def run_one(rows: list[dict], answers: list[str], noise: float, seed: int) -> dict:
    from pipeline.config import LabelCheckConfig, SelectConfig
    from pipeline.labelcheck import CheckScoring
    from pipeline.labelcheck.check import neighbour_space
    from pipeline.labelcheck.knn import detect_label_issues

    flipped = flip(rows, answers, noise, seed)
    labelcheck = LabelCheckConfig()
    space = neighbour_space(rows, None, scoring=CheckScoring.of(SelectConfig()), labelcheck=labelcheck)
    det = detect_label_issues(chance_probs(len(rows), len(answers), seed), [r["answer"] for r in rows], answers,
                              sample_ids=[r["sample_id"] for r in rows], knn=None, neighbours=space,
                              min_oos_accuracy=labelcheck.min_oos_accuracy, knn_k=labelcheck.knn_k)
    flagged = {i.sample_id for i in det.issues}
    nb = det.signals.get("neighbours", {})
    # The check before the neighbours took over (no model-independent space): what a round reported until now.
    before = detect_label_issues(chance_probs(len(rows), len(answers), seed), [r["answer"] for r in rows], answers,
                                 sample_ids=[r["sample_id"] for r in rows], knn=None,
                                 min_oos_accuracy=labelcheck.min_oos_accuracy, knn_k=labelcheck.knn_k)
    return {"n": len(rows), "flipped": len(flipped), "flagged": len(flagged), "hits": len(flagged & flipped),
            "false_alarms": len(flagged - flipped), "clean": len(rows) - len(flipped),
            "abstained": det.abstained is not None, "neighbour_agreement": nb.get("accuracy"),
            "hits_without_neighbours": len({i.sample_id for i in before.issues} & flipped),
            "abstained_without_neighbours": before.abstained is not None}


def summarize(runs: list[dict]) -> dict:
    flipped, hits = sum(r["flipped"] for r in runs), sum(r["hits"] for r in runs)
    flagged, fa, clean = sum(r["flagged"] for r in runs), sum(r["false_alarms"] for r in runs), sum(
        r["clean"] for r in runs)
    return {"runs": len(runs), "recall": round(hits / flipped, 4) if flipped else None, "flagged": flagged,
            "false_alarm_rate": round(fa / clean, 4) if clean else None,
            "precision": round(hits / flagged, 4) if flagged else None,
            "abstained": sum(r["abstained"] for r in runs), "flipped": flipped, "hits": hits,
            "false_alarms": fa, "clean_labels": clean,
            "recall_without_neighbours": round(sum(r["hits_without_neighbours"] for r in runs) / flipped, 4)
            if flipped else None,
            "abstained_without_neighbours": sum(r["abstained_without_neighbours"] for r in runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="40,80,160", help="labeled-set sizes (a first labeled round's)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--noise", default="0,0.05", help="label noise rates (comma-separated)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    started = time.time()
    sizes = [int(s) for s in args.sizes.split(",")]
    sets = {"letters": (letter_rows, LETTERS), "digits": (digit_rows, [str(d) for d in range(10)])}
    noises = [float(x) for x in args.noise.split(",")]
    result: dict = {"noise": noises, "seeds": args.seeds, "sizes": sizes, "model": "chance-level probabilities",
                    "space": "the labeled images' gradient histograms (HOG, check.hog_features), labelcheck defaults "
                             "(knn_k 5, min_oos_accuracy 0.75)", "results": {}}
    for noise in noises:
        by_set = {}
        for name, (make, answers) in sets.items():
            per_size = {}
            for n in sizes:
                runs = [run_one(make(n, seed), answers, noise, seed) for seed in range(args.seeds)]
                per_size[str(n)] = {**summarize(runs), "per_seed": runs}
            by_set[name] = {**summarize([r for s in per_size.values() for r in s["per_seed"]]), "by_size": per_size}
        result["results"][str(noise)] = by_set
    write_result(result, args.json_out, config=vars(args), started=started)


if __name__ == "__main__":
    main()
