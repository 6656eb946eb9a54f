"""The label-efficiency benchmark's `candidates_check`: a strategy with `select.candidates: restrict` beside the same
strategy scoring the whole pool (`all`), paired seeds, so any cost in labels of scoring only the candidates is
measured.

The learner is the reference probe (logistic regression on the selection embeddings): the tiny VLM needs minutes per
round on 2 shared cores, the probe milliseconds, and what restriction can cost is a selection effect (which samples
the strategy may pick), which the probe measures without the tiny model's training noise. Each round's candidates
come from the library (pipeline.strategies.candidates.round_candidates), as a project's round picks them.

The section goes into an existing results JSON under its own key with its own provenance (commit, tree, config,
machine, wall time from benchmarks/_results.py): the file's other keys stay as they were, from their own run.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._curves import bootstrap_ratio, labels_to
from benchmarks._results import provenance
from pipeline.config import CandidatesConfig, SelectConfig
from pipeline.selection import Space, coverage_picker
from pipeline.store import atomic_write_json, digest_json
from pipeline.strategies.candidates import candidates_choice, round_candidates

KEY = "candidates_check"


def restrictor(sel_cfg: SelectConfig, *, pool: Sequence[str], space: Space, seed: int, cache_dir: Path,
               n_classes: int | None) -> Callable[[list[str], Any], list[str]]:
    """`restrict(labeled, phase) -> candidate IDs` for a probe run, as a project's round chooses them
    (pipeline.selection.coverage_picker in a coverage phase, else the sources of select.candidates.shares): the
    eligible pool is `pool` minus the labeled set; the k-means labels are fitted once per space (cached in
    `cache_dir`, keyed by the embeddings' bytes)."""
    digest = digest_json({"ids": space.ids, "emb": hashlib.sha256(np.ascontiguousarray(space.emb).tobytes())
                          .hexdigest()})

    def restrict(labeled: list[str], phase: Any) -> list[str]:
        done = set(labeled)
        coverage = coverage_picker(phase.strategy, phase.diversity, space=space, labeled=labeled, n_classes=n_classes)
        return round_candidates(sel_cfg, pool_ids=[s for s in pool if s not in done], labeled_ids=labeled,
                                space_ids=space.ids, space_emb=space.emb, seed=seed, cache_dir=cache_dir,
                                space_digest=digest, coverage=coverage, diversity=phase.diversity).ids

    return restrict


def resolve(cand: CandidatesConfig, *, eligible: int, embeddings_source: str,
            batch: int) -> tuple[CandidatesConfig, dict[str, Any]]:
    """The restricted arm's settings for `cand` (the project's select.candidates, `auto` by default) at a pool of
    `eligible` samples, and what to say about them. Where auto would score everything (at most auto_above eligible
    samples), restriction is forced at the size auto restricts to above it (per_batch × the batch, e.g. 1,000 for
    init's batch of 100 on a large pool): labelled `forced`, since a project of this size never restricts."""
    choice = candidates_choice(cand, eligible=eligible, embeddings_source=embeddings_source)
    note: dict[str, Any] = {"method_configured": cand.method, "auto_choice": choice.method,
                            "auto_reason": choice.reason, "forced": choice.method != "restrict"}
    if choice.method == "restrict":
        return cand, note
    size = cand.size_for(batch)
    note["forced_why"] = (f"auto scores all {eligible:,} eligible samples here (≤ auto_above {cand.auto_above:,}), "
                          f"so the restriction cannot bite; forced to restrict at the size auto uses above it: "
                          f"per_batch {cand.per_batch} × batch {batch} = {size} candidates ({size / eligible:.1%} of "
                          "the eligible pool), the same candidates-to-batch proportion as init's 1,000 for a batch "
                          "of 100")
    return cand.model_copy(update={"method": "restrict"}), note


def paired_ratio(runs: dict[str, list[dict[str, Any]]], full: list[float], a: str, b: str, pct: int,
                 n: int) -> dict[str, Any]:
    """Labels to pct % of full-data accuracy of `a` ÷ those of `b` (mean curves) with a paired bootstrap 95 % interval
    over seeds: restriction's own cost in labels (restricted ÷ all), without random's noise in between."""
    labels = np.asarray(runs[a][0]["labels"], dtype=float)
    acc_a = np.asarray([r["accuracy"] for r in runs[a]])
    acc_b = np.asarray([r["accuracy"] for r in runs[b]])
    target = pct / 100 * float(np.mean(full))
    la = labels_to(list(labels), list(acc_a.mean(0)), target)
    lb = labels_to(list(labels), list(acc_b.mean(0)), target)
    ci, undefined = bootstrap_ratio(acc_a, acc_b, np.asarray(full), labels, pct, n)
    return {"ratio": None if la is None or lb is None else round(la / lb, 3), "ci": ci,
            "bootstrap_undefined": round(undefined, 3), "labels": {a: la, b: lb},
            "of": f"labels to {pct} % of full-data accuracy, {a} ÷ {b} (mean curves), paired bootstrap 95 % interval"}


def with_candidates(sel_cfg: SelectConfig, cand: CandidatesConfig) -> SelectConfig:
    return sel_cfg.model_copy(update={"candidates": cand})


def check_row(strategy: str, summary: dict[str, Any], *, restricted: str, baseline: str,
              candidates: CandidatesConfig, batch: int, scored: list[list[int]], pool_sizes: list[int],
              seeds: list[int], shares: dict[str, float] | None = None) -> dict[str, Any]:
    """The `candidates_check` figures of one strategy from `summarize`'s output over the baseline, `strategy`
    (scoring all) and `restricted` (the same with candidates, drawn in `shares`: pipeline.strategies.candidates.
    shares_for)."""
    a, c = summary[strategy], summary[restricted]
    ci = a.get("ratio_to_random_95_ci")
    ratio_c = c.get("ratio_to_random_95")
    within = None if ratio_c is None or not ci or None in ci else bool(ci[0] <= ratio_c <= ci[1])
    return {
        "strategy": strategy, "ratio_candidates": ratio_c, "ratio_all": a.get("ratio_to_random_95"),
        "ratio_all_ci": ci, "ratio_candidates_ci": c.get("ratio_to_random_95_ci"),
        "within_ci": within, "ratio_of": f"labels to 95 % of full-data accuracy ÷ {baseline}'s (mean curve), paired "
                                         "bootstrap 95 % interval over seeds",
        "labels_to_95": {"all": a.get("labels_to_95"), "candidates": c.get("labels_to_95"),
                         baseline: summary[baseline].get("labels_to_95")},
        "auc": {"all": a["auc"], "all_ci": a["auc_ci"], "candidates": c["auc"], "candidates_ci": c["auc_ci"]},
        "mean_curve": {"labels": a["labels"], "all": a["mean"], "candidates": c["mean"]},
        "select_candidates": {**candidates.model_dump(mode="json"), "size_used": candidates.size_for(batch),
                              "shares_resolved": shares},
        "scored_per_round_mean": [round(float(x), 1) for x in np.mean(scored, axis=0)],
        "eligible_pool": pool_sizes, "seeds": seeds,
    }


def merge_into(path: str | os.PathLike[str], section: dict[str, Any], **provenance_kwargs: Any) -> dict[str, Any]:
    """Put `section` (with its own provenance) under KEY in the results JSON at `path`, every other key kept."""
    path = Path(path)
    existing = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    out = {**existing, KEY: json.loads(json.dumps({**section, "provenance": provenance(**provenance_kwargs)},
                                                  default=str))}
    print(json.dumps(out[KEY], indent=2))
    atomic_write_json(path, out)
    return out
