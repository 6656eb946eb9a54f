"""Annotation round-trip: export a selection to annotators, import their labels into the append-only ledger."""

from pipeline.annotation.export import (
    EXPORTERS,
    Exporter,
    ExportError,
    export_dir,
    export_selection,
    exported_sample_ids,
)
from pipeline.annotation.labels import (
    READERS,
    ImportReport,
    LabelKeys,
    LabelReader,
    SampleIndex,
    import_inbox,
    import_labels,
)
from pipeline.annotation.ledger import Ledger, ledger_path
from pipeline.annotation.simulate import simulate_annotator

__all__ = [
    "EXPORTERS", "READERS", "ExportError", "Exporter", "ImportReport", "LabelKeys", "LabelReader", "Ledger",
    "SampleIndex", "export_dir",
    "export_selection", "exported_sample_ids", "import_inbox", "import_labels", "ledger_path", "simulate_annotator",
]
