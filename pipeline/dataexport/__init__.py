"""The labeled set leaves tamis in the formats people train with (`tamis export-data`, docs/formats.md)."""

from pipeline.dataexport.export import DataExportResult, export_data  # noqa: F401
from pipeline.dataexport.writers import WRITERS  # noqa: F401
