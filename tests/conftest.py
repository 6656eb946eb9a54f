"""Shared test set-up. Environment first: Prefect and albumentations read it when they are imported."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_PREFECT_HOME = Path(tempfile.mkdtemp(prefix="tamis-prefect-"))
os.environ.update(
    {
        "PREFECT_HOME": str(_PREFECT_HOME),
        "PREFECT_LOCAL_STORAGE_PATH": str(_PREFECT_HOME / "results"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "NO_ALBUMENTATIONS_UPDATE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
)
os.environ.pop("PREFECT_API_URL", None)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server for the whole session (it takes 20-36 s to start here)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


# --- shared fixtures below; each area appends its own under a heading ---
