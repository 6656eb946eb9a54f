"""One labeling round: ingest → prepare → import labels → (augment → retrain → evaluate) → score → select → export.

Every heavy step is a content-keyed task and every decision a pipeline function (pipeline/round/), so a re-run
of a finished round executes no stage body and a round killed anywhere resumes where it stopped.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect import flow, get_run_logger

from flows import waiting
from flows.export import export_ref
from flows.ingest import ingest_ref
from flows.labelcheck import relabel_ref
from flows.prepare import prepare_refs
from flows.select import select_ref
from flows.train import train_round
from flows.ui import library_logs_to_ui, name_run, progress_sink, publish_round
from pipeline import report, unchanged
from pipeline.annotation.inbox import receive_labels
from pipeline.annotation.redundancy import queue_redundancy
from pipeline.config import ProjectConfig, load_config
from pipeline.embeddings import embeddings_params
from pipeline.lock import ProjectLock
from pipeline.model.resolve import resolve_configured
from pipeline.quality import excluded_ids
from pipeline.round.intake import open_round
from pipeline.round.plan import PoolData, eligible_pool
from pipeline.round.records import record_relabel, record_selection, relabels
from pipeline.round.simulate import answer_round, simulated
from pipeline.round.stop import batch_for, budget_left, close_round, redundancy_cap
from pipeline.round_state import RoundState
from pipeline.roundreport.sources import round_sources, stopped_round_inputs
from pipeline.roundreport.writeup import write_up

log = logging.getLogger(__name__)


def run_round(cfg: ProjectConfig, *, simulate: bool | None = None,
              progress: report.RoundProgress | None = None) -> tuple[RoundState, bool]:
    """The body of a round; ordering only, every step is a library call or a cached stage task. Returns the round's
    state and whether the run now waits for its annotators (a resumed run has spent its one wait)."""
    art, progress = cfg.artifacts, progress or report.RoundProgress(lambda percent, text: None)
    log.info(resolve_configured(cfg.model).note)  # first: a model this machine cannot have fails in seconds
    inputs = unchanged.round_inputs(cfg)  # what this round reads, for `tamis round` to know a replay in advance
    with progress.step("ingest"):
        ing = ingest_ref(cfg, inputs.sources)
    with progress.step("prepare"):
        prep = prepare_refs(cfg, ing)
    with progress.step("import labels"):
        pool = PoolData.load(prep.prepare.dir)
        plan, state, agreed = open_round(art, pool, annotate=cfg.annotate, data=cfg.data, select=cfg.select,
                                         quality=cfg.quality, quality_info=prep.quality.info)
        name_run(plan.index, rerun=plan.rerun is not None)

    adapter, scorer, check = train_round(cfg, plan, prep, state, progress, pool) if plan.labels else (None,) * 3
    if not plan.labels:
        progress.skip("train", "evaluate", "label check")

    eligible = eligible_pool(art, pool, plan, excluded_ids(prep.quality.dir),
                             stop=pool.stop_set(cfg.rounds.stop_set, cfg.seed))
    close_round(cfg, plan, state, eligible, agreed=agreed)
    if state.stopped:
        read = stopped_round_inputs(embeddings_params(cfg, prep.prepare))
    else:
        with progress.step("score pool", "select"):
            sel, read = select_ref(cfg, prepared=prep.prepare, pool_ids=eligible.ids,
                                   exclude=sorted(eligible.exclude), round_dir=plan.dir, labels=plan.labels,
                                   history_dirs=plan.history, adapter=scorer,
                                   batch_size=batch_for(cfg.rounds, cfg.select.batch_size, state))
        with progress.step("export"):
            record_selection(state, sel, export_ref(cfg, selection=sel, prepared=prep.prepare,
                                                    round_index=plan.index))
            if relabels(cfg.labelcheck, check):
                queued = relabel_ref(cfg, check=check, prepared=prep.prepare, round_index=plan.index,
                                     cap=budget_left(cfg.rounds, state))
                record_relabel(state, queued)
            state.update(queue_redundancy(art, cfg.annotate, answers=cfg.data.scored_answers, dataset=pool.dataset,
                                          round_folder=plan.dir, round_index=plan.index,
                                          cap=redundancy_cap(cfg.rounds, state)))

    state.adapter = adapter
    up = write_up(art, cfg.data.scored_answers, plan, state, check, resolve=lambda: round_sources(
        cfg.data, cfg.model, cfg.select, state, prep, plan.dir, read, artifacts=art, seed=cfg.seed))
    if simulated(cfg.rounds, simulate):
        answer_round(art, state, ground_truth=cfg.data.ground_truth, noise=cfg.rounds.simulate_noise,
                     seed=cfg.seed, crowd=cfg.rounds)
    waits = not waiting.resumed() and waiting.waits_for_labels(cfg, state)
    publish_round(art, state, up, progress, waiting=waits, rerun=plan.rerun is not None)
    unchanged.record_round_inputs(art, state, inputs, unchanged.round_inputs(cfg, sources=inputs.sources))
    return state, waits


def _locked_round(cfg: ProjectConfig, simulate: bool | None) -> tuple[RoundState, bool]:
    with ProjectLock(cfg.artifacts / "round.lock"):
        return run_round(cfg, simulate=simulate,
                         progress=report.RoundProgress(progress_sink("round-progress", "labeling round")))


@flow(name="labeling-round", flow_run_name=waiting.first_name, log_prints=False)
def labeling_round(config_path: str | None = None, simulate: bool | None = None) -> dict[str, Any]:
    """Run (or resume, or re-run cached) the next labeling round of the project configured in `config_path`.

    With `rounds.wait_for_labels` a deployed run suspends after its export (Suspended in the UI, with a form) and
    holds nothing meanwhile. Resumed, it starts again from the top, finds its pause key, skips straight to the
    labels, imports them and runs the next round.
    """
    from prefect.flow_runs import suspend_flow_run

    cfg, logger = load_config(config_path), get_run_logger()
    logger.info("labeling round for %s (artifacts in %s)", config_path or "the demo config", cfg.artifacts)
    with library_logs_to_ui():
        if not waiting.resumed():
            state, waits = _locked_round(cfg, simulate)
            if not waits:
                if cfg.rounds.wait_for_labels and not waiting.deployed():
                    logger.info("rounds.wait_for_labels: only a deployment's run can wait (its worker restarts it "
                                "when resumed); this run ends now, the next one imports the labels")
                return waiting.final(state)
            logger.info("round %d exported %d samples to %s; suspending until the labels are in (resume from the "
                        "UI or `tamis resume`; gives up after %d s, rounds.wait_timeout_s)", state.round,
                        state.selected_count, state.export_dir, cfg.rounds.wait_timeout_s)
        # The first call ends this process (the run shows Suspended); in the resumed run it returns the form's input.
        answer = suspend_flow_run(wait_for_input=waiting.LabelsIn, timeout=cfg.rounds.wait_timeout_s,
                                  key=waiting.WAIT_KEY)
        logger.info("resumed: labels in inbox %s, file %r, note %r", answer.labels_in_inbox, answer.labels_file,
                    answer.note)
        if answer.labels_file.strip():
            logger.info("labels file copied to %s", receive_labels(cfg.artifacts, answer.labels_file.strip(),
                                                                   labels_from=cfg.rounds.labels_from))
        return waiting.final(_locked_round(cfg, simulate)[0])
