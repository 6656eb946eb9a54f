"""The one place config names meet classes: `select.strategy` → a heuristic, `select.diversity` → a selector.

Adding a part: write its class (heuristics.py, selectors.py or coverage.py) and add one line here; the contract
tests in tests/test_strategies.py and tests/test_selectors.py run it by being registered.
"""

from __future__ import annotations

from pipeline.errors import SelectionError
from pipeline.strategies.base import Selector
from pipeline.strategies.box_balance import ClassBalanced
from pipeline.strategies.coverage import MaxHerding, ProbCover, TypiClust, UncertaintyHerding
from pipeline.strategies.heuristics import (
    BALD,
    AnswerDisagreement,
    Entropy,
    Heuristic,
    LeastConfidence,
    Margin,
    Random,
    SemanticEntropy,
    TokenEntropy,
)
from pipeline.strategies.selectors import ClusterMargin, KCenter, Stratified, TopK, Typical

HEURISTICS: dict[str, type[Heuristic]] = {
    "random": Random,
    "least_confidence": LeastConfidence,
    "margin": Margin,
    "entropy": Entropy,
    "bald": BALD,
    "token_entropy": TokenEntropy,
    "answer_disagreement": AnswerDisagreement,
    "semantic_entropy": SemanticEntropy,
}

SELECTORS: dict[str, type[Selector]] = {
    "top_k": TopK,
    "k_center": KCenter,
    "cluster_margin": ClusterMargin,
    "stratified": Stratified,
    "typical": Typical,
    "typiclust": TypiClust,
    "probcover": ProbCover,
    "maxherding": MaxHerding,
    "uncertainty_herding": UncertaintyHerding,
    "class_balanced": ClassBalanced,
}


def get_heuristic(name: str, *, seed: int = 0) -> Heuristic:
    """The heuristic called `name` (select.strategy); only those that draw random numbers read the seed."""
    if name not in HEURISTICS:
        raise SelectionError(f"unknown strategy {name!r}; choose one of {sorted(HEURISTICS)}")
    return HEURISTICS[name].from_seed(seed)


def get_selector(name: str) -> type[Selector]:
    """The selector class called `name` (select.diversity)."""
    if name not in SELECTORS:
        raise SelectionError(f"select: unknown diversity {name!r}; choose one of {sorted(SELECTORS)}")
    return SELECTORS[name]
