"""Stage tasks: a library call wrapped as a Prefect task whose cache key is its inputs' content.

Prefect's default cache policy includes the run ID, so every run would redo everything. Here the key is the stage
name + version + the task's parameters, and parameters are references (paths with content or key digests) and config
sections, never big objects. The version is the library's code-aware constant (`pipeline/codeversion.py`:
`"<hand-bumped marker>+<digest of the stage module's code closure>"`), the same string the library's own manifest
keys and folder names use, so an edit inside `pipeline/` (which Prefect's TASK_SOURCE policy cannot see) moves both
together. docs/architecture.md, "What invalidates what", lists every cause.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from prefect import task

from pipeline.errors import ArtifactError
from pipeline.stage_ref import key_fields
from pipeline.store import digest_json, read_manifest, record_execution

F = TypeVar("F", bound=Callable[..., Any])

# stage name -> its code-aware version, filled as the flow modules define their tasks (import flows.round for all)
STAGES: dict[str, str] = {}
RESULT_SERIALIZER = "json"


def plain_params(params: dict[str, Any]) -> dict[str, Any]:
    """A stage that takes one frozen parameters dataclass (pipeline.selection.SelectParams) is keyed on its fields
    (`key_fields`: `asdict()` with each StageRef flat), as a stage of plain keyword parameters is on those."""
    if len(params) == 1 and dataclasses.is_dataclass(one := next(iter(params.values()))):
        return key_fields(one)
    return params


def stage_cache_key(stage: str, version: str, params: dict[str, Any]) -> str:
    # Prefect's cache keys are global across tasks and flows, so the stage name is part of the key.
    return f"{stage}-{version}-{digest_json(plain_params(params))}"


def result_key(stage: str, version: str, params: dict[str, Any]) -> str:
    """The Prefect key (and result file name) of a stage task. Results are JSON; the suffix also means a result an
    older tamis pickled under the bare key is never found, so never unpickled: that stage's body runs once more and
    reuses its verified outputs on disk."""
    return stage_cache_key(stage, version, params) + ".json"


def stage_task(stage: str, version: str, *, artifacts_param: str = "artifacts", **task_options: Any) -> Callable[[F], F]:
    """Wrap `fn(**params) -> ref` as a cached Prefect task; each executed body is logged in executions.jsonl.

    `ref` is a small dict that names the stage's output folder under key "dir" (its manifest is verified on reuse).
    """

    STAGES[stage] = version

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def body(**params: Any) -> Any:
            record_execution(plain_params(params)[artifacts_param], stage, stage_cache_key(stage, version, params),
                             version=version)
            return fn(**params)

        wrapped = task(
            name=stage,
            cache_key_fn=lambda _ctx, params: result_key(stage, version, params),
            cache_expiration=None,
            persist_result=True,
            # Never pickle: docs/scaling.md puts the results on storage every worker shares, and a pickle written
            # there runs code in whoever reads it. A ref is paths, digests and numbers: JSON holds it.
            result_serializer=RESULT_SERIALIZER,
            **task_options,
        )(body)
        wrapped.stage_version = version  # what run_stage checks a cached ref's folder against
        return wrapped

    return decorate


def ref_is_valid(ref: Any, version: str | None = None) -> bool:
    """A cached reference is usable only if its folder's manifest still verifies (files may have been deleted) and,
    given `version`, was written by that version of the stage's code: folders that are not named by key (a round's
    selection/, a score shard) are rewritten in place by newer code, and a cached ref of older code (after checking
    out an older revision) would otherwise hand on the newer outputs under the older key."""
    if not isinstance(ref, dict) or "dir" not in ref:
        return True
    try:
        m = read_manifest(Path(ref["dir"]))
    except ArtifactError:
        return False
    return version is None or m.stage_version == version


def run_stage(stage_fn: Any, **params: Any) -> Any:
    """Call a stage task; if its cached result points at outputs that no longer verify (or that another version of
    the stage's code wrote since), run it again."""
    ref = stage_fn(**params)
    if not ref_is_valid(ref, getattr(stage_fn, "stage_version", None)):
        ref = stage_fn.with_options(refresh_cache=True)(**params)
    return ref
