"""Active-learning strategies: uncertainty heuristics (pure array functions) and batch selectors (numpy/faiss)."""

from pipeline.strategies.heuristics import HEURISTICS, Heuristic, get_heuristic, rank
from pipeline.strategies.pool import Selection, select_batch
from pipeline.strategies.selectors import SELECTORS, Selector, k_center_greedy, kmeans_labels

__all__ = [
    "HEURISTICS",
    "SELECTORS",
    "Heuristic",
    "Selection",
    "Selector",
    "get_heuristic",
    "k_center_greedy",
    "kmeans_labels",
    "rank",
    "select_batch",
]
