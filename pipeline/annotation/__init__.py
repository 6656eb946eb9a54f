"""Annotation round-trip: export a selection to annotators, import their labels into the append-only ledger."""

from pipeline.annotation.export import (
    EXPORTERS,
    Exporter,
    ExportError,
    export_dir,
    export_selection,
    exported_sample_ids,
)
from pipeline.annotation.inbox import import_inbox, inbox_files, receive_labels
from pipeline.annotation.label_files import LABEL_READERS, LabelKeys, LabelReader
from pipeline.annotation.labels import ImportReport, import_labels
from pipeline.annotation.ledger import Ledger, ledger_path
from pipeline.annotation.matching import SampleIndex
from pipeline.annotation.simulate import simulate_annotator

__all__ = [
    "EXPORTERS", "LABEL_READERS", "ExportError", "Exporter", "ImportReport", "LabelKeys", "LabelReader", "Ledger",
    "SampleIndex", "export_dir", "export_selection", "exported_sample_ids", "import_inbox", "import_labels",
    "inbox_files", "ledger_path", "receive_labels", "simulate_annotator",
]
