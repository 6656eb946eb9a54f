"""Neighbour recall of the approximate selection-space index (pipeline.strategies.index) against exact search.

Above `EXACT_MAX` rows the index is IVF-Flat (or HNSW on request). Exact search over a pool of 10⁶–10⁷ rows is what
the index exists to avoid, so recall is measured on a 100k-row subsample: the same mixture the selection benchmarks
use (Gaussian clusters of unequal size and spread, benchmarks/pool_scale.py), the index forced to its approximate
kind, 1,000 query rows drawn from the pool (as the labeled set's neighbours are searched), recall@k = share of the
exact k nearest that the index also returns. Build and search seconds are recorded beside it.

    python benchmarks/index_recall.py --json-out benchmarks/results/index_recall.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._results import write_result  # noqa: E402
from benchmarks.pool_scale import clustered_embeddings  # noqa: E402
from pipeline.strategies.index import EXACT_MAX, NeighborIndex, recall_at_k  # noqa: E402


def measure(x: np.ndarray, q: np.ndarray, exact: np.ndarray, k: int, **index: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    idx = NeighborIndex(x, **index)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, found = idx.search(q, k)
    searched = time.perf_counter() - t0
    out = {"kind": idx.kind, f"recall_at_{k}": round(recall_at_k(found, exact), 4), "build_s": round(built, 2),
           "search_s": round(searched, 3)}
    if idx.kind == "ivf":
        out.update(nlist=idx.nlist, nprobe=int(idx.index.nprobe))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    started = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--clusters", type=int, default=1000)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)

    x = clustered_embeddings(args.n, args.dim, clusters=args.clusters, seed=args.seed)
    q = x[np.random.default_rng(args.seed + 1).choice(args.n, args.queries, replace=False)]
    t0 = time.perf_counter()
    _, exact = NeighborIndex(x, kind="flat").search(q, args.k)
    exact_s = time.perf_counter() - t0
    runs = [measure(x, q, exact, args.k, kind="ivf", seed=args.seed, nprobe=p) for p in (8, 32)]
    runs.append(measure(x, q, exact, args.k, kind="hnsw"))
    default = next(r for r in runs if r.get("nprobe") == 32)
    result = {
        "benchmark": "index_recall", "rows": args.n, "dim": args.dim, "clusters": args.clusters,
        "queries": args.queries, "k": args.k, "exact_max": EXACT_MAX, "exact_search_s": round(exact_s, 3),
        f"ivf_recall_at_{args.k}": default[f"recall_at_{args.k}"], "runs": runs,
        "data": "synthetic Gaussian mixture (benchmarks/pool_scale.py:clustered_embeddings), queries drawn from it",
    }
    return write_result(result, args.json_out, started=started, config=vars(args) | {"json_out": None})


if __name__ == "__main__":
    main()
