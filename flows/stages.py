"""Stage tasks: a library call wrapped as a Prefect task whose cache key is its inputs' content.

Prefect's default cache policy includes the run ID, so every run would redo everything. Here the key is the stage
name + version + the task's parameters, and parameters are references (paths with content digests) and config
sections, never big objects. The stage version is bumped when the library code of a stage changes meaningfully,
since Prefect's TASK_SOURCE policy cannot see edits inside `pipeline/`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from prefect import task

from pipeline.errors import ArtifactError
from pipeline.store import digest_json, read_manifest, record_execution

F = TypeVar("F", bound=Callable[..., Any])


def stage_cache_key(stage: str, version: str, params: dict[str, Any]) -> str:
    # Prefect's cache keys are global across tasks and flows, so the stage name is part of the key.
    return f"{stage}-{version}-{digest_json(params)}"


def stage_task(stage: str, version: str, *, artifacts_param: str = "artifacts", **task_options: Any) -> Callable[[F], F]:
    """Wrap `fn(**params) -> ref` as a cached Prefect task; each executed body is logged in executions.jsonl.

    `ref` is a small dict that names the stage's output folder under key "dir" (its manifest is verified on reuse).
    """

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def body(**params: Any) -> Any:
            record_execution(params[artifacts_param], stage, stage_cache_key(stage, version, params))
            return fn(**params)

        return task(
            name=stage,
            cache_key_fn=lambda _ctx, params: stage_cache_key(stage, version, params),
            cache_expiration=None,
            persist_result=True,
            **task_options,
        )(body)

    return decorate


def ref_is_valid(ref: Any) -> bool:
    """A cached reference is usable only if its folder's manifest still verifies (files may have been deleted)."""
    if not isinstance(ref, dict) or "dir" not in ref:
        return True
    try:
        read_manifest(Path(ref["dir"]))
    except ArtifactError:
        return False
    return True


def run_stage(stage_fn: Any, **params: Any) -> Any:
    """Call a stage task; if its cached result points at outputs that no longer verify, run it again."""
    ref = stage_fn(**params)
    if not ref_is_valid(ref):
        ref = stage_fn.with_options(refresh_cache=True)(**params)
    return ref
