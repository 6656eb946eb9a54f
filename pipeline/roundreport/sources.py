"""Where a round's report reads from: the folders of the stages that made the round, resolved once when the round
ends and kept beside it (report_sources.json), so `tamis report --round N` rebuilds the same report after new images
changed the prepared dataset's digest (and with it the folder every later stage is keyed by)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.config import DataConfig, ModelConfig, ProjectConfig, SelectConfig
from pipeline.errors import ArtifactError
from pipeline.round_state import RoundState, adapter_ref, round_dir
from pipeline.stage_ref import PreparedRefs
from pipeline.store import MANIFEST_NAME, atomic_write_json

if TYPE_CHECKING:  # the annotation only: the report reads the space's folder, not the embeddings code
    from pipeline.embeddings import EmbeddingsParams

SOURCES_FILE = "report_sources.json"
_PREPARE = "`tamis prepare -c <your config>` (the same images and config write the same folder)"
_ROUND = "`tamis round --full -c <your config>` (it replays the latest round, writing again what is gone)"
# The stage folders a report reads (score shards aside: a missing one only leaves its samples' answers out), what
# each holds and what writes it again.
RECORDED = (("prepared_dir", "the prepared images (prepare stage)", _PREPARE),
            ("quality_dir", "the quality flags (quality stage)", _PREPARE),
            ("space_dir", "the selection embeddings (embeddings stage)", _ROUND),
            ("eval_dir", "the evaluation (evaluate stage)", _ROUND),
            ("labelcheck_dir", "the label check (labelcheck stage)", _ROUND))


@dataclass(frozen=True)
class ReportSources:
    """The files one round's report reads; None (or empty) where the round has no such stage output."""

    round: int
    round_dir: str
    artifacts: str
    answers: list[str] | None  # the closed answer set (data.answers), None for open answers
    seed: int
    prepared_dir: str | None = None  # the prepare stage: images by sample ID
    quality_dir: str | None = None  # the quality stage: flags and their counts
    space_dir: str | None = None  # the selection-embeddings stage; None when selection reads the model's embeddings
    space_source: str = "model"  # select.embeddings.source
    shards: list[tuple[str, str]] = field(default_factory=list)  # (first sample ID, folder) of each score shard
    eval_dir: str | None = None  # the evaluate stage of the round's adapter
    labelcheck_dir: str | None = None
    box_codec: str | None = None  # a box project's family codec (Family.box_codec): its answers are drawn as boxes

    def save(self) -> Path:
        return atomic_write_json(Path(self.round_dir) / SOURCES_FILE, asdict(self))

    @classmethod
    def load(cls, round_dir: str | os.PathLike[str]) -> ReportSources:
        path = Path(round_dir) / SOURCES_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ArtifactError(f"{path}: cannot read the report's sources ({exc}); delete it and run `tamis report "
                                "--round N` again to resolve them from the project's config") from exc
        data["shards"] = [tuple(s) for s in data.get("shards", [])]
        return cls(**data)


@dataclass(frozen=True)
class SelectionInputs:
    """The stage folders a round's select stage read, as its report reads them: the selection embeddings' (None: the
    model's own embeddings, or no selection) and each score shard's (first sample ID, folder)."""

    space_dir: str | None = None
    shards: list[tuple[str, str]] = field(default_factory=list)


def stopped_round_inputs(space: EmbeddingsParams | None) -> SelectionInputs:
    """What a round that selects nothing hands its report: no score shards, and the selection space earlier rounds
    made from the same prepared pool (`space`: its stage parameters; its folder when there is one), so the last round
    still draws its pool map."""
    return SelectionInputs(space.out_dir if space is not None and Path(space.out_dir).is_dir() else None)


def check_sources(sources: ReportSources, recorded_in: str) -> None:
    """Refuse, naming each path and what rebuilds it, a report whose stage folders were recorded (so their stages
    ran) but are gone now: "has not finished here" would send the user to run a stage that did finish."""
    gone = [(what, folder, fix) for field_name, what, fix in RECORDED
            if (folder := getattr(sources, field_name)) and not (Path(folder) / MANIFEST_NAME).is_file()]
    if not gone:
        return
    lines = [f"round {sources.round}'s report reads stage outputs that are gone: their stages ran (recorded in "
             f"{recorded_in}), their output was deleted since:"]
    lines += [f"  - {what}: {folder} " + ("has lost its manifest.json (partly deleted)" if Path(folder).exists()
                                          else "is gone") for what, folder, _ in gone]
    lines += [f"to rebuild {', '.join(w.split(' (')[0] for w, _, f in gone if f == fix)}: {fix}"
              for fix in dict.fromkeys(f for _, _, f in gone)]
    lines.append(f"then `tamis report --round {sources.round}` again; if the data changed since, delete "
                 f"{Path(sources.round_dir) / SOURCES_FILE} and the report is drawn from the project's current data")
    raise ArtifactError("\n".join(lines))


def find_eval_dir(artifacts: str | os.PathLike[str], adapter_digest: str) -> str | None:
    """The evaluate stage folder of an adapter (its manifest's `adapter` input), newest first: one folder per trained
    round and test set, so a scan of their manifests costs nothing."""
    found = []
    for m in Path(artifacts, "eval").glob("*/manifest.json"):
        try:
            data = json.loads(m.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if data.get("stage") == "evaluate" and data.get("inputs", {}).get("adapter") == adapter_digest:
            found.append((m.stat().st_mtime, str(m.parent)))
    return max(found)[1] if found else None


def resolve_sources(cfg: ProjectConfig, state: RoundState, prepared: PreparedRefs | None) -> ReportSources:
    """The report's sources for a finished round (`state`, its round.json) of the project `cfg`, for `tamis report`
    when the round kept none: the embeddings and score stages' keys are re-derived from the project; `prepared`: the
    round's prepare and quality stage refs (as flows/prepare returns them; PreparedRefs.of the latest ones on disk).

    The score shards are those the round's select stage read: its pool.jsonl planned by
    pipeline.score_stage.plan_pool_scoring as flows/select.score_pool plans it (same adapter, prepared data, model
    identity and shard size), so every folder is one the score stage wrote. A round in progress knows both and
    calls round_sources."""
    from pipeline.embeddings import embeddings_params
    from pipeline.score_stage import POOL_FILE, plan_pool_scoring, read_pool_file

    rd = round_dir(cfg.artifacts, state.round)
    prep = prepared.prepare if prepared is not None else None
    space = embeddings_params(cfg, prep) if prep else None
    shards: list[tuple[str, str]] = []
    if prep is not None and (rd / POOL_FILE).is_file():
        plan = plan_pool_scoring(cfg, prepared=prep, adapter=adapter_ref(state.adapter),
                                 pool_ids=read_pool_file(rd / POOL_FILE))
        shards = [(p.shard_ids[0], p.out_dir) for p in plan.shards]
    return round_sources(cfg.data, cfg.model, cfg.select, state, prepared, rd,
                         SelectionInputs(space and space.out_dir, shards), artifacts=cfg.artifacts, seed=cfg.seed)


def round_sources(data: DataConfig, model: ModelConfig, select: SelectConfig, state: RoundState,
                  prepared: PreparedRefs | None, rd: Path, selected: SelectionInputs, *,
                  artifacts: str | os.PathLike[str], seed: int) -> ReportSources:
    """The report's sources of the round in folder `rd` from the stage folders the round read: its prepare and quality
    refs (`prepared`, as flows/prepare returns them; None: no prepared data) and what its select stage read (`selected`)."""
    adapter = state.adapter
    eval_dir = state.eval_dir or (adapter and find_eval_dir(artifacts, adapter["adapter_digest"]))
    return ReportSources(
        round=state.round, round_dir=str(rd), artifacts=str(artifacts), answers=data.scored_answers,
        seed=seed, prepared_dir=prepared and prepared.prepare.dir, quality_dir=prepared and prepared.quality.dir,
        space_dir=selected.space_dir, space_source=select.embeddings.source,
        shards=selected.shards, eval_dir=eval_dir,
        labelcheck_dir=(state.labelcheck or {}).get("dir"), box_codec=_box_codec(data, model))


def _box_codec(data: DataConfig, model: ModelConfig) -> str | None:
    """The family's box codec of a box project (data.task: boxes); None for one-answer projects."""
    if data.task != "boxes":
        return None
    from pipeline.model.loading import resolve_family

    return resolve_family(model).box_codec
