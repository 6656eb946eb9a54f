"""The label-check package's shape: modules in layers (function-local imports count), small files, and the names
the rest of tamis imports from `pipeline.labelcheck` still there."""

import ast
from pathlib import Path

import pipeline.labelcheck

PKG = Path(pipeline.labelcheck.__file__).parent
# Lowest first: a module may import only modules before it.
LAYERS = ["base", "detection", "calibration", "confident_learning", "knn", "out_of_sample", "relabel", "report",
          "open_answers", "boxes", "check", "stage"]
# What flows/, tests/ and benchmarks/ import from pipeline.labelcheck (the package keeps every one of them).
USED = {
    "LABELCHECK_VERSION", "VERDICT_FILE", "Issue", "KnnSpace", "LabelCheckError", "OOSResult", "annotator_agreement",
    "apply_temperature", "calibrate_confident_joint", "check_labels", "class_thresholds", "confident_joint",
    "detect_label_issues", "detect_open_label_issues", "export_relabel", "false_alarm_text", "find_label_issues",
    "fit_temperature", "issues_from_report", "knn_label_probs", "knn_space", "label_error_posterior",
    "label_issue_table", "label_report_markdown", "labels_spent", "noise_rate", "out_of_sample_probs",
    "prune_by_noise_rate", "relabel_candidates", "relabel_dir", "relabel_queued", "stratified_folds",
    "three_rater_accuracy", "verdict_headline", "verdict_signals", "write_label_report",
}


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at its top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the package
                base = "pipeline.labelcheck" + (f".{base}" if base else "")
            # `from pipeline import labelcheck` imports the module pipeline.labelcheck.
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return out


def test_every_module_imports_only_the_layers_below_it():
    files = {p.stem for p in PKG.glob("*.py")} - {"__init__"}
    assert files == set(LAYERS), f"add a new module to LAYERS at its place: {sorted(files ^ set(LAYERS))}"
    for i, name in enumerate(LAYERS):
        inside = {m.removeprefix("pipeline.labelcheck").lstrip(".").split(".")[0] for m in _imports(PKG / f"{name}.py")
                  if m == "pipeline.labelcheck" or m.startswith("pipeline.labelcheck.")}
        assert "" not in inside, f"{name}.py imports the package itself (a cycle through __init__)"
        above = inside - set(LAYERS[:i])
        assert not above, f"{name}.py imports {sorted(above)}, which sit at or above it in {LAYERS}"


def _module_file(mod: str) -> Path | None:
    path = PKG.parent.parent / mod.replace(".", "/")
    return next((p for p in (path.with_suffix(".py"), path / "__init__.py") if p.is_file()), None)


def test_nothing_the_package_imports_leads_back_into_it():
    """Follow pipeline.* imports (function-local ones too) from the package's own outside imports: none reaches
    pipeline.labelcheck again, so the package sits in no cycle."""
    todo = sorted({m for p in PKG.glob("*.py") for m in _imports(p)
                   if m.startswith("pipeline.") and not m.startswith("pipeline.labelcheck")})
    seen: dict[str, str] = {m: "pipeline.labelcheck" for m in todo}
    while todo:
        mod = todo.pop()
        path = _module_file(mod)
        if path is None:  # a name imported from a module (from pipeline.x import y), not a module
            continue
        for dep in _imports(path):
            if dep.startswith("pipeline.labelcheck") or dep == "pipeline.labelcheck":
                raise AssertionError(f"{mod} (reached from {seen[mod]}) imports {dep}: an import cycle")
            if dep.startswith("pipeline.") and dep not in seen:
                seen[dep] = mod
                todo.append(dep)
    assert "pipeline.store" in seen  # the walk did follow the package's imports


def test_files_stay_small():
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in PKG.glob("*.py")}
    assert max(sizes.values()) <= 500, sizes


def test_the_names_callers_use_are_exported():
    assert USED <= set(pipeline.labelcheck.__all__)
    assert all(hasattr(pipeline.labelcheck, n) for n in pipeline.labelcheck.__all__)
    # One version constant: every module uses the one in base.
    from pipeline.labelcheck import base

    for p in PKG.glob("*.py"):
        assert p.name == "base.py" or "LABELCHECK_VERSION =" not in p.read_text(encoding="utf-8"), p.name
    assert pipeline.labelcheck.LABELCHECK_VERSION is base.LABELCHECK_VERSION
