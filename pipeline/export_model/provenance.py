"""Where a round's adapter came from: the labels it trained on traced to the ledger and the vote log, the people
behind them, and lineage.json."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError
from pipeline.round_state import RoundState, trained_round


@dataclass(frozen=True)
class Provenance:
    """What the model card and lineage.json say about a round's adapter, gathered once."""

    round: int
    state: RoundState
    train_manifest: Any
    labels: list[dict[str, Any]]  # one per training label: ledger entry fields, or source "seed"
    artifacts: Path  # the project's: paths under it are written relative to it


def training_labels(artifacts: str | os.PathLike[str], state: RoundState) -> list[dict[str, Any]]:
    """The labels the round's adapter trained on (its labeled set, rounds/NNN/labeled/), each traced to the newest
    ledger entry for that sample imported by that round, or marked as a seed label the data came with."""
    import datasets

    from pipeline.annotation.ledger import Ledger, ledger_path
    from pipeline.round_state import round_dir

    folder = round_dir(artifacts, state.round) / "labeled" / "dataset"
    if not folder.is_dir():
        raise ConfigError(f"{folder}: the round's labeled set is gone, so its labels cannot be traced; run "
                          f"`tamis round --full` to rebuild it")
    ds = datasets.load_from_disk(str(folder)).select_columns(["sample_id", "answer"])
    newest: dict[str, dict[str, Any]] = {}
    for e in Ledger(ledger_path(artifacts)).entries():
        if "sample_id" in e and int(e.get("round", 0)) <= state.round:
            newest[e["sample_id"]] = e
    logged = logged_votes(artifacts, state.round)
    return [trace_label(sid, answer, newest.get(sid), logged, artifacts)
            for sid, answer in zip(ds["sample_id"], ds["answer"], strict=True)]


def images_per_sample(artifacts: str | os.PathLike[str], state: RoundState) -> int:
    """The most images a sample of the round's labeled set holds (1 for a one-image project)."""
    import datasets

    from pipeline.round_state import round_dir

    ds = datasets.load_from_disk(str(round_dir(artifacts, state.round) / "labeled" / "dataset"))
    if "more_prepared" not in ds.column_names:
        return 1
    return 1 + max((len(m or []) for m in ds["more_prepared"]), default=0)


def trace_label(sid: str, answer: str, entry: Mapping[str, Any] | None, logged: Mapping[str, list[dict[str, str]]],
                artifacts: str | os.PathLike[str]) -> dict[str, Any]:
    """One label as lineage.json lists it: its ledger entry (id, annotators and their votes, round, the imported
    file's digest), or `source: seed` for a label the data came with (no entry)."""
    if entry is None:
        return {"sample_id": sid, "label": answer, "source": "seed"}
    e = entry
    row = {"sample_id": sid, "label": answer, "source": "ledger", "entry_id": e.get("entry_id"),
           "annotator": e.get("annotator"), "votes": logged.get(sid) or entry_votes(e), "round": e.get("round"),
           "kind": e.get("kind"), "source_file": shareable_path(e.get("source_file"), artifacts),
           "source_digest": e.get("source_digest")}
    if e.get("label") != answer:  # e.g. a consensus of several annotators' votes replaced the entry's label
        row["ledger_label"] = e.get("label")
    return row


def logged_votes(artifacts: str | os.PathLike[str], round_index: int) -> dict[str, list[dict[str, str]]]:
    """sample_id → every raw vote on it up to `round_index` (the vote log beside the ledger: each annotator's answer,
    outvoted ones and votes a later consensus settled included), oldest first. A file imported twice counts once."""
    from pipeline.annotation.consensus import votes_path
    from pipeline.store import read_jsonl

    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in read_jsonl(votes_path(artifacts)):
        if "sample_id" in r and int(r.get("round", 0)) <= round_index:
            seen.setdefault((r.get("source_digest"), r["sample_id"], r.get("annotator"), r.get("label")), r)
    out: dict[str, list[dict[str, str]]] = {}
    for r in seen.values():
        out.setdefault(str(r["sample_id"]), []).append({"annotator": str(r["annotator"]), "label": str(r["label"])})
    return out


def entry_votes(e: Mapping[str, Any]) -> list[dict[str, str]]:
    """A ledger entry's votes, for a label the vote log does not know (an older project, a simulated annotator):
    the votes it recorded, else its one annotator. Never its `annotator` field split on commas: that field joins
    the names of the winning side only, and a name may hold a comma."""
    if e.get("votes"):
        return [{"annotator": str(v["annotator"]), "label": str(v["label"])} for v in e["votes"]]
    return [{"annotator": str(e["annotator"]), "label": str(e["label"])}] if e.get("annotator") else []


def annotators(labels: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every person who voted on a training label, once each, outvoted ones included (the model as a consensus
    rater is not a person)."""
    from pipeline.annotation.consensus import MODEL_RATER

    return sorted({v["annotator"] for r in labels for v in r.get("votes", ()) if v["annotator"] != MODEL_RATER})


def shareable_path(path: str | os.PathLike[str] | None, artifacts: str | os.PathLike[str]) -> str | None:
    """A project path as an export may name it: relative to the artifacts folder when inside it, else only its
    file name (an absolute path tells whoever receives the export the user's name and the host's layout)."""
    if path is None:
        return None
    p, art = Path(path), Path(artifacts)
    for root in (art, art.resolve()):
        if p.is_relative_to(root):
            return p.relative_to(root).as_posix()
    return p.name


def provenance(artifacts: str | os.PathLike[str], round_index: int | None) -> Provenance:
    from pipeline.store import read_manifest

    state = trained_round(artifacts, round_index)
    return Provenance(state.round, state, read_manifest(state.adapter["dir"]),
                      training_labels(artifacts, state), Path(artifacts))


def lineage(prov: Provenance, *, model: Mapping[str, Any], train: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """lineage.json: which labels (ledger entry ids, their files' digests) and which config made the adapter."""
    from pipeline.store import digest_json

    ref, m = prov.state.adapter, prov.train_manifest
    return {
        "round": prov.round,
        "adapter": {"digest": ref.get("adapter_digest"), "train_key": ref.get("digest"),
                    "train_dir": shareable_path(ref.get("dir"), prov.artifacts),
                    "stage_version": m.stage_version, "inputs": dict(m.inputs)},
        "config_digest": digest_json({"model": dict(model), "train": dict(train), "seed": seed}),
        "train_config_digest": m.config_digest,
        "labeled_digest": prov.state.labeled_digest,
        "counts": {"labels": len(prov.labels), "from_ledger": sum(r["source"] == "ledger" for r in prov.labels),
                   "seed": sum(r["source"] == "seed" for r in prov.labels)},
        "labels": prov.labels,
    }
