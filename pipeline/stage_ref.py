"""What one stage hands the next: `StageRef`, the output folder, the digest consumers key on, and what the stage
reported beside them (counts, metrics, the prepared set's info).

A stage task's result is JSON (flows/stages.py persists it so), and a task's cache key is its parameters' fields:
`key_fields` turns a parameters dataclass into that dict with each StageRef as the flat dict a task's result is
(`as_dict()`), so typing a field as StageRef moves no cache key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import ArtifactError


@dataclass(frozen=True)
class StageRef:
    """A stage's output as the next stage takes it: `dir` (its manifest verifies the files), `digest` (the manifest's
    key or the output's content digest: what a consumer keys on) and `extra`, every other field the stage reported."""

    dir: str
    digest: str
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, ref: Mapping[str, Any] | StageRef) -> StageRef:
        """From a stage task's result (or the part of one a consumer keeps); a StageRef is taken as it is."""
        if isinstance(ref, StageRef):
            return ref
        missing = [k for k in ("dir", "digest") if k not in ref]
        if missing:
            raise ArtifactError(f"a stage reference needs {' and '.join(missing)}, got fields {sorted(ref)}; pass the "
                                "stage task's result")
        return cls(str(ref["dir"]), str(ref["digest"]), {k: v for k, v in ref.items() if k not in ("dir", "digest")})

    def as_dict(self) -> dict[str, Any]:
        """The flat JSON form: a task's result, and what a cache key holds."""
        return {"dir": self.dir, "digest": self.digest, **self.extra}

    @property
    def info(self) -> Mapping[str, Any]:
        """What the stage reported as its `info` (the prepare and quality stages: counts, thresholds, flags)."""
        return self.extra.get("info") or {}


@dataclass(frozen=True)
class PreparedRefs:
    """The prepare flow's two outputs, what a round's later stages read: the prepared dataset (`prepare`) and its
    quality flags (`quality`)."""

    prepare: StageRef
    quality: StageRef

    @classmethod
    def of(cls, refs: Mapping[str, Any]) -> PreparedRefs:
        """From {"prepare": ref, "quality": ref}, as artifacts/prepare/latest.json keeps them."""
        return cls(StageRef.of(refs["prepare"]), StageRef.of(refs["quality"]))

    def as_dict(self) -> dict[str, Any]:
        return {"prepare": self.prepare.as_dict(), "quality": self.quality.as_dict()}


def key_fields(params: Any) -> dict[str, Any]:
    """A stage's parameters dataclass as its cache key holds it: `dataclasses.asdict`, except that a StageRef (at any
    depth) is its flat `as_dict()`."""
    return {f.name: _plain(getattr(params, f.name)) for f in dataclasses.fields(params)}


def _plain(value: Any) -> Any:
    if isinstance(value, StageRef):
        return _plain(value.as_dict())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return key_fields(value)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value
