"""A round's report: one self-contained HTML page (artifacts/rounds/NNN/report.html) with the batch as a contact
sheet, the pool map, what the model gets wrong, the quality flags, the learning curve and the labels.

sources.py says where a round's outputs are, gather.py reads what the page shows (bounded by what it shows, not by
the pool), poolmap.py samples and projects the selection space, pictures.py draws, page.py renders, build.py puts
them together."""

from pipeline.roundreport.build import (
    BATCH_PNG,
    CONFUSION_PNG,
    REPORT_FILE,
    RoundReport,
    build_report,
    rebuild_report,
    try_round_report,
    write_round_report,
)
from pipeline.roundreport.sources import ReportSources, resolve_sources

__all__ = ["BATCH_PNG", "CONFUSION_PNG", "REPORT_FILE", "ReportSources", "RoundReport", "build_report",
           "rebuild_report", "resolve_sources", "try_round_report",
           "write_round_report"]
