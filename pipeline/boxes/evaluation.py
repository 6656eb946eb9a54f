"""Detection metrics of predicted boxes against labeled ones: mAP@0.5 (`map50`), mAP@[.5:.95] (`map`) and per-class
AP, each with a 95 % bootstrap interval over the test images.

The numbers are computed by faster-coco-eval (Apache-2.0; github.com/MiXaiLL76/faster_coco_eval), a maintained
re-implementation of pycocotools' COCOeval with its evaluate/accumulate in C++: the same greedy matching by score,
101-point interpolated precision, `iscrowd` 0, maxDets 100, area "all". It was chosen over pycocotools (BSD-2,
the reference, but Python accumulate: ~10× slower, and the bootstrap runs it hundreds of times) and torchmetrics
(Apache-2.0, whose MeanAveragePrecision calls one of these two backends anyway); docs/boxes.md says more.

Conventions: a prediction without a score counts as score 1.0 (VLM answers carry none; ties keep the answer's
order). A class with no labeled box in the test set has no AP (None) and does not enter the mean, as in COCO. The
bootstrap draws images with replacement (a drawn-twice image counts twice) and reruns the evaluation per draw.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pipeline.boxes.box import Box
from pipeline.errors import DataError

RESAMPLES = 200  # each resample is one COCOeval run (~25 ms for 300 images × 4 boxes): 200 keep a round under 10 s
BOOTSTRAP_SEED = 0
MAX_DETECTIONS = 100  # COCO's maxDets: a VLM answer with more boxes has its lowest-scored ones cut
METRICS = ("map50", "map")


def _coco(images: Sequence[str], boxes: Mapping[str, Sequence[Box]], cats: Mapping[str, int],
          sizes: Mapping[str, tuple[int, int]], *, scored: bool) -> Any:
    """A faster-coco-eval COCO object over `images` (a name may repeat: each occurrence is its own image id)."""
    from faster_coco_eval import COCO

    imgs, anns = [], []
    for image_id, name in enumerate(images, 1):
        w, h = sizes.get(name, (1, 1))
        imgs.append({"id": image_id, "file_name": name, "width": w, "height": h})
        for b in boxes.get(name, ()):
            ann = {"id": len(anns) + 1, "image_id": image_id, "category_id": cats[b.label],
                   "bbox": [b.x, b.y, b.w, b.h], "area": b.w * b.h, "iscrowd": 0}
            if scored:
                ann["score"] = 1.0 if b.score is None else float(b.score)
            anns.append(ann)
    out = COCO()
    out.dataset = {"images": imgs, "annotations": anns, "categories": [{"id": i, "name": n} for n, i in cats.items()]}
    out.createIndex()
    return out


def _precision(images: Sequence[str], truth: Mapping[str, Sequence[Box]], predicted: Mapping[str, Sequence[Box]],
               cats: Mapping[str, int], sizes: Mapping[str, tuple[int, int]]) -> np.ndarray:
    """COCOeval's precision array [iou thresholds (10), recall points (101), classes] at area all, maxDets 100;
    -1 where a class has no labeled box."""
    from faster_coco_eval import COCOeval_faster

    ev = COCOeval_faster(_coco(images, truth, cats, sizes, scored=False),
                         _coco(images, predicted, cats, sizes, scored=True), iouType="bbox",
                         print_function=lambda *args, **kwargs: None)
    ev.params.maxDets = [MAX_DETECTIONS]
    ev.evaluate()
    ev.accumulate()
    return ev.eval["precision"][:, :, :, 0, -1]


def _ap(precision: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-class AP@0.5 and AP@[.5:.95] from the precision array; NaN for a class without labeled boxes."""
    valid = (precision > -1).all(axis=(0, 1))  # COCO writes -1 across a class's whole slice, or nowhere
    ap50, ap = np.full(precision.shape[2], np.nan), np.full(precision.shape[2], np.nan)
    ap50[valid] = precision[0][:, valid].mean(axis=0)
    ap[valid] = precision[:, :, valid].mean(axis=(0, 1))
    return ap50, ap


def _check(truth: Mapping[str, Sequence[Box]], predicted: Mapping[str, Sequence[Box]],
           labels: Sequence[str]) -> None:
    if not truth:
        raise DataError("box evaluation: the test set has no images; label some test images with boxes")
    known = set(labels)
    for what, boxes in (("labeled", truth), ("predicted", predicted)):
        for name, image_boxes in boxes.items():
            unknown = sorted({b.label for b in image_boxes} - known)
            if unknown and what == "labeled":
                raise DataError(f"box evaluation: {what} boxes of {name!r} use classes {unknown} outside the class "
                                f"list {list(labels)}; fix the labels or add the classes to data.answers")
    if not any(truth.values()):
        raise DataError(f"box evaluation: none of the {len(truth)} test images has a labeled box; mAP needs some")


def _interval(values: np.ndarray) -> list[float] | None:
    v = values[~np.isnan(values)]
    if not v.size:
        return None
    return [round(float(np.percentile(v, 2.5)), 6), round(float(np.percentile(v, 97.5)), 6)]


def _r(value: float) -> float | None:
    return None if np.isnan(value) else round(float(value), 6)


def box_map(truth: Mapping[str, Sequence[Box]], predicted: Mapping[str, Sequence[Box]], labels: Sequence[str], *,
            sizes: Mapping[str, tuple[int, int]] | None = None, resamples: int = RESAMPLES,
            seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """mAP of `predicted` against `truth` (both: image name → boxes in original pixels; the images are those of
    `truth`, a predicted image outside it is ignored) over the classes `labels`. A predicted class outside `labels`
    is a false positive of no class (it lowers no class's AP: it is dropped, and counted in `unknown_predictions`).

    Returns {"map50", "map", "map50_ci95", "map_ci95", "per_class": [{label, ap50, ap, ap50_ci95, ap_ci95,
    support}], "n" (images), "unknown_predictions", "bootstrap": {resamples, seed}}."""
    _check(truth, predicted, labels)
    cats = {label: i for i, label in enumerate(labels, 1)}
    names = list(truth)
    kept = {n: [b for b in predicted.get(n, ()) if b.label in cats] for n in names}
    unknown = sum(len(predicted.get(n, ())) - len(kept[n]) for n in names)
    ap50, ap = _ap(_precision(names, truth, kept, cats, sizes or {}))
    rng = np.random.default_rng(seed)
    draws50, draws = np.full((resamples, len(labels)), np.nan), np.full((resamples, len(labels)), np.nan)
    means50, means = np.full(resamples, np.nan), np.full(resamples, np.nan)
    for r in range(resamples):
        picked = [names[i] for i in rng.integers(0, len(names), size=len(names))]
        if not any(truth[n] for n in picked):
            continue  # a draw without any labeled box has no mAP; it is left out of the interval
        draws50[r], draws[r] = _ap(_precision(picked, truth, kept, cats, sizes or {}))
        means50[r], means[r] = np.nanmean(draws50[r]), np.nanmean(draws[r])
    support = {label: sum(b.label == label for n in names for b in truth[n]) for label in labels}
    return {
        "map50": _r(np.nanmean(ap50)), "map": _r(np.nanmean(ap)),
        "map50_ci95": _interval(means50), "map_ci95": _interval(means),
        "per_class": [{"label": label, "ap50": _r(ap50[k]), "ap": _r(ap[k]), "ap50_ci95": _interval(draws50[:, k]),
                       "ap_ci95": _interval(draws[:, k]), "support": support[label]}
                      for k, label in enumerate(labels)],
        "n": len(names), "unknown_predictions": unknown,
        "bootstrap": {"resamples": resamples, "seed": seed},
    }
