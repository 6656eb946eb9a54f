"""How many OpenMP threads faiss runs with: the CPUs this process may use, not the host's core count.

Below both the selectors (pipeline/strategies/) and the label check's kNN, so neither stage's code version holds the
other's code."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import faiss


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no sched_getaffinity
        return os.cpu_count() or 1


@contextlib.contextmanager
def faiss_threads(n: int | None = None) -> Iterator[None]:
    """Run faiss with `n` OpenMP threads (default: the CPUs this process may use, not the host's core count)."""
    prev = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(n or available_cpus())
    try:
        yield
    finally:
        faiss.omp_set_num_threads(prev)
