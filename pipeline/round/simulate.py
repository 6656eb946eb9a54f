"""The simulated annotator of a demo or benchmark project: whether it answers a round, and its answers to a
finished round's export, re-label queue and redundancy queue, dropped into the inbox as a person's would be.
"""

from __future__ import annotations

import os
from typing import Any

from pipeline.config import RoundsConfig
from pipeline.round_state import RoundState


def simulated(rounds_cfg: RoundsConfig, simulate: bool | None) -> bool:
    """Whether the simulated annotator answers this round's export: `--simulate/--no-simulate` when given, else
    rounds.simulate_annotator."""
    return rounds_cfg.simulate_annotator if simulate is None else simulate


def answer_round(artifacts: str | os.PathLike[str], s: RoundState, *, ground_truth: Any,
                 noise: float, seed: int, crowd: RoundsConfig | None = None) -> None:
    """The simulated annotator answers a finished round's export (and its re-label queue) into the inbox; with a
    crowd (the rounds section's simulate_annotators, read from `crowd`) the crowd does, rounds.simulate_redundancy
    of them per sample, and it also answers the redundancy queue, each sample by someone who has not labeled it.

    Only a finished round is answered: with its labels in the inbox before round.json, a crash in between made the
    re-run import them into this round (a cold-start round trained, its export replaced, rounds renumbered).
    """
    from pipeline.annotation.inbox import inbox_dir
    from pipeline.annotation.simulate import simulate_annotator, simulate_annotators

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
