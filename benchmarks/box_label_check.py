"""Box label checks on injected errors: recall per kind of error and the false-alarm rate.

Generated scenes (pipeline/boxes/scenes.py: shapes at known places on canvases of mixed aspect ratio) give exact
boxes. Their labels get errors injected at `--rate` per labeled box, a third each: a box removed (→ the check
should report it `missing`), its class changed (`swapped`), or moved so it overlaps its object by IoU 0.15–0.45
(`badly_placed`). The check (pipeline.boxes.labelcheck.check_image) compares the labels with predicted boxes.

The predictions come from a *simulated* detector, not a trained model: each true object is found with probability
`recall`, its corners jittered by `jitter` × its size (Gaussian), its class confused with probability `confusion`,
its score drawn from [0.55, 1.0] (a confused class from [0.5, 0.8]), plus `false_positives` boxes per image on
average at random places scoring [0.3, 0.7]. Two detectors ("good", "fair") bracket what a VLM fine-tuned for a
few rounds gives. A detector's own errors are what the check mistakes for label errors: that is the false-alarm
rate measured here, with no error injected (`--rate 0`) and with errors.

- recall[kind]: injected errors of that kind reported as that kind (a missing box: a `missing` report whose
  suggested box overlaps the removed one by IoU ≥ 0.5);
- false_alarm_rate: reports that match no injected error, per clean labeled box;
- precision: reports that match an injected error / all reports.

    python benchmarks/box_label_check.py --json-out benchmarks/results/box_label_check.json
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._results import write_result  # noqa: E402
from pipeline.boxes.box import Box  # noqa: E402
from pipeline.boxes.labelcheck import ISSUE_KINDS, BoxIssue, check_image  # noqa: E402
from pipeline.boxes.matching import iou  # noqa: E402
from pipeline.boxes.scenes import SHAPES, Scene, make_scenes  # noqa: E402


@dataclass(frozen=True)
class Detector:
    recall: float
    jitter: float
    confusion: float
    false_positives: float


DETECTORS = {"good": Detector(0.95, 0.03, 0.02, 0.1), "fair": Detector(0.85, 0.06, 0.08, 0.3)}


def predict(scene: Scene, det: Detector, rng: random.Random) -> list[Box]:
    out = []
    for b in scene.boxes:
        if rng.random() >= det.recall:
            continue
        confused = rng.random() < det.confusion
        label = rng.choice([s for s in SHAPES if s != b.label]) if confused else b.label
        x1, y1 = b.x + rng.gauss(0, det.jitter * b.w), b.y + rng.gauss(0, det.jitter * b.h)
        x2, y2 = b.x2 + rng.gauss(0, det.jitter * b.w), b.y2 + rng.gauss(0, det.jitter * b.h)
        score = rng.uniform(0.5, 0.8) if confused else rng.uniform(0.55, 1.0)
        out.append(Box.from_corners(label, x1, y1, x2, y2, score).clamped(scene.width, scene.height))
    for _ in range(sum(rng.random() < det.false_positives / 3 for _ in range(3))):
        w, h = rng.uniform(20, 0.3 * scene.width), rng.uniform(20, 0.3 * scene.height)
        out.append(Box(rng.choice(SHAPES), rng.uniform(0, scene.width - w), rng.uniform(0, scene.height - h), w, h,
                       rng.uniform(0.3, 0.7)))
    return out


def _moved(b: Box, scene: Scene, rng: random.Random) -> Box:
    """`b` shifted along x or y so that it overlaps its old place by IoU ~U(0.15, 0.45) (before clamping)."""
    target = rng.uniform(0.15, 0.45)
    f = (1 - target) / (1 + target) * rng.choice([-1, 1])  # a shift of f × side leaves IoU (1 − |f|) / (1 + |f|)
    dx, dy = (f * b.w, 0.0) if rng.random() < 0.5 else (0.0, f * b.h)
    x = min(max(b.x + dx, 0.0), scene.width - b.w)
    y = min(max(b.y + dy, 0.0), scene.height - b.h)
    return Box(b.label, x, y, b.w, b.h)


def inject(scene: Scene, rate: float, rng: random.Random) -> tuple[list[Box], dict[int, str], list[Box]]:
    """(noisy labels, noisy index → the kind of error it carries, the removed boxes)."""
    labels, errors, removed = [], {}, []
    for b in scene.boxes:
        kind = rng.choice(ISSUE_KINDS) if rng.random() < rate else None
        if kind == "missing":
            removed.append(b)
            continue
        if kind == "swapped":
            b = Box(rng.choice([s for s in SHAPES if s != b.label]), b.x, b.y, b.w, b.h)
        elif kind == "badly_placed":
            b = _moved(b, scene, rng)
        if kind:
            errors[len(labels)] = kind
        labels.append(b)
    return labels, errors, removed


def _tally(issues: list[BoxIssue], errors: dict[int, str], removed: list[Box], counts: dict[str, int]) -> None:
    found_missing: set[int] = set()
    for i in issues:
        if i.kind == "missing":
            hit = next((k for k, r in enumerate(removed) if k not in found_missing and iou(r, i.suggestion) >= 0.5),
                       None)
            if hit is None:
                counts["false"] += 1
            else:
                found_missing.add(hit)
                counts["found_missing"] += 1
        elif i.label_index is not None and errors.get(i.label_index) == i.kind:
            counts[f"found_{i.kind}"] += 1
        elif i.label_index in errors:
            counts["wrong_kind"] += 1
        else:
            counts["false"] += 1


def run_check(*, scenes: int, seed: int, rate: float, detector: str) -> dict:
    det, rng = DETECTORS[detector], random.Random(seed)
    counts = dict.fromkeys(["clean_boxes", "false", "wrong_kind", "reports"], 0)
    counts.update({f"injected_{k}": 0 for k in ISSUE_KINDS} | {f"found_{k}": 0 for k in ISSUE_KINDS})
    for scene in make_scenes(scenes, seed):
        labels, errors, removed = inject(scene, rate, rng)
        issues = check_image(scene.name, labels, predict(scene, det, rng))
        counts["clean_boxes"] += len(labels) - len(errors)
        counts["reports"] += len(issues)
        counts["injected_missing"] += len(removed)
        for kind in errors.values():
            counts[f"injected_{kind}"] += 1
        _tally(issues, errors, removed, counts)
    true = sum(counts[f"found_{k}"] for k in ISSUE_KINDS)
    return {
        "detector": detector, "rate": rate, "scenes": scenes, "seed": seed,
        "recall": {k: round(counts[f"found_{k}"] / counts[f"injected_{k}"], 4) if counts[f"injected_{k}"] else None
                   for k in ISSUE_KINDS},
        "false_alarm_rate": round(counts["false"] / max(counts["clean_boxes"], 1), 4),
        "precision": round(true / counts["reports"], 4) if counts["reports"] else None,
        "counts": counts,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenes", type=int, default=1000)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.1])
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    started = time.time()
    runs = [run_check(scenes=args.scenes, seed=s, rate=r, detector=d)
            for d in DETECTORS for r in args.rates for s in args.seeds]
    write_result({"detectors": {k: asdict(v) for k, v in DETECTORS.items()}, "runs": runs}, args.json_out,
                 config=vars(args), started=started)


if __name__ == "__main__":
    main()
