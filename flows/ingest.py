"""The ingest flow: ingestion as a Prefect task cached on the sources' content + the `data` config section."""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.stages import run_stage, stage_task
from pipeline.config import ProjectConfig, load_config
from pipeline.data.ingest import (
    INGEST_VERSION,
    STAGE,
    ingest_params,
    ingest_stage,
    record_latest,
)

ingest_task = stage_task(STAGE, INGEST_VERSION)(ingest_stage)


def ingest_ref(cfg: ProjectConfig, digest: str | None = None) -> dict[str, Any]:
    """Run (or reuse) ingestion for `cfg`; call it from inside a flow. Returns {"dir", "digest", "counts"}.

    `digest` is `source_digest(cfg.data, cfg.artifacts)` if the caller computed it already.
    """
    ref = run_stage(ingest_task, params=ingest_params(cfg.data, cfg.artifacts, digest))
    record_latest(cfg.artifacts, ref)
    return ref


@flow(name="ingest")
def ingest_flow(config_path: str | None = None, source_digest: str | None = None) -> dict[str, Any]:
    return ingest_ref(load_config(config_path), source_digest)
