"""The round's decisions: which round this is, which labels it trains on, its warm start, which samples it may
select, when to stop, and what it leaves behind (summary.md, then round.json last).

Plain functions of the project's files and config, unit-tested without a Prefect server; flows/round.py only
orders them around the cached stages.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config import (
    AnnotateConfig,
    LabelCheckConfig,
    ModelConfig,
    ProjectConfig,
    RoundsConfig,
    SelectConfig,
    TrainConfig,
)
from pipeline.errors import DataError
from pipeline.idindex import IdIndex
from pipeline.round_state import ROUNDS_DIR, RoundState, round_dir
from pipeline.store import (
    arrow_column,
    atomic_dir,
    atomic_write_json,
    atomic_write_text,
    digest_json,
    save_dataset,
)

if TYPE_CHECKING:  # the stages' modules import torch: a round's plan is read without it
    from pipeline.evaluate import EvalParams
    from pipeline.model.train_stage import TrainParams

ROUND_FILE = "round.json"
SUMMARY_FILE = "summary.md"  # the round-summary artifact, also readable without the Prefect UI


def completed_rounds(artifacts: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """States of finished rounds (round.json is written last), in round order."""
    rounds = Path(artifacts) / ROUNDS_DIR
    states = []
    for p in sorted(rounds.glob(f"[0-9][0-9][0-9]/{ROUND_FILE}")) if rounds.is_dir() else []:
        try:
            states.append(json.loads(p.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue  # an unreadable state is an unfinished round: it will be run again
    return sorted(states, key=lambda s: s["round"])


def completed_states(artifacts: str | os.PathLike[str]) -> list[RoundState]:
    """completed_rounds, each read as a RoundState (what the report, the CLI and the UI read)."""
    return [RoundState.from_json(s) for s in completed_rounds(artifacts)]


def next_round_index(artifacts: str | os.PathLike[str], labeled_digest: str | None) -> int:
    """The last round again when the labeled set is unchanged (a re-run), else the round after it."""
    done = completed_rounds(artifacts)
    if not done:
        return 0
    last = done[-1]
    return last["round"] if labeled_digest is not None and last.get("labeled_digest") == labeled_digest else last["round"] + 1


def import_round(artifacts: str | os.PathLike[str]) -> int:
    """The round labels imported now belong to, the same for the inbox and `tamis labels import`: the next round,
    the first whose labeled set holds them (0 before any round finished)."""
    return next_round_index(artifacts, None)


def exported_before(artifacts: str | os.PathLike[str], round_index: int) -> set[str]:
    """Samples sent to annotators in rounds before `round_index` (exported but maybe not labeled yet)."""
    from pipeline.annotation.export import exported_sample_ids

    return exported_sample_ids(artifacts, before_round=round_index)


def still_out(artifacts: str | os.PathLike[str], plan: RoundPlan) -> set[str]:
    """Samples exported in earlier rounds and still with the annotators: not labeled, and not given back by a
    rejected label row since their last export (pipeline/annotation/rejections.py): those return to the pool."""
    from pipeline.annotation.export import exported_sample_ids
    from pipeline.annotation.rejections import rejected_samples

    out = exported_before(artifacts, plan.index) - set(plan.labels)
    since: dict[int, set[str]] = {}
    for sid, r in rejected_samples(artifacts).items():
        if sid in out:
            since.setdefault(r, set()).add(sid)
    for r, sids in since.items():  # rejected at the import of round r: exported again in round r or later → out
        out -= sids - exported_sample_ids(artifacts, since_round=r, before_round=plan.index)
    return out


def save_labeled_set(prepared: Any, labels: Mapping[str, str], out_dir: str | os.PathLike[str], *,
                     digest: str) -> dict[str, str]:
    """The labeled training set: prepared rows of the labeled samples with their current label as the answer.

    Saved as a dataset (what augmentation and training read); returns {"dataset": path, "digest": digest}. The
    folder is rebuilt only when its recorded digest differs, so a re-run leaves it alone.
    """
    return save_rows(prepared, sorted(labels), out_dir, digest=digest,
                     update=lambda sid: {"answer": labels[sid], "split": "train"})


def save_rows(prepared: Any, ids: Sequence[str], out_dir: str | os.PathLike[str], *, digest: str,
              update: Any = None) -> dict[str, str]:
    """Prepared rows of `ids` (each changed by `update(sample_id)` when given) saved as a dataset in
    out_dir/dataset, rebuilt only when out_dir/digest.txt differs from `digest`: {"dataset": path, "digest"}."""
    out_dir = Path(out_dir)
    stamp = out_dir / "digest.txt"
    if stamp.is_file() and stamp.read_text(encoding="utf-8") == digest:
        return {"dataset": str(out_dir / "dataset"), "digest": digest}
    wanted = sorted(ids)
    at = IdIndex.of_dataset(prepared).rows(wanted)
    missing = [s for s, i in zip(wanted, at, strict=True) if i < 0]
    if missing:
        raise DataError(f"{len(missing)} labeled samples are not in the prepared dataset (first: {missing[0]}); "
                        "were they labeled for another dataset?")
    sub = prepared.select(sorted(at.tolist()))
    if update is not None:
        # keep_in_memory: a cache file would land inside the prepare stage's folder and break its digest.
        sub = sub.map(update, input_columns=["sample_id"], keep_in_memory=True)
    with atomic_dir(out_dir / "dataset") as tmp:
        save_dataset(sub, tmp)
    atomic_write_text(stamp, digest)
    return {"dataset": str(out_dir / "dataset"), "digest": digest}


def main_metric(answers: Sequence[str] | None) -> str:
    """The metric the rounds are judged by: accuracy on a closed answer set (data.answers), token F1 on open answers."""
    return "accuracy" if answers else "token_f1"


def stop_reason(rc: RoundsConfig, round_index: int, n_labels: int, metrics: Sequence[Mapping[str, Any]],
                pool_left: int, stability: Mapping[str, Any] | None = None, *, main: str = "accuracy",
                hours: float = 0.0, outstanding: int = 0) -> str | None:
    """Why no further batch should be selected, or None: the first rule of `rc` (the rounds section) that says stop.
    `main`: the metric the curve is read in (main_metric); `stability`: the stop set's agreement (pipeline.stopping);
    `hours`: annotator hours recorded so far (recorded_hours); `outstanding`: tasks exported earlier and still with
    the annotators, which the label budget has already promised."""
    from pipeline.stopping import converged_reason, stable_reason

    curve = [m["value"] for m in sorted(metrics, key=lambda m: m["round"]) if m["metric"] == main]
    reasons = (  # in the order they are reported: the first that applies is the round's
        _last_round(rc, round_index),
        _label_budget(rc, n_labels, outstanding),
        _hours_budget(rc, hours),
        _target(rc, main, curve),
        _plateau(rc, main, curve),
        stable_reason(stability, rc.stop_when_stable),
        converged_reason(stability, rc.stop_when_converged),
        _pool_empty(pool_left),
    )
    return next((why for why in reasons if why is not None), None)


def _last_round(rc: RoundsConfig, round_index: int) -> str | None:
    if round_index + 1 < rc.max_rounds:
        return None
    # max_rounds counts every round, round 0 included (RoundsConfig.max_rounds says so, as docs/rounds.md).
    return (f"rounds.max_rounds = {rc.max_rounds}: round {round_index} is the last (0–{rc.max_rounds - 1}); "
            "trained, selects nothing")


def _label_budget(rc: RoundsConfig, n_labels: int, outstanding: int) -> str | None:
    if rc.label_budget is None or n_labels + outstanding < rc.label_budget:
        return None
    out = f" + {outstanding} tasks still with the annotators" if outstanding else ""
    return f"label budget spent: {n_labels} labels{out} ≥ rounds.label_budget = {rc.label_budget}"


def _hours_budget(rc: RoundsConfig, hours: float) -> str | None:
    if rc.budget_hours is None or hours < rc.budget_hours:
        return None
    return f"hours budget spent: {hours:.2f} annotator-hours recorded ≥ rounds.budget_hours = {rc.budget_hours}"


def _target(rc: RoundsConfig, main: str, curve: Sequence[float]) -> str | None:
    if rc.target_metric is None or not curve or curve[-1] < rc.target_metric:
        return None
    return f"target reached: {main} = {curve[-1]:.4f} ≥ rounds.target_metric = {rc.target_metric}"


def _plateau(rc: RoundsConfig, main: str, curve: Sequence[float]) -> str | None:
    n = rc.plateau_rounds
    if n is None or len(curve) <= n or max(curve[-n:]) > max(curve[:-n]) + 0.005:
        return None
    return f"plateau: {main} has not improved by 0.005 over the last {n} rounds"


def _pool_empty(pool_left: int) -> str | None:
    return "pool exhausted: no unlabeled samples left to select" if pool_left == 0 else None


def close_round(cfg: ProjectConfig, plan: RoundPlan, state: RoundState, *, pool_left: int,
                agreed: Mapping[str, Any]) -> None:
    """The round's counts once its pool is known (eligible samples, labels spent, tasks still out, the consensus
    `agreed`), then whether it stops (stop_reason, on every rule of the rounds section) and whether its model is
    still at chance (pipeline.chance)."""
    from pipeline.chance import chance_check
    from pipeline.labelcheck import labels_spent
    from pipeline.metrics import read_metrics

    art, rc = cfg.artifacts, cfg.rounds
    state.update(agreed)
    state.pool, state.tasks_out = pool_left, outstanding_tasks(art, plan)  # tasks: exported earlier, not labeled yet
    state.labels_spent = labels_spent(len(plan.labels), art, before_round=plan.index)
    rows = read_metrics(art)
    state.stopped = stop_reason(rc, plan.index, state.labels_spent, rows, pool_left, state.stability,
                                main=main_metric(cfg.data.answers), outstanding=state.tasks_out,
                                hours=recorded_hours(art) if rc.budget_hours is not None else 0.0)
    state.at_chance = chance_check(rows, cfg.data.answers, train=cfg.train, model=cfg.model,
                                   up_to_round=plan.index).warning


def budget_batch(rounds_cfg: RoundsConfig, batch_size: int, spent: int, outstanding: int = 0) -> int:
    """The round's batch size: select.batch_size, cut to what rounds.label_budget has left after the labels spent
    and the tasks still with the annotators (a budget is a cap: 90 with batches of 40 gives 40, 40, then 10)."""
    if rounds_cfg.label_budget is None:
        return batch_size
    return max(0, min(batch_size, rounds_cfg.label_budget - spent - outstanding))


def batch_for(rounds_cfg: RoundsConfig, batch_size: int, state: RoundState) -> int:
    """budget_batch for the round `state` once close_round counted its labels spent and tasks out."""
    return budget_batch(rounds_cfg, batch_size, state.labels_spent or 0, state.tasks_out)


def budget_left(rounds_cfg: RoundsConfig, state: RoundState | Mapping[str, Any]) -> int | None:
    """What rounds.label_budget leaves after this round's batch (`state`: labels_spent, tasks_out, selected), for
    the re-label queue sent with it; None without a budget."""
    if rounds_cfg.label_budget is None:
        return None
    s = RoundState.of(state)
    return budget_batch(rounds_cfg, rounds_cfg.label_budget, (s.labels_spent or 0) + s.selected_count, s.tasks_out)


def redundancy_cap(rounds_cfg: RoundsConfig, state: RoundState) -> int | None:
    """The labels rounds.label_budget leaves for the redundancy queue (each second opinion costs one): what the batch
    left (budget_left) less the re-label tasks sent with it; None without a budget."""
    left = budget_left(rounds_cfg, state)
    return None if left is None else max(0, left - (state.relabel or 0))


def outstanding_tasks(artifacts: str | os.PathLike[str], plan: RoundPlan) -> int:
    """Samples exported in earlier rounds and still out (still_out): the label budget has promised them already."""
    return len(still_out(artifacts, plan))


def recorded_hours(artifacts: str | os.PathLike[str]) -> float:
    """Annotator-hours recorded in the ledger's times (every timed annotation, re-labels included)."""
    from pipeline.annotation.ledger import Ledger, ledger_path

    return sum(float(r["seconds"]) for r in Ledger(ledger_path(artifacts)).times()) / 3600


def simulated(rounds_cfg: RoundsConfig, simulate: bool | None) -> bool:
    """Whether the simulated annotator answers this round's export: `--simulate/--no-simulate` when given, else
    rounds.simulate_annotator."""
    return rounds_cfg.simulate_annotator if simulate is None else simulate


def should_wait(rounds_cfg: RoundsConfig, state: RoundState | Mapping[str, Any], *, deployed: bool) -> bool:
    """Whether a finished round waits for its annotators: rounds.wait_for_labels, a batch was exported, and the run
    can be suspended and resumed later (only a deployment's run can: its worker starts it again)."""
    s = RoundState.of(state)
    return bool(rounds_cfg.wait_for_labels and deployed and s.export_dir and not s.stopped)




# ---------------------------------------------------------------------------------------------- the plan
@dataclass
class PoolData:
    """The prepared dataset's columns a round decides on (IDs, splits, seed answers, as Arrow holds them: no Python
    object per row of a 10⁶-image pool) and its label-matching index."""

    ids: Any  # pyarrow arrays, row-aligned
    splits: Any
    answers: Any
    index: Any  # pipeline.annotation.labels.SampleIndex: matches labels by ID, the user's own ID or image path

    @classmethod
    def of(cls, prepared: Any) -> PoolData:
        from pipeline.annotation.labels import SampleIndex

        return cls(*(arrow_column(prepared, c) for c in ("sample_id", "split", "answer")),
                   index=SampleIndex.from_dataset(prepared))

    def __len__(self) -> int:
        return len(self.ids)

    def _where(self, split: str, *, answered: bool = False) -> Any:
        import pyarrow.compute as pc

        mask = pc.equal(self.splits, split)
        return pc.and_(mask, pc.is_valid(self.answers)) if answered else mask

    def pool_ids(self, exclude: Collection[str] = ()) -> list[str]:
        """Rows of the pool split, dataset order, without `exclude`."""
        import pyarrow as pa
        import pyarrow.compute as pc

        mask = self._where("pool")
        if exclude:
            mask = pc.and_(mask, pc.invert(pc.is_in(self.ids, value_set=pa.array(sorted(exclude), pa.string()))))
        return pc.filter(self.ids, mask).to_pylist()

    def _pairs(self, split: str) -> list[tuple[str, str]]:
        import pyarrow.compute as pc

        mask = self._where(split, answered=True)
        return list(zip(pc.filter(self.ids, mask).to_pylist(), pc.filter(self.answers, mask).to_pylist(),
                        strict=True))

    def stop_set(self, size: int, seed: int) -> list[str]:
        """The rounds' stop set (rounds.stop_set): pool samples no round selects, predicted by every adapter."""
        from pipeline.stopping import stop_set

        return stop_set(self.pool_ids(), size, seed) if size > 0 else []

    def check_evaluable(self) -> None:
        """A round that trains evaluates its adapter on the labeled test split: refuse before training without one."""
        if not self._pairs("test"):
            raise DataError(
                f"no labeled test rows among the {len(self)} ingested samples: every round evaluates its adapter "
                "on rows with split 'test' and an answer. Add a source of held-out labeled images with `split: test` "
                "(e.g. a JSONL manifest with image, answer and split per row) to data.sources")

    def test_rows(self) -> list[tuple[str, str]]:
        """(sample ID, answer) of the labeled test split every round evaluates on, in dataset order."""
        return self._pairs("test")

    def seed_labels(self) -> dict[str, str]:
        """Answers the data came with on its train split: labels before any annotator."""
        return dict(self._pairs("train"))


def round_labels(pool: PoolData, ledger_labels: Mapping[str, str]) -> dict[str, str]:
    """The labels a round trains on: the seed labels, overridden by the ledger's labels of this dataset's samples."""
    ids = list(ledger_labels)
    known = pool.index.knows(ids)
    return {**pool.seed_labels(), **{s: ledger_labels[s] for s, k in zip(ids, known, strict=True) if k}}


def labels_now(artifacts: str | os.PathLike[str], prepared_dir: str | os.PathLike[str], pool: PoolData, *,
               round_index: int) -> dict[str, str]:
    """The round's labels once labels have followed their re-saved or moved images to their new sample IDs
    (pipeline/annotation/carry.py: a carry entry each, logged)."""
    from pipeline.annotation.carry import follow_images

    return round_labels(pool, follow_images(artifacts, prepared_dir, pool.index, round_index=round_index))


@dataclass
class RoundPlan:
    """Which round this run is, with what labels, and what came before it."""

    index: int
    dir: Path
    labels: dict[str, str]
    labeled_digest: str
    rerun: dict[str, Any] | None  # the finished round this run repeats (its labeled set is unchanged)
    previous: list[dict[str, Any]]  # finished rounds before this one, oldest first

    def warm_start(self, init: str) -> dict[str, Any] | None:
        """The adapter training starts from: the last earlier round's with train.init = warm, never this round's
        own (on a re-run of round r, round r's adapter would be its own warm start)."""
        return self.previous[-1].get("adapter") if self.previous and init == "warm" else None

    @property
    def last(self) -> dict[str, Any] | None:
        """The finished round before this one (its round.json object), None for the first."""
        return self.previous[-1] if self.previous else None

    def history_dirs(self, artifacts: str | os.PathLike[str]) -> list[Path]:
        return [round_dir(artifacts, p["round"]) for p in self.previous]

    def state(self, imports: list[dict[str, Any]], **fields: Any) -> RoundState:
        """The round's state as round.json records it, before any stage ran (`fields`: what the caller knows)."""
        from pipeline.report import import_record

        return RoundState(round=self.index, labeled=len(self.labels), labeled_digest=self.labeled_digest,
                          imports=import_record(self.rerun, imports), **fields)


def plan_round(artifacts: str | os.PathLike[str], labels: dict[str, str]) -> RoundPlan:
    """The round for this labeled set: the last one again when it is unchanged (a re-run), else the next."""
    digest = digest_json(sorted(labels.items()))
    r = next_round_index(artifacts, digest)
    done = completed_rounds(artifacts)
    return RoundPlan(index=r, dir=round_dir(artifacts, r), labels=labels, labeled_digest=digest,
                     rerun=next((s for s in done if s["round"] == r), None),
                     previous=[s for s in done if s["round"] < r])


def labeled_set(prepared_ref: Mapping[str, Any], plan: RoundPlan) -> dict[str, str]:
    """The round's labeled training set on disk (round_dir/labeled/), keyed by its content: the labels (sample IDs,
    which are content digests, and answers) and how the rows were prepared (the prepare stage's code version and
    config), not the whole prepared pool's digest, so new pool images leave the training set and its adapter alone."""
    from pipeline.preprocess import load_prepared
    from pipeline.store import read_manifest

    m = read_manifest(Path(prepared_ref["dir"]))
    return save_labeled_set(load_prepared(prepared_ref["dir"]), plan.labels, plan.dir / "labeled",
                            digest=digest_json([m.stage_version, m.config_digest, plan.labeled_digest]))


def train_params(plan: RoundPlan, *, artifacts: str | os.PathLike[str], model: ModelConfig, train: TrainConfig,
                 seed: int, labeled: dict[str, Any], augmented: dict[str, Any] | None) -> TrainParams:
    """The train stage's parameters (its cache key) and output folder for this round: the labeled set's content,
    never the pool's (labeled_set)."""
    from pipeline.model.identity import keyed_model
    from pipeline.model.train_stage import TrainParams

    init = plan.warm_start(train.init)
    # The model's content and library versions too: new weights at the same path retrain (pipeline/model/identity.py).
    sections = {"model": keyed_model(model, artifacts), "train": train.model_dump(mode="json")}
    key = digest_json({"labeled": labeled["digest"], **sections, "aug": augmented and augmented["digest"],
                       "init": init and init["adapter_digest"], "seed": seed})
    return TrainParams(artifacts=str(artifacts), labeled=labeled, augmented=augmented, seed=seed,
                       init_adapter=init, out_dir=str(Path(artifacts) / "train" / key[:16]), **sections)


def test_set(artifacts: str | os.PathLike[str], prepared_ref: Mapping[str, Any], pool: PoolData) -> dict[str, str]:
    """The labeled test split on disk (artifacts/eval/test/<digest>/), keyed like the labeled set by its rows (IDs
    and answers) and how they were prepared, so new pool images leave the evaluation of an adapter alone."""
    from pipeline.preprocess import load_prepared
    from pipeline.store import read_manifest

    m = read_manifest(Path(prepared_ref["dir"]))
    rows = pool.test_rows()
    digest = digest_json([m.stage_version, m.config_digest, rows])
    return save_rows(load_prepared(prepared_ref["dir"]), [s for s, _ in rows],
                     Path(artifacts) / "eval" / "test" / digest[:16], digest=digest)


def evaluate_params(*, artifacts: str | os.PathLike[str], model: ModelConfig, answers: Sequence[str] | None,
                    batch_size: int, test: dict[str, str], adapter: dict[str, Any]) -> EvalParams:
    """The evaluate stage's parameters (its cache key) and output folder for a trained adapter on the test set
    (`batch_size`: select.score_batch_size, the scoring batch)."""
    from pipeline.evaluate import EvalParams
    from pipeline.model.identity import keyed_model

    key = digest_json({"test": test["digest"], "adapter": adapter["adapter_digest"]})
    return EvalParams(artifacts=str(artifacts), test=test, adapter=adapter, model=keyed_model(model, artifacts),
                      answers=None if answers is None else list(answers), batch_size=batch_size,
                      out_dir=str(Path(artifacts) / "eval" / key[:16]))


def round_strategy(select: SelectConfig, *, cold: bool, phase: Mapping[str, str] | None = None) -> str:
    """How the round's batch is chosen (pipeline.strategies.schedule.strategy_label), from the select section and
    the round's phase (selection.round_phase_of)."""
    from pipeline.strategies.schedule import strategy_label

    return strategy_label(select.cold_start, select.strategy, select.diversity, cold=cold, phase=phase)


def eligible_pool(artifacts: str | os.PathLike[str], pool: PoolData, plan: RoundPlan,
                  quality_excluded: set[str], *, stop: Sequence[str] = ()) -> tuple[list[str], set[str]]:
    """(pool samples the round may select, every ID it must not): labeled, flagged by quality, exported in an
    earlier round and still with the annotators (still_out), or in the stop set."""
    exclude = set(plan.labels) | quality_excluded | still_out(artifacts, plan) | set(stop)
    return pool.pool_ids(exclude), exclude


# --------------------------------------------------------------------------------------------- the end
def write_round(plan: RoundPlan, state: RoundState | Mapping[str, Any], summary: str) -> None:
    """summary.md, then round.json last: round.json is what marks the round finished."""
    atomic_write_text(plan.dir / SUMMARY_FILE, summary + "\n")
    atomic_write_json(plan.dir / ROUND_FILE, RoundState.of(state).to_json())


def answer_round(artifacts: str | os.PathLike[str], state: RoundState | Mapping[str, Any], *, ground_truth: Any,
                 noise: float, seed: int, crowd: RoundsConfig | None = None) -> None:
    """The simulated annotator answers a finished round's export (and its re-label queue) into the inbox; with a
    crowd (the rounds section's simulate_annotators, read from `crowd`) the crowd does, rounds.simulate_redundancy
    of them per sample, and it also answers the redundancy queue, each sample by someone who has not labeled it.

    Only a finished round is answered: with its labels in the inbox before round.json, a crash in between made the
    re-run import them into this round (a cold-start round trained, its export replaced, rounds renumbered).
    """
    from pipeline.annotation.inbox import inbox_dir
    from pipeline.annotation.simulate import simulate_annotator, simulate_annotators

    s = RoundState.of(state)
    if not s.export_dir:
        return
    annotators = getattr(crowd, "simulate_annotators", None)
    if annotators:
        from pipeline.annotation.consensus import read_votes

        simulate_annotators(s.export_dir, ground_truth, inbox_dir(artifacts), annotators=annotators,
                            round_index=s.round, redundancy=crowd.simulate_redundancy, seed=seed)
        if s.consensus_dir:
            voted = {sid: {v.annotator for v in vs} for sid, vs in read_votes(artifacts).items()}
            simulate_annotators(s.consensus_dir, ground_truth, inbox_dir(artifacts), annotators=annotators,
                                round_index=s.round, seed=seed, kind="consensus", exclude=voted)
    else:
        simulate_annotator(s.export_dir, ground_truth, inbox_dir(artifacts), round_index=s.round, noise=noise,
                           seed=seed)
    if s.relabel_dir:
        # The reviewer of likely errors is careful: answers from the ground truth, never flipped.
        simulate_annotator(s.relabel_dir, ground_truth, inbox_dir(artifacts), round_index=s.round, seed=seed,
                           annotator="simulated-reviewer", kind="relabel")


def record_selection(state: RoundState, sel: Mapping[str, Any], exp: Mapping[str, Any]) -> None:
    """The round state's fields from its select and export references: what the summary, `tamis status` and the
    waiting form read (a phase's label replaces the configured strategy's)."""
    from pipeline.strategies.schedule import phase_label

    if "label_studio" in exp:
        state.label_studio = exp["label_studio"]
    state.selected, state.export_dir, state.selection_dir = sel["n"], exp["dir"], sel["dir"]
    state.outliers, state.phase, state.embeddings = sel.get("outliers"), sel.get("phase"), sel.get("embeddings")
    state.cost = sel.get("cost")
    if sel.get("round_strategy"):  # the select stage's own name for it (the same strategy_label)
        state.strategy = sel["round_strategy"]
    elif sel.get("phase"):
        state.strategy = phase_label(sel["phase"])
    if sel.get("candidates"):
        state.candidates = sel["candidates"]


def relabels(labelcheck: LabelCheckConfig, check: Mapping[str, Any] | None) -> bool:
    """Whether the round queues its likely label errors for re-labeling: a label check ran, labelcheck.relabel_top_n."""
    return check is not None and bool(labelcheck.relabel_top_n)


def record_relabel(annotate: AnnotateConfig, artifacts: str | os.PathLike[str], state: RoundState,
                   rel: Mapping[str, Any]) -> None:
    """The re-label queue in the round's state ({"count", "dir"} from flows/labelcheck.relabel_ref), pushed to
    annotate.label_studio beside the batch when one is configured."""
    state.relabel = rel["count"]
    if not rel["count"]:
        return
    state.relabel_dir = rel["dir"]
    if annotate.label_studio is not None:
        from pipeline.annotation.label_studio import push_batch

        state.label_studio_relabel = push_batch(annotate, artifacts, rel["dir"])


def record_evaluation(artifacts: str | os.PathLike[str], plan: RoundPlan, state: RoundState,
                      ev: Mapping[str, Any]) -> None:
    """The adapter's test metrics and evaluation folder in the state, and booked on the learning curve."""
    from pipeline.metrics import book_metrics

    state.metrics, state.eval_dir = ev["metrics"], ev["dir"]
    book_metrics(artifacts, round_index=plan.index, labels=len(plan.labels), metrics=ev["metrics"],
                 strategy=state.strategy, intervals=ev.get("intervals"))


LABEL_CHECK_KEYS = ("dir", "method", "checked", "issues", "abstained", "oos_accuracy", "expected_false_alarms",
                    "message")  # what round.json keeps of the label check's reference


def label_check_record(check: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The label check's summary as round.json keeps it (LABEL_CHECK_KEYS); None when no check ran."""
    return None if check is None else {k: check.get(k) for k in LABEL_CHECK_KEYS}


@dataclass(frozen=True)
class StopSetCheck:
    """The stop set a round scores with its adapter (rounds.stop_set) and what its agreement is measured against."""

    ids: list[str]
    round_dir: Path
    out_dir: Path  # the round's stop-set scores (round_dir/stopset)
    previous_dir: Path | None  # the previous round's folder (its adapter's answers); None in the first
    target: float  # the agreement rounds.stop_when_stable asks for


def stop_set_check(rc: RoundsConfig, plan: RoundPlan, pool: PoolData, *, seed: int,
                   artifacts: str | os.PathLike[str]) -> StopSetCheck | None:
    """The round's stop-set measurement, or None without rounds.stop_set."""
    from pipeline.stopping import STOPSET

    if not rc.stop_set:
        return None
    rule = rc.stop_when_stable
    return StopSetCheck(pool.stop_set(rc.stop_set, seed), plan.dir, plan.dir / STOPSET,
                        plan.history_dirs(artifacts)[-1] if plan.previous else None,
                        rule.agreement if rule else 0.99)
