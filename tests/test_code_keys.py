"""Code-aware cache keys (issue 24): a stage's version carries a digest of its module's code closure.

Unit tests of the closure on small packages written to disk; the repository's own digests checked against an
independent recomputation from its files; which stages an edit of the scoring or the export module moves (fast, from
a copy of the library); and, slow, a real round re-run in a copy of the code after each edit, read through
artifacts/executions.jsonl.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import shutil
import textwrap
from pathlib import Path

import pytest
import yaml

import flows.round  # noqa: F401 - defines every stage task, filling flows.stages.STAGES
from flows.stages import STAGES
from pipeline import codeversion as cv

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM_OF_SCORING = {"ingest", "preprocess", "quality", "augment", "embeddings", "train"}
# The round's stage tasks (other tests register throw-away tasks in the same registry during a session).
ROUND = {"ingest", "preprocess", "quality", "augment", "embeddings", "train", "evaluate", "labelcheck", "relabel",
         "score_shard", "select", "export"}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test starts with an empty parse cache of its own, on disk and in memory."""
    monkeypatch.setenv("TAMIS_CODE_CACHE", str(tmp_path / "code-cache.json"))
    monkeypatch.setattr(cv, "_parsed", None)


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return root


PKG = {
    "pkg/__init__.py": '"""A package."""\nfrom pkg.b import helper_b\n',
    "pkg/a.py": '''
        """Module a."""


        def helper_a(x):
            """Double it."""
            return 2 * x  # a comment
        ''',
    "pkg/b.py": "def helper_b(x):\n    return x + 1\n",
    "pkg/c.py": "VALUE = 3\n",
    "pkg/sub/__init__.py": "",
    "pkg/sub/d.py": "from ..c import VALUE\n",
    "pkg/stage_one.py": '''
        from pkg.a import helper_a


        def run(x):
            from pkg.sub import d  # function-local import of a submodule

            return helper_a(x) + d.VALUE
        ''',
    "pkg/stage_two.py": "import pkg.b\n\n\ndef run(x):\n    return pkg.b.helper_b(x)\n",
    "pkg/stage_three.py": "from pkg import helper_b\n",
}


@pytest.fixture
def pkg(tmp_path):
    return write(tmp_path / "src", PKG)


def digests(root: Path) -> dict[str, str]:
    return {m: cv.code_digest(f"pkg.{m}", root, "pkg") for m in ("stage_one", "stage_two", "stage_three")}


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert old in text, f"{path}: {old!r} not found (the test's edit must apply)"
    path.write_text(text.replace(old, new), encoding="utf-8")


def test_the_closure_follows_absolute_relative_and_function_local_imports(pkg):
    assert list(cv.code_closure("pkg.stage_one", pkg, "pkg")) == ["pkg.a", "pkg.c", "pkg.stage_one", "pkg.sub.d"]
    assert list(cv.code_closure("pkg.stage_two", pkg, "pkg")) == ["pkg.b", "pkg.stage_two"]
    # A name of the package (not a submodule) depends on its __init__, and on what that imports.
    assert list(cv.code_closure("pkg.stage_three", pkg, "pkg")) == ["pkg", "pkg.b", "pkg.stage_three"]


def test_editing_a_function_moves_exactly_the_stages_that_use_its_module(pkg):
    before = digests(pkg)
    edit(pkg / "pkg/a.py", "return 2 * x", "return 3 * x")
    after = digests(pkg)
    assert after["stage_one"] != before["stage_one"]
    assert {k: after[k] for k in ("stage_two", "stage_three")} == {k: before[k] for k in ("stage_two", "stage_three")}
    edit(pkg / "pkg/b.py", "x + 1", "x + 2")
    again = digests(pkg)
    assert again["stage_one"] == after["stage_one"]
    assert again["stage_two"] != after["stage_two"] and again["stage_three"] != after["stage_three"]


def test_a_transitive_edit_reaches_the_stage(pkg):
    before = digests(pkg)
    edit(pkg / "pkg/c.py", "VALUE = 3", "VALUE = 4")  # stage_one → (local) sub.d → (relative) c
    assert digests(pkg)["stage_one"] != before["stage_one"]


@pytest.mark.parametrize(("old", "new"), [
    ("return 2 * x  # a comment", "return 2 * x  # another comment, longer"),
    ('"""Double it."""', '"""Double the number it is given (a docstring edit)."""'),
    ('"""Module a."""', ""),  # the module docstring removed
    ("return 2 * x", "return (\n        2 * x\n    )"),  # layout only
])
def test_comments_docstrings_and_layout_move_nothing(pkg, old, new):
    before = digests(pkg)
    edit(pkg / "pkg/a.py", old, new)
    assert digests(pkg) == before


def test_a_new_import_joins_the_closure(pkg):
    edit(pkg / "pkg/stage_two.py", "import pkg.b\n", "import pkg.b\nimport pkg.c\n")
    assert "pkg.c" in cv.code_closure("pkg.stage_two", pkg, "pkg")


def test_a_warm_process_parses_nothing_and_a_damaged_cache_is_rebuilt(pkg, tmp_path, monkeypatch):
    cold = digests(pkg)
    monkeypatch.setattr(cv, "_parsed", None)  # a new process: only the file on disk remains

    def no_parse(*a, **k):
        raise AssertionError("parsed a file whose parse is cached")

    with monkeypatch.context() as m:
        m.setattr(cv, "normalise", no_parse)
        assert digests(pkg) == cold
    (tmp_path / "code-cache.json").write_text("{not json")
    monkeypatch.setattr(cv, "_parsed", None)
    assert digests(pkg) == cold


def test_an_unknown_module_is_an_error_naming_the_folder(pkg):
    with pytest.raises(KeyError, match="pkg.nope: no source file under"):
        cv.code_closure("pkg.nope", pkg, "pkg")


def test_without_sources_the_version_falls_back_to_the_package_version(tmp_path, monkeypatch):
    import pipeline

    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "scoring.cpython-311.pyc").write_bytes(b"")  # a wheel of compiled files only
    monkeypatch.setattr(cv, "package_root", lambda: tmp_path)
    assert cv.stage_version("4", "pipeline.scoring") == f"4+v{pipeline.__version__}"


def test_with_sources_a_misspelt_stage_module_fails_at_import_instead_of_falling_back():
    with pytest.raises(KeyError, match="pipeline.scorng: no source file"):
        cv.stage_version("1", "pipeline.scorng")


# ------------------------------------------------------------------------------ the repository's own stages
@functools.cache
def reference_files(root: Path) -> dict[str, tuple[set[str], str]]:
    """module -> (the pipeline modules it imports, sha256 of its AST without docstrings), recomputed independently of
    pipeline/codeversion.py: imports read the way tests/test_architecture.py reads them."""
    files = {}
    for path in (root / "pipeline").rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    out = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t:
                    deps.add(t)
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and \
                    isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        out[name] = (deps, hashlib.sha256(ast.dump(tree).encode()).hexdigest())
    return out


def reference_digest(module: str, root: Path) -> str:
    files = reference_files(root)
    seen, todo = set(), [module]
    while todo:
        if (name := todo.pop()) not in seen:
            seen.add(name)
            todo += files[name][0] - {"pipeline.codeversion"}  # it shapes keys, not outputs: in no closure
    h = hashlib.sha256()
    for name in sorted(seen):
        h.update(f"{name}\0{files[name][1]}\n".encode())
    return h.hexdigest()[: cv.DIGEST_CHARS]


def test_every_stage_task_carries_its_marker_and_its_modules_code_digest():
    assert ROUND <= set(STAGES)
    for stage, version in round_versions().items():
        marker, _, digest = version.partition("+")
        assert marker.isdigit(), f"{stage}: {version!r} does not start with its hand-bumped marker"
        assert digest == reference_digest(cv.version_module(version), ROOT), stage


def copy_library(dest: Path) -> Path:
    shutil.copytree(ROOT / "pipeline", dest / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def round_versions() -> dict[str, str]:
    return {s: STAGES[s] for s in ROUND}


def stage_digests(root: Path) -> dict[str, str]:
    return {stage: cv.code_digest(cv.version_module(v), root) for stage, v in round_versions().items()}


SCORING_EDIT = ("pipeline/scoring.py", "    ids = sorted(sample_ids)\n", "    ids = sorted(sample_ids)\n    ids = list(ids)\n")
EXPORT_EDIT = ("pipeline/annotation/export.py",
               '    return json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\\n"\n',
               '    text = json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False)\n    return text + "\\n"\n')


def test_an_edit_of_the_scoring_module_moves_scoring_not_upstream_and_export_moves_no_scoring(tmp_path):
    """The fast, library-level form of the round test below: which stage versions each edit moves."""
    code = copy_library(tmp_path / "code")
    base = stage_digests(code)
    assert base == {s: v.partition("+")[2] for s, v in round_versions().items()}  # the copy is this code
    edit(code / SCORING_EDIT[0], *SCORING_EDIT[1:])
    scored = stage_digests(code)
    moved = {s for s in ROUND if scored[s] != base[s]}
    assert "score_shard" in moved and not moved & (UPSTREAM_OF_SCORING | {"export"}), moved
    edit(code / EXPORT_EDIT[0], *EXPORT_EDIT[1:])
    exported = stage_digests(code)
    moved = {s for s in ROUND if exported[s] != scored[s]}
    assert "export" in moved and not moved & (UPSTREAM_OF_SCORING | {"score_shard", "select", "evaluate"}), moved


# --------------------------------------------------------------------------------- a real round, re-run
def tamis_round(code: Path, config: Path, api_url: str, *args: str) -> None:
    from benchmarks import _round_driver as driver

    driver.round_with_code(code, config, api_url, *args,
                           env={"TAMIS_CODE_CACHE": str(config.parent / "code-cache.json")})


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_round_rerun_after_a_code_edit_recomputes_that_stage_and_its_consumers_only(tmp_path, tiny_models):
    from benchmarks import _round_driver as driver
    from pipeline.data.demo import write_digits
    from pipeline.store import executions

    code = copy_library(tmp_path / "code")
    shutil.copytree(ROOT / "flows", code / "flows", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "configs", code / "configs")
    digits = write_digits(tmp_path / "digits", limit=60)
    shutil.copytree(tiny_models["idefics3"], tmp_path / "model")
    config = tmp_path / "tamis.yaml"
    config.write_text(yaml.safe_dump({
        "seed": 0,
        "paths": {"artifacts": str(tmp_path / "artifacts")},
        "data": {"sources": [{"kind": "jsonl", "path": str(digits / "manifest.jsonl")}],
                 "answers": [str(d) for d in range(10)], "question": "Which digit is shown in the image?",
                 "ground_truth": str(digits / "ground_truth.jsonl")},
        "preprocess": {"size": 32, "pad": "square"},
        "model": {"name_or_path": str(tmp_path / "model"), "family": "idefics3", "mode": "qlora"},
        "train": {"batch_size": 4, "effective_batch_size": 4, "max_steps": 2, "checkpoint_every": 1},
        # pixels: the selection-embeddings stage runs too, so "embeddings did not rerun" means something.
        "select": {"batch_size": 6, "strategy": "margin", "diversity": "cluster_margin", "shard_size": 16,
                   "embeddings": {"source": "pixels"}},
        "labelcheck": {"method": "off"},
        "rounds": {"max_rounds": 5, "simulate_annotator": True},
    }))
    art = tmp_path / "artifacts"

    def rerun() -> set[str]:
        n = len(executions(art))
        tamis_round(code, config, api_url, "--no-simulate")
        return {e["stage"] for e in executions(art)[n:]}

    with driver.prefect_server(tmp_path / "prefect-server") as api_url:
        tamis_round(code, config, api_url)  # round 0, answered by the simulated annotator
        first = rerun()  # round 1: a trained round
        assert {"train", "evaluate", "score_shard", "select", "export"} <= first, first
        assert rerun() == set()  # unchanged code: everything from the cache

        edit(code / SCORING_EDIT[0], *SCORING_EDIT[1:])
        after_scoring = rerun()
        assert {"score_shard", "select", "export"} <= after_scoring, after_scoring
        assert not after_scoring & UPSTREAM_OF_SCORING, after_scoring

        edit(code / EXPORT_EDIT[0], *EXPORT_EDIT[1:])
        after_export = rerun()
    assert "export" in after_export and not after_export & (UPSTREAM_OF_SCORING | {"score_shard", "select"}), \
        after_export


# ------------------------------------------------------------------------------- consumers key on upstream
def test_a_cold_start_selection_keys_on_its_candidates(tmp_path):
    """A cold start in a selection space has no score refs: the pool (what the quality stage left eligible) reaches the select stage only
    as a file, so its digest must be in the parameters, or a recomputed quality stage would reuse a stale batch."""
    from dataclasses import replace

    from flows.stages import stage_cache_key
    from pipeline.config import ProjectConfig
    from pipeline.selection import SELECT_VERSION, plan_selection

    cfg = ProjectConfig.model_validate({"paths": {"artifacts": str(tmp_path / "art")},
                                        "data": {"answers": ["0", "1"]},
                                        "model": {"name_or_path": "models/tiny", "family": "idefics3"}})

    def key(pool: list[str], round_dir: Path) -> str:
        round_dir.mkdir(parents=True)
        plan = plan_selection(cfg, round_dir=round_dir, pool_ids=pool, exclude=[], labels={}, adapter=None,
                              space={"dir": "art/embeddings/e", "digest": "e" * 64}, history_dirs=[])
        assert not plan.score  # nothing to score: no shard refs carry the pool
        params = replace(plan.stage_params([]), pool_path="same", exclude_path="same", labeled_path="same",
                         out_dir="same")  # the same folders: only what the files hold differs
        return stage_cache_key("select", SELECT_VERSION, {"params": params})

    assert key(["s1", "s2", "s3"], tmp_path / "a") == key(["s1", "s2", "s3"], tmp_path / "b")
    assert key(["s1", "s2", "s3"], tmp_path / "c") != key(["s1", "s2"], tmp_path / "d")


def hand_written_versions(root: Path) -> list[str]:
    """`path:line NAME` for every module-level `*_VERSION = <anything but stage_version(...)>` under root/pipeline."""
    out = []
    for path in sorted((root / "pipeline").rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id.endswith("_VERSION")
                                                    for t in node.targets):
                call = node.value
                if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                        and call.func.id == "stage_version"):
                    out.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node.targets[0])}")
    return out


def test_no_version_a_key_holds_is_bumped_by_hand():
    """REDUNDANCY_VERSION and CANDIDATES_VERSION were "1" until issue 48: an edit to the candidate clustering reused
    stale clusters. Every version constant is now a stage_version of its own module."""
    assert not hand_written_versions(ROOT), "versions bumped by hand (write NAME = stage_version(\"1\", \"module\")): " \
        + "; ".join(hand_written_versions(ROOT))
    from pipeline.annotation.redundancy import REDUNDANCY_VERSION
    from pipeline.strategies.candidates import CANDIDATES_VERSION

    for version, module in ((REDUNDANCY_VERSION, "pipeline.annotation.redundancy"),
                            (CANDIDATES_VERSION, "pipeline.strategies.candidates")):
        assert version == f"1+{reference_digest(module, ROOT)}"


def test_the_score_version_lives_beside_the_score_stage():
    import pipeline.score_stage
    import pipeline.scoring

    assert "SCORE_VERSION" not in vars(pipeline.scoring)
    assert cv.version_module(pipeline.score_stage.SCORE_VERSION) == "pipeline.score_stage"
