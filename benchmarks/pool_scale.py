"""Pool-scale benchmark (issue #5): selection time on 100k embeddings; scoring memory is a separate part.

    python benchmarks/pool_scale.py --part selection --json-out benchmarks/results/pool_scale_selection.json

Parts:
  selection  k-center and cluster-margin picking --k of --n seeded, clustered float32 embeddings of dimension --d
             (keys kcenter_s, cluster_margin_s; target < 5 s each on 2 cores), then the coverage selectors on the
             same embeddings as a cold start (keys typiclust_s, probcover_s, maxherding_s; target < 10 s each;
             ProbCover's purity radius uses --n-classes clusters; *_info holds what each chose).
  select10m  10k picks from 10^7 x 128 float16 embeddings memory-mapped from disk (a seeded mixture of --big-clusters
             clusters written once to --work-dir, 2.6 GB) by the library's KCenter and MaxHerding, each in a fresh
             process (keys select_10m_kcenter_s, select_10m_maxherding_s, select_10m_rss_mb; targets <= 600 s each,
             <= 8 GB), with k-center's covering radius and MaxHerding's pool coverage against a random batch
             (benchmarks/_pool_10m.py).
  flow       rounds through the real flow on --flow-pools pools of distinct digit PNGs on disk: a first round, a
             steady-state round, an unchanged re-run (flow and CLI), a round after adding --flow-add images; wall
             time, executed stages and peak RSS per run (benchmarks/_pool_flow.py). Not in --part all (its pools
             take minutes to hours to write and run).
  defaults   a --defaults-pool pool (100,000 PNGs; the 10⁶ case with the command below) with the config `tamis init`
             writes for it, untouched: first round, an annotator's labels, a steady round (keys
             steady_round_s_100k_defaults, candidates_100k_defaults) and a no-op `tamis ingest` and `tamis round`
             (noop_ingest_s_100k_defaults, noop_round_s_100k_defaults) (benchmarks/_pool_defaults.py). Not in
             --part all.
  scoring    peak RSS of scoring + selecting a 10k and a 100k pool (keys rss_mb_10k, rss_mb_100k, rss_ratio;
             target ratio <= 1.2). Each pool is a real prepared dataset on disk (generated images of varied sizes
             run through preprocess_dataset; Arrow, memory-mapped), scored with the tiny 4-bit Idefics3 in a fresh
             subprocess shard by shard as flows/select.py does (load the shard's rows, score, save, drop), then
             selected from the saved shards (entropy + k_center). Peak RSS is the child's VmHWM.
             Scoring 100k rows takes 10-20 min on 2 busy cores: when the smallest pool's throughput projects the
             big pool past --max-score-s, the big pool scores --real-rows rows (evenly spread shards) for real and
             the other shards are precomputed from the small pool's real scores (JSON: "scoring_100k":
             "precomputed", with scored / precomputed row counts). Prepared pools are cached in --work-dir.

    python benchmarks/pool_scale.py --part all,flow --flow-pools 100000,1000000 --work-dir /tmp/tamis-pool-scale \\
        --json-out benchmarks/results/pool_scale.json
    python benchmarks/pool_scale.py --part defaults --work-dir /tmp/tamis-pool-scale \
        --json-out benchmarks/results/pool_scale_defaults.json
    python benchmarks/pool_scale.py --part defaults --defaults-pool 1000000 --work-dir /tmp/tamis-pool-scale \
        --defaults-keep-first --json-out benchmarks/results/pool_scale_defaults.json --nest-under pool_1000000
        # 10 min to write the PNGs once, round 0 50 min at load ~10; then --defaults-from-first reruns the rest
    python benchmarks/pool_scale.py --part scoring --pools 1000,5000     # a quick look
    python benchmarks/pool_scale.py --part select10m --big-n 1000000 --big-k 1000 --big-clusters 100   # 10^6
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

from benchmarks._pool_10m import child as child_10m  # noqa: E402
from benchmarks._pool_10m import run_select_10m  # noqa: E402
from benchmarks._pool_defaults import run_pool_defaults  # noqa: E402
from benchmarks._pool_flow import run_pool_flow  # noqa: E402
from benchmarks._results import CacheFolder, write_result  # noqa: E402
from pipeline.store import atomic_write_json  # noqa: E402
from pipeline.strategies.coverage import MaxHerding, ProbCover, TypiClust  # noqa: E402
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
    out: dict[str, Any] = {
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
    # Cold start: no labeled embeddings, scores ignored.
    for key, sel in (("typiclust", TypiClust()), ("probcover", ProbCover(n_classes=args.n_classes)),
                     ("maxherding", MaxHerding())):
        sec, cpu, picks = _timed(lambda sel=sel: sel.select(args.k, scores=scores, embeddings=x, seed=args.seed),
                                 args.repeat)
        assert len(set(picks.tolist())) == args.k
        out[f"{key}_s"], out[f"{key}_cpu_s"] = round(sec, 3), round(cpu, 3)
        out[f"{key}_info"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in sel.info.items()}
    out["coverage_target_s"] = 10.0
    return out


# ------------------------------------------------------------------------------------------ scoring part
QUESTION = "Which digit is shown in the image?"
DIGITS = [str(d) for d in range(10)]
MiB = 1 << 20


def _rss_peak_mb() -> float:
    from benchmarks._results import peak_rss_mb

    return peak_rss_mb()


def _pool_label(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 else str(n)


def generated_images(n: int, *, seed: int, chunk: int = 5000):
    """Chunks of ingested-schema rows: a digit on a coloured background, 20-64 px sides, PNG; unique bytes per row."""
    import io

    from PIL import Image, ImageDraw

    from pipeline.schema import sample_id_for

    rng = np.random.default_rng(seed)
    for start in range(0, n, chunk):
        rows: dict[str, list[Any]] = {k: [] for k in ("sample_id", "image", "image_path", "question", "answer",
                                                      "split", "source", "sources", "width", "height", "mode")}
        for i in range(start, min(n, start + chunk)):
            w, h = (int(v) for v in rng.integers(20, 65, 2))
            im = Image.new("RGB", (w, h), tuple(int(c) for c in rng.integers(0, 256, 3)))
            ImageDraw.Draw(im).text((w // 3, h // 4), str(i % 10), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
            im.putpixel((0, 0), (i & 255, (i >> 8) & 255, (i >> 16) & 255))  # no two images alike
            buf = io.BytesIO()
            im.save(buf, "PNG")
            data = buf.getvalue()
            for k, v in (("sample_id", sample_id_for(data, QUESTION)), ("image", data), ("image_path", ""),
                         ("question", QUESTION), ("answer", None), ("split", "pool"), ("source", f"gen:{i}"),
                         ("sources", [f"gen:{i}"]), ("width", w), ("height", h), ("mode", "RGB")):
                rows[k].append(v)
        yield rows


def build_pool(out_dir: Path, n: int, *, seed: int) -> tuple[Path, float]:
    """A prepared pool of n generated images (preprocess_dataset at 32 px); reused when it already verifies."""
    import datasets

    from pipeline.config import PreprocessConfig
    from pipeline.errors import ArtifactError
    from pipeline.preprocess import preprocess_dataset
    from pipeline.store import read_manifest

    what = {"generated": f"n={n} seed={seed} v1"}
    try:
        if read_manifest(out_dir).inputs == what:
            return out_dir, 0.0
    except ArtifactError:
        pass
    t = time.perf_counter()
    features = datasets.Features({
        "sample_id": datasets.Value("string"), "image": datasets.Value("binary"),
        "image_path": datasets.Value("string"), "question": datasets.Value("string"),
        "answer": datasets.Value("string"), "split": datasets.Value("string"), "source": datasets.Value("string"),
        "sources": datasets.List(datasets.Value("string")), "width": datasets.Value("int32"),
        "height": datasets.Value("int32"), "mode": datasets.Value("string"),
    })
    ds = datasets.concatenate_datasets([datasets.Dataset.from_dict(c, features=features)
                                        for c in generated_images(n, seed=seed)])
    m = preprocess_dataset(ds, PreprocessConfig(size=32), out_dir, size=32, max_pixels=1_000_000, inputs=what)
    if m.info["rows"] != n:
        raise SystemExit(f"{out_dir}: {m.info['quarantined']} of {n} generated images were quarantined")
    return out_dir, time.perf_counter() - t


def score_child(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: score the pool shard by shard (as flows/select.py does), select, report peak RSS."""
    import torch

    from pipeline.config import ModelConfig
    from pipeline.model.loading import load_model
    from pipeline.preprocess import load_prepared
    from pipeline.scoring import ClosedSetScorer, concat_scores, load_scores, plan_shards, save_scores
    from pipeline.strategies import Candidates, select_batch

    torch.set_num_threads(spec["threads"])
    out = Path(spec["out_dir"])
    ds = load_prepared(spec["prepared"])
    index = {sid: i for i, sid in enumerate(ds["sample_id"])}
    loaded = load_model(ModelConfig(name_or_path=spec["model"], family="idefics3", mode="qlora"))
    rss_loaded = _rss_peak_mb()
    scorer = ClosedSetScorer(loaded, DIGITS)
    shards = plan_shards(list(index), spec["shard_size"])
    real = set(range(len(shards))) if spec["real_shards"] is None else set(spec["real_shards"])
    t, scored = time.perf_counter(), 0
    for j, ids in enumerate(shards):
        if j not in real:
            continue
        rows = ds.select([index[s] for s in ids])
        rows = [{"sample_id": r["sample_id"], "prepared": r["prepared"], "question": r["question"]} for r in rows]
        result = scorer.score(rows, batch_size=spec["batch_size"])
        save_scores(result, out / f"{j:06d}", version="bench", inputs={"shard": str(j)},
                    config={"batch_size": spec["batch_size"]})
        scored += len(rows)
        del rows, result
    score_s = time.perf_counter() - t
    rss_scored = _rss_peak_mb()
    t = time.perf_counter()
    scores = concat_scores([load_scores(out / f"{j:06d}") for j in range(len(shards))])
    cands = Candidates(scores.sample_ids, probs=scores.probs, embeddings=scores.embeddings,
                       predicted=scores.probs.argmax(1))
    sel = select_batch(cands, k=spec["k"], strategy="entropy", diversity=spec["diversity"], seed=0)
    select_s = time.perf_counter() - t
    return {
        "rss_mb": round(_rss_peak_mb(), 1),
        "rss_mb_after_load": round(rss_loaded, 1),
        "rss_mb_after_scoring": round(rss_scored, 1),
        "pool": len(index),
        "shards": len(shards),
        "scored_rows": scored,
        "score_s": round(score_s, 1),
        "score_sps": round(scored / score_s, 1) if score_s else None,
        "select_s": round(select_s, 2),
        "selected": len(sel.ids),
        "embedding_dim": int(scores.embeddings.shape[1]),
    }


def write_precomputed(out: Path, pool_dir: Path, shard_size: int, skip: set[int], source: Path, seed: int) -> int:
    """Score shards for the shards not scored for real: rows of the small pool's real scores, embeddings jittered."""
    from pipeline.preprocess import load_prepared
    from pipeline.scoring import ScoreResult, concat_scores, load_scores, plan_shards, save_scores

    real = concat_scores([load_scores(p) for p in sorted(source.iterdir())])
    rng = np.random.default_rng(seed)
    scale = 0.05 * float(real.embeddings.std())
    shards = plan_shards(load_prepared(pool_dir)["sample_id"], shard_size)
    written = 0
    for j, ids in enumerate(shards):
        if j in skip:
            continue
        pick = rng.integers(0, len(real.sample_ids), len(ids))
        emb = real.embeddings[pick] + rng.standard_normal((len(ids), real.embeddings.shape[1])).astype(np.float32) * scale
        res = ScoreResult(sample_ids=list(ids), embeddings=emb.astype(np.float32), probs=real.probs[pick])
        save_scores(res, out / f"{j:06d}", version="bench", inputs={"precomputed": str(source)},
                    config={"jitter": scale})
        written += len(ids)
    return written


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    import subprocess

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        raise SystemExit(f"pool_scale: scoring child failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_scoring(args: argparse.Namespace) -> dict[str, Any]:
    import shutil
    import tempfile

    from pipeline.model.tiny import make_tiny_model

    pools = sorted(int(x) for x in args.pools.split(","))
    tmp = None if args.work_dir else tempfile.TemporaryDirectory(prefix="tamis-pool-scale-")
    work = Path(args.work_dir or tmp.name)
    model = work / "tiny-idefics3"
    if not (model / "config.json").is_file():
        make_tiny_model("idefics3", model)
    out: dict[str, Any] = {"scoring_model": "tiny idefics3 (pipeline.model.tiny), 4-bit NF4, fp32 compute, CPU",
                           "scoring_shard_size": args.shard_size, "scoring_batch_size": args.score_batch_size,
                           "scoring_select": f"entropy + {args.diversity}, k={args.select_k}", "runs": {}}
    first: dict[str, Any] | None = None
    try:
        for n in pools:
            label = _pool_label(n)
            pool_dir, build_s = build_pool(work / f"pool-{n}", n, seed=args.seed)
            run_dir = work / f"scores-{n}"
            shutil.rmtree(run_dir, ignore_errors=True)
            n_shards = -(-n // args.shard_size)
            real_shards, mode = None, "full"
            if first is not None and args.scoring_mode != "full":
                projected = n / first["score_sps"]
                if args.scoring_mode == "precomputed" or projected > args.max_score_s:
                    count = max(1, min(n_shards, round(args.real_rows / args.shard_size)))
                    real_shards = sorted({int(x) for x in np.linspace(0, n_shards - 1, count).round()})
                    mode = "precomputed"
                    out[f"projected_score_s_{label}"] = round(projected)
                    pre = write_precomputed(run_dir, pool_dir, args.shard_size, set(real_shards),
                                            work / f"scores-{pools[0]}", args.seed)
                    out[f"precomputed_rows_{label}"] = pre
            spec = {"prepared": str(pool_dir), "model": str(model), "out_dir": str(run_dir), "threads": args.threads,
                    "shard_size": args.shard_size, "batch_size": args.score_batch_size, "k": args.select_k,
                    "diversity": args.diversity, "real_shards": real_shards}
            res = _child(spec)
            res["build_s"] = round(build_s, 1)
            first = first or res
            out["runs"][label] = res
            out[f"rss_mb_{label}"] = res["rss_mb"]
            # Python + torch + transformers + the model are most of the peak; this is what the pool itself adds.
            out[f"rss_mb_above_load_{label}"] = round(res["rss_mb"] - res["rss_mb_after_load"], 1)
            out[f"scoring_{label}"] = mode
            out[f"scored_rows_{label}"] = res["scored_rows"]
    finally:
        if tmp is not None:
            tmp.cleanup()
    small, big = _pool_label(pools[0]), _pool_label(pools[-1])
    out["rss_ratio"] = round(out[f"rss_mb_{big}"] / out[f"rss_mb_{small}"], 3)
    out["rss_ratio_pools"] = f"{big} / {small}"
    out["rss_ratio_target"] = 1.2
    return out


PARTS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "selection": run_selection,
    "scoring": run_scoring,
    "select10m": run_select_10m,
    "flow": run_pool_flow,
    "defaults": run_pool_defaults,
}
# Parts over pools of PNGs on disk through the real flow: run only when named (not in --part all).
FLOW_PARTS = ("flow", "defaults")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="selection",
                    help=f"one of {', '.join([*PARTS, 'all'])}, or several comma-separated (all,flow: every part, "
                         "one commit, one JSON)")
    ap.add_argument("--n", type=int, default=100_000, help="pool size (embeddings)")
    ap.add_argument("--d", type=int, default=384, help="embedding dimension")
    ap.add_argument("--k", type=int, default=1000, help="samples to pick")
    ap.add_argument("--clusters", type=int, default=100, help="clusters in the generated embeddings")
    ap.add_argument("--threads", type=int, default=2, help="BLAS and faiss threads")
    ap.add_argument("--repeat", type=int, default=1, help="runs per timing; the fastest is reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-classes", type=int, default=10, help="ProbCover: k-means clusters of its purity radius")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--nest-under", default=None, metavar="KEY",
                    help="keep what --json-out holds and put this run (with its own commit and load) under KEY: "
                         "e.g. the 10^6 defaults case beside the 100k one")
    sc = ap.add_argument_group("scoring part")
    sc.add_argument("--pools", default="10000,100000", help="pool sizes, comma-separated; the ratio is last / first")
    sc.add_argument("--shard-size", type=int, default=1000)
    sc.add_argument("--score-batch-size", type=int, default=64)
    sc.add_argument("--select-k", type=int, default=100, help="batch selected from each scored pool")
    sc.add_argument("--diversity", default="k_center", choices=["top_k", "k_center", "cluster_margin"])
    sc.add_argument("--scoring-mode", default="auto", choices=["auto", "full", "precomputed"],
                    help="big pools: score every row, precompute most shards, or decide by --max-score-s")
    sc.add_argument("--max-score-s", type=float, default=600.0, help="auto: longest projected scoring of one pool")
    sc.add_argument("--real-rows", type=int, default=10_000, help="rows scored for real in a precomputed pool")
    sc.add_argument("--work-dir", type=Path, default=None, help="keeps the generated pools between runs")
    big = ap.add_argument_group("select10m part")
    big.add_argument("--big-n", type=int, default=10_000_000, help="rows of the memory-mapped float16 mixture")
    big.add_argument("--big-d", type=int, default=128)
    big.add_argument("--big-k", type=int, default=10_000)
    big.add_argument("--big-clusters", type=int, default=1000)
    fl = ap.add_argument_group("flow part")
    fl.add_argument("--flow-pools", default="10000,100000", help="pool sizes through the real flow, comma-separated")
    fl.add_argument("--flow-add", type=int, default=10_000, help="images added before the last round")
    dp = ap.add_argument_group("defaults part")
    dp.add_argument("--defaults-pool", type=int, default=100_000, help="pool size run with the config `tamis init` writes")
    dp.add_argument("--defaults-keep-first", action="store_true",
                    help="keep a copy of the project as round 0 left it (hard links; in the work dir)")
    dp.add_argument("--defaults-from-first", action="store_true",
                    help="restore that copy instead of running init and round 0 (its figures and commit are kept)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-10m", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(score_child(json.loads(args.child))))
        return {}
    if args.child_10m:
        print(json.dumps(child_10m(json.loads(args.child_10m))))
        return {}
    started = time.time()
    # --work-dir keeps the prepared pools between runs: what this run found there counts as reused.
    cache = CacheFolder(args.work_dir) if args.work_dir else None
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
    parts = []
    for name in args.part.split(","):
        for part in [p for p in PARTS if p not in FLOW_PARTS] if name == "all" else [name]:
            if part not in PARTS:
                ap.error(f"--part {name!r}: not one of {', '.join([*PARTS, 'all'])}")
            if part not in parts:
                parts.append(part)
    with threadpool_limits(args.threads, user_api="blas"), faiss_threads(args.threads):
        for part in parts:
            try:
                result.update(PARTS[part](args))
            except NotImplementedError as exc:
                ap.exit(2, f"pool_scale: {exc}; run --part selection\n")
    run = write_result(result, None if args.nest_under else args.json_out, cache=cache, started=started,
                       reused_s=None if cache else 0.0,
                       config={k: v for k, v in vars(args).items() if k not in ("json_out", "child")})
    if args.nest_under and args.json_out:
        held = json.loads(args.json_out.read_text(encoding="utf-8")) if args.json_out.is_file() else {}
        atomic_write_json(args.json_out, {**held, args.nest_under: run})
    return run


if __name__ == "__main__":
    main()
