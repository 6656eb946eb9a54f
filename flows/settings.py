"""Prefect set-up for a tamis project, in one place. Call `configure_prefect` before the first `import prefect`.

Prefect reads its settings when it is imported, so the CLI configures first and imports flows afterwards.
A value the user has already set in the environment always wins.
"""

from __future__ import annotations

import os
from pathlib import Path


def prefect_env(artifacts: Path) -> dict[str, str]:
    artifacts = Path(artifacts).resolve()
    return {
        "PREFECT_HOME": str(artifacts / "prefect"),
        "PREFECT_LOCAL_STORAGE_PATH": str(artifacts / "prefect" / "results"),
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
        # Flow results too are JSON, never pickles (stage tasks set it themselves, flows.stages.RESULT_SERIALIZER).
        "PREFECT_RESULTS_DEFAULT_SERIALIZER": "json",
        # The embedded server needs 20-36 s to start on small machines; Prefect's default gives up sooner.
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "NO_ALBUMENTATIONS_UPDATE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def configure_prefect(artifacts: Path) -> None:
    for key, value in prefect_env(artifacts).items():
        os.environ.setdefault(key, value)
    Path(os.environ["PREFECT_LOCAL_STORAGE_PATH"]).mkdir(parents=True, exist_ok=True)
