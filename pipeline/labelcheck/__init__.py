"""Data-centric label checks: out-of-sample probabilities, calibrated and abstaining label-error detection (confident
learning on the model's probabilities combined with kNN label consistency), a relabel queue and annotator agreement.

A check that cries wolf is worse than none: the model's out-of-sample probabilities are calibrated (temperature
scaling), the check abstains while the model is too weak to tell its own mistakes from wrong labels, confident
learning's noise-rate estimate bounds how many labels are reported, and each reported label carries the probability
that it is wrong, so the report can say how many of its own alarms are probably false.

Nothing here changes a label. Likely errors are reported (with who labeled them, from which file) and sent back to
annotators as a separate task set; their answers come in through the normal import and land in the ledger as
correction entries, so the old label stays visible in `tamis labels history`.

The package, one module per part, each importing only the ones before it in this order: base, detection,
calibration, confident_learning, knn, out_of_sample, relabel, report, open_answers, check, stage. This file re-exports
the names the rest of tamis uses.
"""

from pipeline.labelcheck.base import LABELCHECK_VERSION, CheckScoring, CheckSpec, HeldOut, LabelCheckError
from pipeline.labelcheck.calibration import apply_temperature, fit_temperature
from pipeline.labelcheck.check import check_labels, knn_space
from pipeline.labelcheck.confident_learning import (
    calibrate_confident_joint,
    class_thresholds,
    confident_joint,
    find_label_issues,
    label_error_posterior,
    noise_rate,
    prune_by_noise_rate,
)
from pipeline.labelcheck.detection import Issue, false_alarm_text
from pipeline.labelcheck.knn import KnnSpace, detect_label_issues, knn_label_probs, three_rater_accuracy
from pipeline.labelcheck.open_answers import detect_open_label_issues
from pipeline.labelcheck.out_of_sample import OOSResult, out_of_sample_probs, stratified_folds
from pipeline.labelcheck.relabel import (
    export_relabel,
    issues_from_report,
    labels_spent,
    relabel_candidates,
    relabel_dir,
    relabel_queued,
)
from pipeline.labelcheck.report import (
    VERDICT_FILE,
    annotator_agreement,
    check_report_markdown,
    label_issue_table,
    label_report_markdown,
    report_agreement,
    report_table,
    report_verdict,
    verdict_headline,
    verdict_signals,
    write_label_report,
)
from pipeline.labelcheck.stage import plan_label_check, plan_relabel, run_label_check, run_relabel

__all__ = [
    "annotator_agreement", "CheckScoring", "CheckSpec", "check_report_markdown", "HeldOut", "apply_temperature", "calibrate_confident_joint", "check_labels",
    "class_thresholds", "confident_joint", "detect_label_issues", "detect_open_label_issues",
    "export_relabel", "false_alarm_text", "find_label_issues", "fit_temperature", "Issue",
    "issues_from_report", "knn_label_probs", "knn_space", "KnnSpace", "label_error_posterior",
    "label_issue_table", "label_report_markdown", "LABELCHECK_VERSION", "LabelCheckError", "labels_spent",
    "noise_rate", "OOSResult", "out_of_sample_probs", "plan_label_check", "plan_relabel",
    "prune_by_noise_rate", "relabel_candidates", "relabel_dir", "relabel_queued", "report_agreement",
    "report_table", "report_verdict", "run_label_check", "run_relabel", "stratified_folds",
    "three_rater_accuracy", "VERDICT_FILE", "verdict_headline", "verdict_signals", "write_label_report",
]
