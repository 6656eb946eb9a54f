"""The config sections' base: unknown keys are errors, assignments are validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # Unknown keys are errors: a typo in a YAML key must not be silently ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())
