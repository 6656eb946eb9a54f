"""Candidate restriction before scoring (select.candidates, pipeline.strategies.candidates): the candidates are
eligible, sized and seeded, the neighbours are the labeled set's nearest (against a brute-force reference), uncovered
clusters come first, `all` leaves every key as it was, and a restricted round scores only its candidates (the tiny
model on a real prepared pool) with the method in the selection manifest."""

from __future__ import annotations

import io
import typing
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from pipeline import selection as sel
from pipeline.config import CandidatesConfig, ModelConfig, PreprocessConfig, parse_config
from pipeline.errors import ConfigError, SelectionError
from pipeline.report import candidates_line
from pipeline.strategies.candidates import SOURCES, cluster_labels, pick_candidates, share_sizes

DIGITS = [str(d) for d in range(10)]
QUESTION = "Which digit is shown in the image?"


def blobs(n: int = 600, d: int = 8, centres: int = 6, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    c = rng.normal(0, 6, (centres, d))
    return (c[rng.integers(0, centres, n)] + rng.normal(0, 1, (n, d))).astype(np.float32)


def pick(x: np.ndarray, labeled: np.ndarray, *, seed: int = 0, clusters=None, labeled_clusters=None, **cfg):
    ids = [f"p{i:04d}" for i in range(len(x))]
    c = CandidatesConfig(method="restrict", **cfg)
    return ids, pick_candidates(c, eligible=ids, eligible_emb=x, labeled_emb=labeled, batch_size=10, seed=seed,
                                clusters=clusters, labeled_clusters=labeled_clusters)


def naive_neighbors(x: np.ndarray, labeled: np.ndarray, n: int) -> list[int]:
    """Slow reference: every labeled row's full neighbour ranking, read rank by rank, first occurrences kept."""
    d = ((labeled[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    ranks = np.argsort(d, axis=1, kind="stable")
    out: list[int] = []
    for r in range(x.shape[0]):
        for i in range(len(labeled)):
            if int(ranks[i, r]) not in out:
                out.append(int(ranks[i, r]))
    return out[:n]


def test_candidates_are_eligible_sized_and_deterministic_per_seed():
    x, lab = blobs(), blobs(20, seed=1)
    labels = cluster_labels([str(i) for i in range(len(x))], x, n_clusters=12, seed=0, cache_dir=None, inputs={})
    kw = dict(clusters=labels, labeled_clusters=labels[:20])
    ids, a = pick(x, lab, seed=3, **kw)
    _, b = pick(x, lab, seed=3, **kw)
    _, c = pick(x, lab, seed=4, **kw)
    assert len(a.ids) == a.info["candidates"] == 100 == 10 * 10  # default size: per_batch 10 × batch 10
    assert set(a.ids) <= set(ids) and len(set(a.ids)) == 100
    assert a.ids == b.ids and a.ids != c.ids  # only the random fill moves with the seed
    assert a.info["sources"] == {"neighbors": 50, "clusters": 30, "random": 20}
    assert a.info["method"] == "restrict" and a.info["seed"] == 3 and a.info["eligible"] == 600


def test_neighbors_are_the_labeled_sets_nearest_rank_by_rank():
    x, lab = blobs(300), blobs(7, seed=2)
    ids, got = pick(x, lab, size=40, shares={"neighbors": 1.0})
    want = sorted(ids[i] for i in naive_neighbors(x, lab, 40))
    assert got.ids == want and got.info["sources"]["neighbors"] == 40


def test_uncovered_clusters_come_first_with_their_most_central_rows():
    rng = np.random.default_rng(0)
    centres = np.arange(5, dtype=np.float32)[:, None] * 100 * np.ones((1, 2), dtype=np.float32)
    labels = np.repeat(np.arange(5), 20)
    x = (centres[labels] + rng.normal(0, 1, (100, 2))).astype(np.float32)
    lab = centres[:2] + 0.5  # labels in clusters 0 and 1
    _, got = pick(x, lab, size=20, shares={"clusters": 0.15, "random": 0.85}, clusters=labels,
                  labeled_clusters=np.array([0, 1]))
    by_cluster = [i for i in range(100) if f"p{i:04d}" in got.ids]
    assert got.info["sources"]["clusters"] == 3
    # The three cluster picks: the row nearest the mean of clusters 2, 3 and 4 (the uncovered ones).
    central = [int(np.flatnonzero(labels == c)[np.argmin(((x[labels == c] - x[labels == c].mean(0)) ** 2).sum(1))])
               for c in (2, 3, 4)]
    assert set(central) <= set(by_cluster)


def test_random_fills_what_other_sources_cannot_and_small_pools_keep_everything():
    x = blobs(200)
    _, cold = pick(x, np.zeros((0, 8), np.float32), size=50, shares={"neighbors": 1.0})
    assert cold.info["sources"] == {"neighbors": 0, "clusters": 0, "random": 50} and len(cold.ids) == 50
    ids, small = pick(x[:30], blobs(3, seed=1), size=50)
    assert small.ids == ids and small.info["sources"] == {"all eligible": 30}
    with pytest.raises(SelectionError, match="below select.batch_size 10"):
        pick(x, blobs(3, seed=1), size=5)


def test_share_sizes_sum_to_the_size_and_the_registry_matches_the_config():
    assert sum(share_sizes(333, {"neighbors": 0.5, "clusters": 0.3, "random": 0.2}).values()) == 333
    shares = CandidatesConfig.model_fields["shares"].annotation
    assert set(typing.get_args(typing.get_args(typing.get_args(shares)[0])[0])) == set(SOURCES)


def test_all_keeps_the_select_section_as_it_was_and_restrict_needs_a_space(tmp_path):
    plain = parse_config({"select": {"batch_size": 4}}, root=tmp_path)
    assert "candidates" not in plain.section("select")
    assert "candidates" not in plain.model_dump(mode="json")["select"]
    assert plain.section("select") == parse_config({"select": {"candidates": "all", "batch_size": 4}},
                                                   root=tmp_path).section("select")
    on = parse_config({"select": {"candidates": "restrict", "embeddings": "pixels"}}, root=tmp_path)
    assert on.section("select")["candidates"]["method"] == "restrict"
    with pytest.raises(ConfigError, match="select.embeddings to pool, pixels"):
        parse_config({"select": {"candidates": "restrict"}}, root=tmp_path)
    with pytest.raises(ConfigError, match="sum to 1"):
        parse_config({"select": {"candidates": {"method": "restrict", "shares": {"neighbors": 0.4}},
                                 "embeddings": "pixels"}}, root=tmp_path)


def test_cluster_labels_are_fitted_once_and_cached(tmp_path):
    x = blobs(120)
    ids = [str(i) for i in range(len(x))]
    a = cluster_labels(ids, x, n_clusters=6, seed=0, cache_dir=tmp_path, inputs={"space": "s"})
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    stamp = (folder / "clusters.npy").stat().st_mtime_ns
    b = cluster_labels(ids, x, n_clusters=6, seed=0, cache_dir=tmp_path, inputs={"space": "s"})
    assert (folder / "clusters.npy").stat().st_mtime_ns == stamp
    np.testing.assert_array_equal(a, b)
    assert len(np.unique(a)) == 6


def test_the_summary_line_says_what_was_scored():
    c = {"candidates": 40, "eligible": 1300, "scored": 60, "sources": {"neighbors": 20, "clusters": 12, "random": 8}}
    assert candidates_line(c).startswith("scored 40 candidates of 1300 eligible (20 neighbors, 12 clusters, 8 random")
    assert candidates_line(c).endswith("and the 20 labeled samples")


# --------------------------------------------------------------------------------- a round, tiny model, real pool
def prepared_pool(out_dir: Path, n: int) -> dict[str, str]:
    import datasets

    from pipeline.preprocess import preprocess_dataset
    from pipeline.schema import sample_id_for

    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        im = Image.new("RGB", (32, 32), tuple(int(c) for c in rng.integers(0, 256, 3)))
        ImageDraw.Draw(im).text((10, 8), str(i % 10), fill=(255, 255, 255))
        buf = io.BytesIO()
        im.save(buf, "PNG")
        data = buf.getvalue()
        rows.append({"sample_id": sample_id_for(data, QUESTION), "image": data, "image_path": f"/pool/{i}.png",
                     "question": QUESTION, "answer": None, "split": "pool", "source": f"gen:{i}",
                     "sources": [f"gen:{i}"], "width": 32, "height": 32, "mode": "RGB"})
    m = preprocess_dataset(datasets.Dataset.from_list(rows), PreprocessConfig(size=32), out_dir, size=32,
                           max_pixels=1_000_000)
    return {"dir": str(out_dir), "digest": m.key}


def adapter_for(model_dir: Path, out_dir: Path) -> dict[str, str]:
    """A LoRA adapter with random B (a fresh one is the identity), saved like training saves it."""
    import torch

    from pipeline.model.loading import load_model
    from pipeline.store import atomic_dir, digest_dir

    ld = load_model(ModelConfig(name_or_path=str(model_dir), family="idefics3", mode="qlora"), trainable=True)
    torch.manual_seed(0)
    for name, p in ld.model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5)
    with atomic_dir(out_dir) as tmp:
        ld.model.save_pretrained(str(tmp))
    return {"dir": str(out_dir), "digest": digest_dir(out_dir)}


def project(root: Path, model_dir: Path, **select):
    return parse_config({
        "data": {"answers": DIGITS, "question": QUESTION},
        "model": {"name_or_path": str(model_dir), "family": "idefics3", "mode": "qlora"},
        "select": {"batch_size": 4, "strategy": "entropy", "diversity": "top_k", "shard_size": 8,
                   "score_batch_size": 8, "embeddings": {"source": "pixels", "pca_dim": 8}, **select},
        "paths": {"artifacts": str(root / "artifacts")}, "seed": 0}, root=root)


def test_a_restricted_round_scores_only_its_candidates_and_records_how(tmp_path, tiny_models):
    from pipeline.embeddings import compute_selection_embeddings, embeddings_spec
    from pipeline.preprocess import load_prepared
    from pipeline.score_stage import score_config, score_shard, shard_params
    from pipeline.scoring import load_scores
    from pipeline.store import read_jsonl, read_manifest

    prepared = prepared_pool(tmp_path / "prepared", 48)
    ids = sorted(load_prepared(prepared["dir"])["sample_id"])
    labels = {s: "3" for s in ids[:6]}
    pool_ids = ids[6:]
    cfg = project(tmp_path, tiny_models["idefics3"], candidates={"method": "restrict", "size": 12})
    m = compute_selection_embeddings(embeddings_spec(cfg), load_prepared(prepared["dir"]), tmp_path / "space", inputs={"p": "p"})
    space = {"dir": str(tmp_path / "space"), "digest": m.key}
    adapter = adapter_for(tiny_models["idefics3"], tmp_path / "adapter")

    plain_cfg = project(tmp_path, tiny_models["idefics3"])
    plain = sel.plan_selection(plain_cfg, round_dir=tmp_path / "r-all", pool_ids=pool_ids, exclude=ids[:6],
                               labels=labels, adapter=adapter, space=space, history_dirs=[])
    # The default, auto, at 42 eligible samples (≤ auto_above): every one scored, and why recorded.
    assert plain.candidates == ids and plain.params.candidates["method"] == "all"
    assert "42 eligible samples ≤ select.candidates.auto_above" in plain.params.candidates["reason"]
    asked_all = sel.plan_selection(project(tmp_path, tiny_models["idefics3"], candidates="all"),
                                   round_dir=tmp_path / "r-asked", pool_ids=pool_ids, exclude=ids[:6], labels=labels,
                                   adapter=adapter, space=space, history_dirs=[])
    assert asked_all.candidates == ids and asked_all.params.candidates is None  # `all`: keeps its select key
    big = sel.plan_selection(project(tmp_path, tiny_models["idefics3"], candidates={"auto_above": 20, "size": 12}),
                             round_dir=tmp_path / "r-auto", pool_ids=pool_ids, exclude=ids[:6], labels=labels,
                             adapter=adapter, space=space, history_dirs=[])
    assert len(set(big.candidates) - set(labels)) == 12 and big.params.candidates["method"] == "restrict"
    assert "42 eligible samples > select.candidates.auto_above (20)" in big.params.candidates["reason"]

    (tmp_path / "r").mkdir()
    plan = sel.plan_selection(cfg, round_dir=tmp_path / "r", pool_ids=pool_ids, exclude=ids[:6], labels=labels,
                              adapter=adapter, space=space, history_dirs=[])
    chosen = set(plan.candidates) - set(labels)
    assert len(chosen) == 12 and chosen <= set(pool_ids) and set(labels) <= set(plan.candidates)
    scoring = score_config(cfg.select, cfg.model, answers=cfg.data.answers, seed=cfg.seed)
    shards = shard_params(cfg.artifacts, model=cfg.section("model"), scoring=scoring, adapter=adapter,
                          prepared=prepared, pool_ids=plan.candidates, shard_size=cfg.select.shard_size)
    refs = [score_shard(p) for p in shards]
    scored = [s for r in refs for s in load_scores(r["dir"]).sample_ids]
    assert sorted(scored) == plan.candidates and len(scored) == 18  # 12 candidates + 6 labeled, not 48

    ref = sel.select_stage(plan.stage_params(refs))
    rows = read_jsonl(Path(ref["dir"]) / sel.SELECTION_FILE)
    assert len(rows) == 4 and {r["sample_id"] for r in rows} <= chosen
    info = read_manifest(Path(ref["dir"])).info["candidates"]
    assert info["method"] == "restrict" and info["candidates"] == 12 and info["eligible"] == 42
    assert info["scored"] == 18 and sum(info["sources"].values()) == 12 and "seed" in info
    assert ref["candidates"] == info


def test_the_benchmark_section_keeps_the_files_other_keys_and_has_its_own_provenance(tmp_path, capsys):
    import json

    from benchmarks._efficiency_candidates import merge_into

    path = tmp_path / "label_efficiency.json"
    path.write_text(json.dumps({"benchmark": "label_efficiency", "best_ratio_95": 0.622}))
    out = merge_into(path, {"strategy": "margin", "ratio_candidates": 0.7}, config={"c": 1}, started=None)
    back = json.loads(path.read_text())
    assert back == out and back["best_ratio_95"] == 0.622 and "commit" not in back
    assert back["candidates_check"]["strategy"] == "margin"
    assert {"commit", "dirty", "config_digest", "machine"} <= set(back["candidates_check"]["provenance"])


def test_the_benchmark_forces_restriction_where_auto_would_score_all_and_says_so():
    from benchmarks._efficiency_candidates import resolve
    from pipeline.config import CandidatesConfig

    # The digits pool (1,346 eligible) is below auto_above: auto would score all, so the check forces restriction at
    # the size auto restricts to (per_batch × batch) and labels it.
    cand, note = resolve(CandidatesConfig(), eligible=1346, embeddings_source="pool", batch=20)
    assert cand.method == "restrict" and cand.size_for(20) == 200
    assert note["forced"] and note["auto_choice"] == "all" and "200 candidates" in note["forced_why"]
    # Above auto_above, auto restricts by itself: nothing is forced.
    cand, note = resolve(CandidatesConfig(), eligible=24_000, embeddings_source="pixels", batch=100)
    assert cand == CandidatesConfig() and not note["forced"] and note["auto_choice"] == "restrict"


def test_the_restricted_arms_cost_in_labels_is_a_paired_ratio_to_the_unrestricted_arm():
    from benchmarks._efficiency_candidates import paired_ratio

    labels = [10, 20, 30, 40]
    fast = [[0.5, 0.8, 0.9, 0.95], [0.55, 0.85, 0.9, 0.95], [0.5, 0.75, 0.9, 0.95]]
    slow = [[0.5, 0.6, 0.8, 0.95], [0.5, 0.65, 0.85, 0.95], [0.45, 0.6, 0.8, 0.95]]
    runs = {"all": [{"labels": labels, "accuracy": a} for a in fast],
            "cand": [{"labels": labels, "accuracy": a} for a in slow],
            "same": [{"labels": labels, "accuracy": a} for a in fast]}
    full = [0.95, 0.95, 0.95]
    same = paired_ratio(runs, full, "same", "all", 90, 200)
    assert same["ratio"] == 1.0 and same["ci"] == [1.0, 1.0]
    slower = paired_ratio(runs, full, "cand", "all", 90, 200)
    # 90 % of 0.95 = 0.855: "all" reaches it at 25.5 labels (mean curve 0.8 → 0.9), "cand" at 32.9 (0.817 → 0.95).
    assert slower["labels"] == {"cand": pytest.approx(32.875, abs=0.01), "all": pytest.approx(25.5, abs=0.01)}
    assert slower["ratio"] == pytest.approx(32.875 / 25.5, abs=0.002) and slower["ci"][0] > 1.0


def test_the_scale_pools_images_can_come_from_chosen_digits(tmp_path):
    from benchmarks.ingest_scale import write_pool

    # Image i shows digit bases[i % len(bases)] with image i's own jitter: the same bytes as the default pool's
    # image of that digit at that index.
    write_pool(tmp_path / "all", 5, 6, 0)
    write_pool(tmp_path / "chosen", 5, 6, 0, bases=[5])
    write_pool(tmp_path / "other", 5, 6, 0, bases=[7])
    one = (tmp_path / "all" / "0000005.png").read_bytes()
    assert (tmp_path / "chosen" / "0000005.png").read_bytes() == one
    assert (tmp_path / "other" / "0000005.png").read_bytes() != one


def test_a_coverage_phase_takes_its_own_selectors_batch_over_the_whole_pool():
    from pipeline.strategies.candidates import picks_by_space, round_candidates

    assert picks_by_space("random", "maxherding") and not picks_by_space("margin", "top_k")
    assert not picks_by_space("random", "top_k")
    x = blobs(300)
    ids = [f"p{i:04d}" for i in range(300)]
    space = sel.Space(ids, x, "pixels")
    labeled, eligible = ids[:10], ids[10:]
    cfg = parse_config({"select": {"candidates": {"method": "restrict", "size": 30}, "embeddings": "pixels",
                                   "batch_size": 5}}).select
    picker = sel.coverage_picker("random", "maxherding", space=space, labeled=labeled, n_classes=None)
    assert sel.coverage_picker("margin", "top_k", space=space, labeled=labeled, n_classes=None) is None
    got = round_candidates(cfg, pool_ids=eligible, labeled_ids=labeled, space_ids=ids, space_emb=x, seed=0,
                           cache_dir=None, space_digest="s", coverage=picker)
    # Its batch (5), picked over the whole eligible pool: restriction changes nothing a coverage phase picks.
    want = sel.select_step(eligible, k=5, strategy="random", diversity="maxherding", seed=got.info["seed"],
                           labeled=labeled, space=space).ids
    assert got.ids == sorted(want) and got.info["sources"] == {"maxherding (coverage phase)": 5}


def test_herding_rounds_draw_a_uniform_sample_unless_the_config_sets_the_shares():
    from pipeline.strategies.candidates import round_candidates

    # Uncertainty Herding's gain averages over its candidates: by default its restricted rounds take a uniform
    # sample, where a top-k round takes the labeled set's neighbours, uncovered clusters and a random fill.
    x = blobs(400)
    ids = [f"p{i:04d}" for i in range(400)]
    labeled, eligible = ids[:20], ids[20:]

    def round_with(diversity: str, **cand) -> dict:
        cfg = parse_config({"data": {"answers": DIGITS},
                            "select": {"candidates": {"method": "restrict", "size": 60, **cand}, "batch_size": 6,
                                       "embeddings": "pixels", "strategy": "margin", "diversity": diversity}}).select
        return round_candidates(cfg, pool_ids=eligible, labeled_ids=labeled, space_ids=ids, space_emb=x, seed=0,
                                cache_dir=None, space_digest="s").info

    herding = round_with("uncertainty_herding")
    assert herding["sources"] == {"neighbors": 0, "clusters": 0, "random": 60} and herding["shares"] == {"random": 1.0}
    assert round_with("top_k")["sources"] == {"neighbors": 30, "clusters": 18, "random": 12}
    # Shares set in the config are kept whatever the selector.
    mixed = round_with("uncertainty_herding", shares={"neighbors": 0.5, "clusters": 0.3, "random": 0.2})
    assert mixed["sources"] == {"neighbors": 30, "clusters": 18, "random": 12}


def test_auto_candidates_restrict_only_large_pools_with_a_space_and_say_why():
    from pipeline.config import CandidatesConfig, SelectConfig
    from pipeline.strategies.candidates import candidates_choice

    auto = CandidatesConfig()
    assert auto.method == "auto" and auto.auto_above == 10_000
    small = candidates_choice(auto, eligible=10_000, embeddings_source="pixels")
    assert small.method == "all" and "10,000 eligible samples ≤" in small.reason
    large = candidates_choice(auto, eligible=100_000, embeddings_source="pixels")
    assert large.method == "restrict" and "100,000 eligible samples >" in large.reason
    no_space = candidates_choice(auto, eligible=100_000, embeddings_source="model")
    assert no_space.method == "all" and "select.embeddings is model" in no_space.reason
    assert candidates_choice(CandidatesConfig(method="all"), eligible=10**6, embeddings_source="pixels").method == "all"
    # auto is allowed with model embeddings (it falls back to all, saying so); restrict is refused up front.
    SelectConfig(embeddings="model")
    with pytest.raises(ValueError, match="restrict picks candidates before any forward"):
        SelectConfig(embeddings="model", candidates="restrict")
    # Left at its defaults, the section dumps without candidates: the select keys of existing projects stay.
    assert "candidates" not in SelectConfig().model_dump(mode="json")
    assert "candidates" in SelectConfig(embeddings="pixels", candidates={"auto_above": 5}).model_dump(mode="json")
