"""Prefect flows: thin orchestration over `pipeline`. Import `flows.settings` first to point Prefect at artifacts/."""
