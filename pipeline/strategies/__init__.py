"""Active-learning strategies: uncertainty heuristics (pure array functions) and batch selectors (numpy/faiss)."""

from pipeline.strategies.base import Selector
from pipeline.strategies.heuristics import Heuristic, rank
from pipeline.strategies.pool import Candidates, Selection, select_batch
from pipeline.strategies.registry import HEURISTICS, SELECTORS, get_heuristic, get_selector
from pipeline.strategies.selectors import k_center_greedy, kmeans_labels

__all__ = [
    "HEURISTICS",
    "Candidates",
    "SELECTORS",
    "Heuristic",
    "Selection",
    "Selector",
    "get_heuristic",
    "get_selector",
    "k_center_greedy",
    "kmeans_labels",
    "rank",
    "select_batch",
]
