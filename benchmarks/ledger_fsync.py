"""What durability costs the label ledger: appending N committed batches with and without fsync.

Each append is one batch as an import writes it (Ledger.append: begin record, entries, commit record, one write),
fsync'd (the default) or not (`fsync=False`, what a ledger without durability would cost). Two batch sizes: a
small import (50 short labels) and a large open-answer file (1,346 answers of ~11 KB of non-ASCII text, 15 MB: the
issue's reproduction). The folder is on the disk that holds the checkout (artifacts/ by default), not a tmpfs.

    python benchmarks/ledger_fsync.py --batches 40 --json-out benchmarks/results/ledger_fsync.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import write_result  # noqa: E402
from pipeline.annotation.ledger import Ledger, make_entry  # noqa: E402
from pipeline.store import append_jsonl  # noqa: E402

ANSWER = "José's café: a naïve photo of a dog on a crêpe stand, 東京 ☕ — "  # ~64 characters, most non-ASCII bytes


def batch(n: int, label_chars: int, b: int) -> list[dict]:
    text = (ANSWER * (label_chars // len(ANSWER) + 1))[:label_chars]
    return [make_entry(f"b{b}-s{i}", f"{text} {i}", annotator="ann", round_index=1, source_file=f"f{b}.csv",
                       source_digest=f"d{b}", now=1.0) for i in range(n)]


def measure(folder: Path, *, rows: int, label_chars: int, batches: int) -> dict:
    """Batches appended in turn to a ledger with fsync and one without, so both see the same machine load."""
    paths = {fsync: folder / f"labels-{rows}-{'fsync' if fsync else 'no_fsync'}.jsonl" for fsync in (True, False)}
    times: dict[bool, list[float]] = {True: [], False: []}
    for b in range(batches):
        rows_ = batch(rows, label_chars, b)
        for fsync in (b % 2 == 0, b % 2 == 1):
            t0 = time.perf_counter()
            append_jsonl(paths[fsync], rows_, fsync=fsync)
            times[fsync].append(time.perf_counter() - t0)
    out = {}
    for fsync, ts in times.items():
        assert len(Ledger(paths[fsync]).entries()) == rows * batches
        out["fsync" if fsync else "no_fsync"] = {
            "ms_median": round(1000 * statistics.median(ts), 2), "ms_p90": round(1000 * sorted(ts)[
                int(0.9 * (len(ts) - 1))], 2), "ms_total": round(1000 * sum(ts), 1),
            "bytes_per_batch": paths[fsync].stat().st_size // batches}
    out["fsync_cost_ms"] = round(out["fsync"]["ms_median"] - out["no_fsync"]["ms_median"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--dir", type=Path, default=ROOT / "artifacts", help="a folder on the disk to measure")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    started = time.time()
    args.dir.mkdir(parents=True, exist_ok=True)
    sizes = {"small": (50, 8), "open_answers_15mb": (1346, 11_000)}
    out = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ledger-fsync-") as tmp:
        for name, (rows, chars) in sizes.items():
            n = args.batches if rows < 1000 else max(4, args.batches // 4)
            out[name] = {"rows_per_batch": rows, "batches": n,
                         **measure(Path(tmp), rows=rows, label_chars=chars, batches=n)}
    result = {
        "benchmark": "ledger_fsync",
        "what": "ms per committed ledger batch appended, with and without fsync (median and p90 of the batches)",
        "disk": str(args.dir), **out,
    }
    write_result(result, args.json_out, config={"batches": args.batches, "sizes": sizes}, started=started)


if __name__ == "__main__":
    main()
