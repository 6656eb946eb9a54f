"""pool_scale.py --part select10m: 10k picks from 10⁷ × 128 memory-mapped float16 embeddings (issue #23).

The embeddings are a seeded Gaussian mixture written once to an .npy file in --work-dir (2.6 GB), read back with
np.load(mmap_mode="r") as the selection stage would read a pool's, and handed as they are to the library's KCenter
and MaxHerding selectors, each in a fresh process (peak RSS = that process's VmHWM, mapped file pages included).
Quality beside the timing: k-center's covering radius of the whole pool against a random batch's, and the pool's
MaxHerding coverage (mean Gaussian kernel to the nearest pick, its own σ) on a uniform sample of 100k rows, for
MaxHerding's picks, k-center's and a random batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
_CHUNK = 500_000
_EVAL_ROWS = 100_000


def mixture_file(work: Path, n: int, d: int, clusters: int, seed: int) -> tuple[Path, float]:
    """The mixture's .npy (float16), written atomically on first use; (path, seconds spent writing it now)."""
    path = work / f"mixture-{n}x{d}-c{clusters}-s{seed}.f16.npy"
    if path.exists():
        return path, 0.0
    t = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    mm = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=(n, d))
    rng = np.random.default_rng(seed)
    # The same family as pool_scale's 100k mixture: clusters of unequal size and spread.
    centres = rng.standard_normal((clusters, d), dtype=np.float32)
    sizes = rng.dirichlet(np.ones(clusters) * 2)
    spread = rng.uniform(0.15, 0.5, size=clusters).astype(np.float32)
    label = rng.choice(clusters, size=n, p=sizes)
    for s in range(0, n, _CHUNK):
        lab = label[s : s + _CHUNK]
        mm[s : s + _CHUNK] = centres[lab] + rng.standard_normal((len(lab), d), dtype=np.float32) * spread[lab, None]
    mm.flush()
    del mm
    os.replace(tmp, path)
    return path, round(time.perf_counter() - t, 1)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: one selector over the memory-mapped file, or a random batch's covering radius."""
    sys.path.insert(0, str(ROOT))
    from benchmarks._results import peak_rss_mb
    from pipeline.strategies.blocked import BlockedRows
    from pipeline.strategies.coverage import MaxHerding
    from pipeline.strategies.selectors import KCenter

    x = np.load(spec["path"], mmap_mode="r")
    t = time.perf_counter()
    out: dict[str, Any] = {}
    if spec["what"] == "random_radius":
        picks = np.load(spec["picks"])
        out["radius"] = BlockedRows(x, seed=spec["seed"]).radius_of(np.asarray(x[np.sort(picks)], dtype=np.float32))
    else:
        sel = KCenter() if spec["what"] == "k_center" else MaxHerding()
        picks = sel.select(spec["k"], scores=np.zeros(len(x)), embeddings=x, seed=spec["seed"])
        np.save(spec["picks"], picks)
        out["info"] = sel.info
    out["s"] = round(time.perf_counter() - t, 1)
    out["rss_mb"] = peak_rss_mb()
    return out


def _run_child(spec: dict[str, Any], threads: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads),
           "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("pool_scale.py")), "--child-10m",
                           json.dumps(spec)], capture_output=True, text=True, env=env, check=False)
    if proc.returncode:
        raise RuntimeError(f"select10m child {spec['what']} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _coverage(x: np.ndarray, rows: np.ndarray, picks: np.ndarray, sigma: float) -> float:
    """Mean over `rows` of exp(-min_j ‖x − p_j‖² / 2σ²): MaxHerding's objective on a uniform sample."""
    q = np.asarray(x[rows], dtype=np.float32)
    d2, _ = faiss.knn(q, np.asarray(x[np.sort(picks)], dtype=np.float32), 1)
    return round(float(np.exp(-np.maximum(d2[:, 0], 0.0) / (2.0 * sigma * sigma)).mean()), 4)


def run_select_10m(args: Any) -> dict[str, Any]:
    work = Path(args.work_dir or "/tmp/tamis-pool-scale")
    n, d, k = args.big_n, args.big_d, args.big_k
    path, gen_s = mixture_file(work, n, d, args.big_clusters, args.seed)
    res: dict[str, Any] = {"n": n, "d": d, "k": k, "clusters": args.big_clusters, "dtype": "float16",
                           "file_mb": round(path.stat().st_size / 2**20, 1), "generate_s": gen_s}
    for what in ("k_center", "maxherding"):
        res[what] = _run_child({"what": what, "path": str(path), "k": k, "seed": args.seed,
                                "picks": str(work / f"picks-{what}.npy")}, args.threads)
    rng = np.random.default_rng(args.seed + 7)
    random_picks = np.sort(rng.choice(n, size=k, replace=False))
    np.save(work / "picks-random.npy", random_picks)
    rr = _run_child({"what": "random_radius", "path": str(path), "seed": args.seed,
                     "picks": str(work / "picks-random.npy")}, args.threads)
    x = np.load(path, mmap_mode="r")
    rows = np.sort(rng.choice(n, size=min(n, _EVAL_ROWS), replace=False))
    sigma = float(res["maxherding"]["info"]["bandwidth"])
    kc_radius = float(res["k_center"]["info"]["radius"])
    res["quality"] = {
        "kcenter_radius": round(kc_radius, 3),
        "random_radius": round(rr["radius"], 3),
        "kcenter_over_random_radius": round(kc_radius / rr["radius"], 3),
        "random_radius_s": rr["s"],
        "coverage_rows": len(rows),
        "coverage_sigma": round(sigma, 4),
        "coverage_maxherding": _coverage(x, rows, np.load(work / "picks-maxherding.npy"), sigma),
        "coverage_kcenter": _coverage(x, rows, np.load(work / "picks-k_center.npy"), sigma),
        "coverage_random": _coverage(x, rows, random_picks, sigma),
    }
    return {
        "select_10m_kcenter_s": res["k_center"]["s"],
        "select_10m_maxherding_s": res["maxherding"]["s"],
        "select_10m_rss_mb": max(res["k_center"]["rss_mb"], res["maxherding"]["rss_mb"]),
        "select_10m_target_s": 600,
        "select_10m_rss_target_mb": 8192,
        "select_10m": res,
    }
