"""Pool-scale benchmark (issue #5): selection time on 100k embeddings; scoring memory is a separate part.

    python benchmarks/pool_scale.py --part selection --json-out benchmarks/results/pool_scale_selection.json

Parts:
  selection  k-center and cluster-margin picking --k of --n seeded, clustered float32 embeddings of dimension --d
             (keys kcenter_s, cluster_margin_s; target < 5 s each on 2 cores).
  scoring    peak RSS of scoring + selecting a 10k and a 100k pool (keys rss_mb_10k, rss_mb_100k, rss_ratio):
             not implemented yet; it belongs with the sharded scorer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Before faiss loads libgomp: idle OpenMP workers sleep instead of spinning, which on a shared 2-core machine made
# faiss k-means 2-3x slower than one thread.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import faiss  # noqa: E402
import numpy as np  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.store import atomic_write_json  # noqa: E402
from pipeline.strategies.selectors import ClusterMargin, KCenter, faiss_threads  # noqa: E402


def clustered_embeddings(n: int, d: int, *, clusters: int, seed: int) -> np.ndarray:
    """Gaussian clusters of unequal size and spread, like pooled hidden states of a mixed pool."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, d), dtype=np.float32)
    sizes = rng.dirichlet(np.ones(clusters) * 2)
    label = rng.choice(clusters, size=n, p=sizes)
    spread = rng.uniform(0.15, 0.5, size=clusters).astype(np.float32)
    x = centres[label] + rng.standard_normal((n, d), dtype=np.float32) * spread[label, None]
    return np.ascontiguousarray(x, dtype=np.float32)


def _timed(fn: Callable[[], np.ndarray], repeat: int) -> tuple[float, float, np.ndarray]:
    """Fastest wall time and its process CPU time (all threads): on a shared machine the CPU time shows the work
    and the wall time shows the wait."""
    best, cpu, out = float("inf"), 0.0, np.empty(0)
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        if time.perf_counter() - t < best:
            best, cpu = time.perf_counter() - t, time.process_time() - c
    return best, cpu, out


def run_selection(args: argparse.Namespace) -> dict[str, Any]:
    x = clustered_embeddings(args.n, args.d, clusters=args.clusters, seed=args.seed)
    scores = np.random.default_rng(args.seed + 1).random(args.n)
    kc_s, kc_cpu, kc = _timed(lambda: KCenter().select(args.k, scores=scores, embeddings=x, seed=args.seed), args.repeat)
    cm_s, cm_cpu, cm = _timed(
        lambda: ClusterMargin().select(args.k, scores=scores, embeddings=x, seed=args.seed), args.repeat
    )
    assert len(set(kc.tolist())) == args.k and len(set(cm.tolist())) == args.k
    return {
        "kcenter_s": round(kc_s, 3),
        "cluster_margin_s": round(cm_s, 3),
        "kcenter_cpu_s": round(kc_cpu, 3),
        "cluster_margin_cpu_s": round(cm_cpu, 3),
        "n": args.n,
        "d": args.d,
        "k": args.k,
        "data_clusters": args.clusters,
        "cluster_margin_clusters": round(args.n**0.5),
        "target_s": 5.0,
    }


def run_scoring(args: argparse.Namespace) -> dict[str, Any]:
    raise NotImplementedError("--part scoring (rss_mb_10k, rss_mb_100k, rss_ratio) is not implemented yet")


PARTS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "selection": run_selection,
    "scoring": run_scoring,
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=[*PARTS, "all"], default="selection")
    ap.add_argument("--n", type=int, default=100_000, help="pool size (embeddings)")
    ap.add_argument("--d", type=int, default=384, help="embedding dimension")
    ap.add_argument("--k", type=int, default=1000, help="samples to pick")
    ap.add_argument("--clusters", type=int, default=100, help="clusters in the generated embeddings")
    ap.add_argument("--threads", type=int, default=2, help="BLAS and faiss threads")
    ap.add_argument("--repeat", type=int, default=1, help="runs per timing; the fastest is reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)
    result: dict[str, Any] = {
        "part": args.part,
        "threads": args.threads,
        "kcenter_blas_threads": 1,  # k_center_greedy's default: its GEMM blocks are too small to share
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "numpy": np.__version__,
        "faiss": faiss.__version__,
        "python": platform.python_version(),
    }
    parts = list(PARTS) if args.part == "all" else [args.part]
    with threadpool_limits(args.threads, user_api="blas"), faiss_threads(args.threads):
        for part in parts:
            try:
                result.update(PARTS[part](args))
            except NotImplementedError as exc:
                ap.exit(2, f"pool_scale: {exc}; run --part selection\n")
    print(json.dumps(result, indent=2))
    if args.json_out:
        atomic_write_json(args.json_out, result)
    return result


if __name__ == "__main__":
    main()
