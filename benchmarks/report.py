"""How long a round's report takes to build and how big it is, for a round over a large pool.

The round's outputs are synthetic but written in the shapes and by the writers a round uses: a prepared dataset of
`--pool` rows (32×32 PNGs, the demo's size), its quality table, a 128-d selection-embeddings stage, the candidates'
score shards (pipeline.scoring.save_scores: 64-d embeddings and 10-class probabilities, 256 a shard), the round's ID
files, a `--batch`-sample selection with outliers, a labeled set and an evaluation of 2,000 test rows. Then
`build_report` runs twice in this process (the first pays the imports of matplotlib, scikit-learn and datasets).

    python benchmarks/report.py --pool 100000 --batch 100 --json-out benchmarks/results/report.json
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._results import peak_rss_mb, write_result  # noqa: E402

ANSWERS = [str(d) for d in range(10)]


def _pngs(n: int, rng: np.random.Generator) -> list[bytes]:
    """`n` distinct-looking 32×32 grey digit-like PNGs (the demo's prepared size), reused across the pool's rows."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits().images
    out = []
    for i in range(n):
        a = np.kron(digits[i % len(digits)], np.ones((4, 4))) * 255 / 16 + rng.normal(0, 8, (32, 32))
        buf = io.BytesIO()
        Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).convert("RGB").save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def write_round(root: Path, pool: int, batch: int, seed: int = 0) -> object:
    """The stage folders and round files a finished round over `pool` samples leaves; returns its ReportSources."""
    import datasets

    from pipeline.roundreport import ReportSources
    from pipeline.score_stage import SCORE_VERSION
    from pipeline.scoring import ScoreResult, plan_shards, save_scores
    from pipeline.store import atomic_write_json, atomic_write_jsonl, save_dataset, write_manifest

    rng = np.random.default_rng(seed)
    ids = [f"{i:020x}" for i in rng.permutation(pool * 4)[:pool]]
    n_test, n_lab = 2000, 1000
    answers = [ANSWERS[i % 10] for i in range(pool)]
    split = ["test"] * n_test + ["train"] * n_lab + ["pool"] * (pool - n_test - n_lab)
    pngs = _pngs(500, rng)
    prep = root / "prepare"
    ds = datasets.Dataset.from_dict({"sample_id": ids, "prepared": [pngs[i % 500] for i in range(pool)],
                                     "answer": answers, "split": split})
    save_dataset(ds, prep / "dataset")
    write_manifest(prep, stage="preprocess", stage_version="bench", inputs={}, config={}, outputs={"dataset": "dataset"})
    qual = root / "quality"
    flags = rng.choice(["", "near_duplicate", "blurry"], size=pool, p=[0.985, 0.012, 0.003])
    atomic_write_jsonl(qual / "quality.jsonl", [{"sample_id": s, "blur_score": 100.0, "pixel_std": 50.0, "dhash": "0",
                                                 "duplicate_of": None, "flags": [f] if f else [],
                                                 "reasons": [f"{f} (synthetic)"] if f else [], "excluded": False}
                                                for s, f in zip(ids, flags, strict=True)])
    counts = {f: int((flags == f).sum()) for f in ("blurry", "exact_duplicate", "near_duplicate", "low_information")}
    write_manifest(qual, stage="quality", stage_version="bench", inputs={}, config={}, outputs={"table": "quality.jsonl"},
                   info={"rows": pool, "excluded": 0, "counts": counts})
    space = root / "embeddings"
    space.mkdir()
    np.save(space / "embeddings.npy", rng.normal(size=(pool, 128)).astype(np.float32))
    atomic_write_json(space / "ids.json", ids, indent=None)
    write_manifest(space, stage="embeddings", stage_version="bench", inputs={}, config={},
                   outputs={"embeddings": "embeddings.npy", "ids": "ids.json"})
    rd = root / "rounds" / "001"
    pool_ids, labeled = ids[n_test + n_lab:], ids[n_test:n_test + n_lab]
    candidates = sorted(pool_ids + labeled)
    atomic_write_jsonl(rd / "candidates.jsonl", [{"sample_id": s} for s in candidates])
    atomic_write_jsonl(rd / "pool.jsonl", [{"sample_id": s} for s in candidates])
    shards = []
    for k, part in enumerate(plan_shards(candidates, 256)):
        logits = rng.normal(size=(len(part), 10)) * 2
        probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        out = root / "scores" / f"{k:05d}"
        save_scores(ScoreResult(part, rng.normal(size=(len(part), 64)).astype(np.float32), probs.astype(np.float32)),
                    out, version=SCORE_VERSION, inputs={"shard": str(k)}, config={})
        shards.append((part[0], str(out)))
    picked = rng.choice(len(pool_ids), batch + 50, replace=False)
    atomic_write_jsonl(rd / "selection" / "selection.jsonl", [
        {"sample_id": pool_ids[i], "rank": r, "score": float(rng.uniform(0, 1)), "strategy": "margin",
         "diversity": "cluster_margin", "prediction": "3", "confidence": 0.4} for r, i in enumerate(picked[:batch])])
    atomic_write_jsonl(rd / "selection" / "outliers.jsonl", [{"sample_id": pool_ids[i], "z": 4.0, "far": True}
                                                             for i in picked[batch:]])
    save_dataset(ds.select(range(n_test, n_test + n_lab)), rd / "labeled" / "dataset")
    ev = root / "eval"
    atomic_write_jsonl(ev / "predictions.jsonl", [
        {"sample_id": ids[i], "answer": answers[i], "prediction": answers[i] if rng.uniform() < 0.8 else
         ANSWERS[int(rng.integers(10))], "confidence": float(rng.uniform(0.1, 1))} for i in range(n_test)])
    return ReportSources(round=1, round_dir=str(rd), artifacts=str(root), answers=ANSWERS, seed=seed,
                         prepared_dir=str(prep), quality_dir=str(qual), space_dir=str(space), space_source="pool",
                         shards=shards, eval_dir=str(ev))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="tamis-report-bench-") as tmp:
        t0 = time.perf_counter()
        sources = write_round(Path(tmp), args.pool, args.batch)
        setup_s = time.perf_counter() - t0
        from pipeline.metrics import round_curve_png
        from pipeline.roundreport import build_report

        state = {"round": 1, "labeled": 1000, "pool": args.pool - 3000, "selected": args.batch,
                 "strategy": "margin+cluster_margin", "metrics": {"accuracy": 0.8}, "adapter": {"adapter_digest": "x"},
                 "phase": {"phase": "uncertainty", "reason": "benchmark"}}
        metrics = [{"round": r, "labels": 500 * r, "metric": "accuracy", "value": 0.6 + 0.1 * r, "strategy": "m"}
                   for r in (1, 2)]
        t0 = time.perf_counter()
        first = build_report(sources, state, round_curve_png(metrics, 1))
        first_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        second = build_report(sources, state, round_curve_png(metrics, 1))
        second_s = time.perf_counter() - t0
        html = second.html.read_text()
        result = {
            "benchmark": "report", "pool": args.pool, "batch": args.batch, "score_shards": len(sources.shards),
            "data": "synthetic round outputs written by the round's own writers (see the module docstring)",
            "setup_s": round(setup_s, 1), "build_first_s": round(first_s, 2), "build_second_s": round(second_s, 2),
            "report_bytes": second.bytes, "report_kb": round(second.bytes / 1024, 1),
            "embedded_images": html.count("data:image/"), "batch_png_bytes": second.batch_png.stat().st_size,
            "peak_rss_mb": round(peak_rss_mb(), 1), "first_build_bytes": first.bytes,
        }
    write_result(result, args.json_out, started=started, config=vars(args))
    print(json.dumps({k: result[k] for k in ("build_first_s", "build_second_s", "report_kb")}))


if __name__ == "__main__":
    main()
