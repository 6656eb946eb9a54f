"""The report's pool map: a bounded, seeded sample of the selection space (every selected sample, some labeled ones
and outliers, the rest drawn uniformly) projected to 2-D, each point marked with its kind. Bounded by MAP_POINTS and
MAP_EXTRA, not by the pool: candidates are tested against their sorted ID file, not loaded as rows."""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import ArtifactError
from pipeline.round_state import RoundState
from pipeline.roundreport.sources import ReportSources
from pipeline.store import read_jsonl

MAP_POINTS = 4000  # background points of the pool map (plus every selected, and at most MAP_EXTRA of each kind)
MAP_EXTRA = 1000

KINDS = ("other", "candidate", "labeled", "outlier", "selected")  # drawing order; a point's kind is its last


@dataclass
class PoolMap:
    xy: np.ndarray  # [n, 2] the seeded projection of the sampled points
    kind: list[str]  # KINDS, per point
    label: list[str | None]  # the labeled points' class
    space: str  # which embeddings
    sampled: int  # points drawn of `total`
    total: int


def _shard_space(sources: ReportSources, ids: Sequence[str], rng: np.random.Generator) -> tuple[list[str], Any]:
    """The model's embeddings of `ids` plus whole random shards up to MAP_POINTS rows: the map's space when
    selection reads the scorer's embeddings (no embeddings stage)."""
    from pipeline.scoring import load_scores

    firsts = [f for f, _ in sources.shards]
    take = {k for sid in ids if (k := bisect.bisect_right(firsts, sid) - 1) >= 0}
    per_shard = _shard_len(sources)
    for k in rng.permutation(len(sources.shards)):
        if len(take) * per_shard >= MAP_POINTS + len(ids):
            break
        take.add(int(k))
    out_ids, parts = [], []
    for k in sorted(take):
        try:
            s = load_scores(sources.shards[k][1])
        except (ArtifactError, OSError):
            continue
        out_ids += s.sample_ids
        parts.append(s.embeddings)
    return out_ids, (np.concatenate(parts) if parts else np.zeros((0, 2), np.float32))


def _shard_len(sources: ReportSources) -> int:
    """Rows per shard (all shards but the last hold the same number), read from the first shard's ID file."""
    try:
        return len(json.loads((Path(sources.shards[0][1]) / "scores.json").read_text())["sample_ids"])
    except (OSError, ValueError, KeyError):
        return 256


def pool_map_points(sources: ReportSources, state: RoundState, batch: Sequence[str],
                    labels: Mapping[str, str]) -> PoolMap | None:
    """A bounded, seeded sample of the selection space (every selected sample, at most MAP_EXTRA labeled and
    outliers, MAP_POINTS drawn uniformly) projected to 2-D by a PCA fitted on that sample, with each point's kind."""
    from pipeline.idindex import IdIndex

    rng = np.random.default_rng(sources.seed)
    rd = Path(sources.round_dir)
    outliers = [r["sample_id"] for r in read_jsonl(rd / "selection" / "outliers.jsonl")][:MAP_EXTRA]
    lab = sorted(labels)
    lab = [lab[i] for i in np.sort(rng.choice(len(lab), MAP_EXTRA, replace=False))] if len(lab) > MAP_EXTRA else lab
    if sources.space_dir and Path(sources.space_dir).is_dir():
        from pipeline.embeddings import load_selection_embeddings

        ids, emb = load_selection_embeddings(sources.space_dir)
        space = f"selection embeddings ({sources.space_source})"
    elif sources.shards:
        ids, emb = _shard_space(sources, [*batch, *lab[:200], *outliers], rng)
        space = "the model's embeddings (select.embeddings: model)"
    else:
        return None
    if not len(ids):
        return None
    index = IdIndex(ids)
    background = rng.choice(len(ids), min(MAP_POINTS, len(ids)), replace=False)
    kind_of: dict[int, str] = {int(r): "other" for r in background}
    cand = _sorted_ids(rd / "candidates.jsonl")
    for r in background:
        if cand.size and _member(cand, ids[int(r)]):
            kind_of[int(r)] = "candidate"
    for kind, wanted in (("labeled", lab), ("outlier", outliers), ("selected", list(batch))):
        for r in index.rows(wanted):
            if r >= 0:
                kind_of[int(r)] = kind
    rows = np.array(sorted(kind_of), dtype=np.int64)
    x = np.asarray(emb[rows], dtype=np.float32)
    xy = _project(x, sources.seed)
    kinds = [kind_of[int(r)] for r in rows]
    return PoolMap(xy, kinds, [labels.get(ids[int(r)]) if k == "labeled" else None for r, k in zip(rows, kinds,
                                                                                              strict=True)],
                   space, len(rows), len(ids))


_ID = re.compile(r'"sample_id":\s*"((?:[^"\\]|\\.)*)"')


def _sorted_ids(path: Path) -> np.ndarray:
    """A JSONL list of sample IDs as a sorted bytes array, for membership by binary search."""
    if not path.is_file():
        return np.zeros(0, dtype="S1")
    # One regex pass over the file: a json.loads per line is most of a 10⁶-candidate report's time.
    ids = _ID.findall(path.read_text(encoding="utf-8"))
    return np.sort(np.char.encode(np.asarray(ids, dtype=str), "utf-8")) if ids else np.zeros(0, dtype="S1")


def _member(sorted_ids: np.ndarray, sid: str) -> bool:
    key = sid.encode("utf-8")
    i = int(np.searchsorted(sorted_ids, key))
    return i < len(sorted_ids) and sorted_ids[i] == key


def _project(x: np.ndarray, seed: int) -> np.ndarray:
    """2-D PCA of the sample, seeded (randomized SVD), its sign fixed by the largest loading so re-runs agree."""
    if len(x) < 3 or x.shape[1] < 2:
        return np.zeros((len(x), 2), np.float32) if x.shape[1] < 2 else x[:, :2]
    from sklearn.decomposition import PCA

    pca = PCA(n_components=2, svd_solver="randomized", random_state=seed)
    xy = pca.fit_transform(x)
    signs = np.sign(pca.components_[np.arange(2), np.abs(pca.components_).argmax(1)])
    return (xy * np.where(signs == 0, 1, signs)).astype(np.float32)
