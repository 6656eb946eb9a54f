"""Incremental ingest at scale: a pool of N distinct 28×28 digit PNGs on disk, ingested first, again unchanged, and
again after adding --add new images; wall time, CPU time, peak RSS and the image files read, each phase in a fresh
process. The unchanged re-ingest runs three times, back to back so their ratios hold whatever the machine's load: with
data.verify listing (the default: a stat per folder), stat (a stat per image file) and content (every image re-read,
what every re-ingest did before the file index); on a shared machine the CPU seconds say more than the wall seconds.

Each phase runs what `tamis ingest` runs in the library (the source digest through the file index, then the ingest
stage, which re-uses a verified folder or builds one from shards); Prefect's own overhead is not in these figures.

    nice -n 10 python benchmarks/ingest_scale.py --n 100000 --add 10000 --json-out benchmarks/results/ingest_scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._results import peak_rss_mb, write_result  # noqa: E402

QUESTION = "Which digit is shown in the image?"


def write_pool(root: Path, start: int, stop: int, seed: int, bases: Sequence[int] | None = None) -> float:
    """Images start..stop-1: a digit upscaled to 28×28, shifted and noised, so every file is distinct. Image i shows
    digit `bases[i % len(bases)]` of scikit-learn's digits (default: digit i % 1797), so a pool and a test set can
    be drawn from disjoint digits (benchmarks/candidates_scale.py)."""
    import io

    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits().images

    def base_of(i: int) -> int:
        return int(bases[i % len(bases)]) if bases is not None else i % len(digits)

    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for i in range(start, stop):
        rng = np.random.default_rng([seed, i])
        base = np.kron(digits[base_of(i)], np.ones((3, 3))) * 15  # 24×24
        canvas = np.zeros((28, 28))
        dy, dx = rng.integers(0, 5, 2)
        canvas[dy:dy + 24, dx:dx + 24] = base
        canvas += rng.normal(0, 8, canvas.shape)
        buf = io.BytesIO()
        Image.fromarray(canvas.clip(0, 255).astype(np.uint8)).save(buf, format="PNG")
        p = root / f"{i:07d}.png"
        p.write_bytes(buf.getvalue())
        # Files in a real pool are older than the ingest that first sees them; fresh ones would be "racy" (their
        # mtime within the timestamp granularity of the digest) and read once more by the next run.
        past = time.time() - 3600
        os.utime(p, (past, past))
    # The folder too: one changed within the timestamp granularity of a walk is walked again (pipeline/data/listing.py).
    past = time.time() - 3600
    os.utime(root, (past, past))
    return time.perf_counter() - t0


def config(work: Path, verify: str = "listing"):
    from pipeline.config import parse_config

    # Images directly in the folder: an unlabeled pool, as a labeling project starts.
    return parse_config({"data": {"sources": [{"kind": "folder", "path": str(work / "pool")}], "question": QUESTION,
                                  "verify": verify},
                         "paths": {"artifacts": str(work / "artifacts")}})


def phase(work: Path, verify: str) -> dict:
    """One `tamis ingest`, as the flow runs it without Prefect: source digest, then the (cached) ingest stage."""
    from pipeline.data.ingest import ingest_params, ingest_stage, source_digest

    cfg = config(work, verify)
    load = os.getloadavg()[0]
    opened: list[int] = [0]

    def audit(event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], str) and args[0].endswith(".png"):
            opened[0] += 1

    sys.addaudithook(audit)
    c0, t0 = time.process_time(), time.perf_counter()
    digest = source_digest(cfg.data, cfg.artifacts)
    t_digest = time.perf_counter() - t0
    ref = ingest_stage(ingest_params(cfg.data, cfg.artifacts, digest))
    wall = time.perf_counter() - t0
    m = json.loads((Path(ref["dir"]) / "manifest.json").read_text())
    cpu = time.process_time() - c0
    return {"verify": verify, "wall_s": round(wall, 2), "digest_s": round(t_digest, 2),
            "stage_s": round(wall - t_digest, 2), "cpu_s": round(cpu, 2),
            "load_1m_at_start": round(load, 1),
            "peak_rss_mb": peak_rss_mb(),
            "png_opens": opened[0], "counts": ref["counts"],
            # from the ingest folder's manifest: what the run that built it read (a re-used folder read nothing)
            "rows_read_by_builder": m["info"].get("rows_read"),
            "shards": m["info"].get("shards"), "shards_reused": m["info"].get("shards_reused")}


def run_phase(work: Path, verify: str = "listing") -> dict:
    out = subprocess.run([sys.executable, __file__, "--phase", str(work), "--verify", verify], capture_output=True,
                         text=True, check=False)
    if out.returncode:
        raise SystemExit(f"phase failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--add", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--phase", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--verify", default="listing", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase is not None:
        import logging

        logging.disable(logging.WARNING)
        print(json.dumps(phase(args.phase, args.verify)))
        return
    started = time.time()
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        build_s = write_pool(work / "pool", 0, args.n, args.seed)
        first = run_phase(work)
        unchanged = run_phase(work)
        unchanged_stat = run_phase(work, "stat")
        unchanged_content = run_phase(work, "content")
        add_build_s = write_pool(work / "pool", args.n, args.n + args.add, args.seed)
        added = run_phase(work)
        after = run_phase(work)
    result = {
        "n": args.n, "add": args.add, "image": "28x28 grayscale PNG, distinct jittered digits",
        "pool_write_s": round(build_s, 1), "add_write_s": round(add_build_s, 1),
        "first_ingest": first, "unchanged_reingest": unchanged, "unchanged_reingest_stat": unchanged_stat,
        "unchanged_reingest_content": unchanged_content, "add_ingest": added, "unchanged_after_add": after,
        "first_images_per_s": round(args.n / first["wall_s"], 1),
        "unchanged_over_first": round(unchanged["wall_s"] / first["wall_s"], 3),
        "unchanged_listing_over_stat_wall": round(unchanged["wall_s"] / unchanged_stat["wall_s"], 3),
        "unchanged_stat_over_content_wall": round(unchanged_stat["wall_s"] / unchanged_content["wall_s"], 3),
        "unchanged_stat_over_content_cpu": round(unchanged_stat["cpu_s"] / unchanged_content["cpu_s"], 3),
        "add_over_first_cpu": round(added["cpu_s"] / first["cpu_s"], 3),
        "add_over_first": round(added["wall_s"] / first["wall_s"], 3),
    }
    write_result(result, args.json_out, config={"n": args.n, "add": args.add, "seed": args.seed}, started=started)


if __name__ == "__main__":
    main()
