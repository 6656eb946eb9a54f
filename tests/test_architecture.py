"""The floors of the house, checked from the code's own imports (function-local ones included).

flows/ → pipeline/, never back; pipeline/ never imports Prefect; no import cycle anywhere; the flow modules order
stages and leave the artifact store to the library; no library file grows into a drawer.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "flows")
FLOW_MODULES = ("round", "select", "prepare", "ingest", "labelcheck")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, name: str, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement in the file, at any depth (functions too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                # `from a.b import c` imports the module a.b.c when there is one, else a name of a.b.
                out.append((f"{base}.{a.name}" if f"{base}.{a.name}" in known else base, node.lineno))
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    edges: dict[str, set[str]] = {m: set() for m in known}
    for name, path in known.items():
        for target, _ in imports(path, name, known):
            while target and target not in known:  # `import pipeline.x.y` of a name: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_counting_function_local_imports():
    found = cycles(graph())
    assert not found, "import cycles (break each by moving the shared part down a floor): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_the_library_never_imports_prefect_or_the_flows():
    known = modules()
    bad = [f"{path.relative_to(ROOT)}:{line} imports {target}"
           for name, path in known.items() if name.startswith("pipeline")
           for target, line in imports(path, name, known)
           if target.split(".")[0] in ("prefect", "prefect_dask", "flows")]
    assert not bad, "pipeline/ must not import Prefect or flows/ (move the code to flows/): " + "; ".join(bad)


@pytest.mark.parametrize("name", FLOW_MODULES)
def test_flow_modules_leave_the_artifact_store_to_the_library(name):
    known = modules()
    path = known[f"flows.{name}"]
    bad = [line for target, line in imports(path, f"flows.{name}", known) if target == "pipeline.store"]
    assert not bad, f"flows/{name}.py imports pipeline.store at lines {bad}: build paths and digests in pipeline/"


def test_files_stay_small():
    limits = {"flows/round.py": 150, "flows/select.py": 120}
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines()) for p in modules().values()}
    over = {f: n for f, n in sizes.items() if n > limits.get(f, 700 if f.startswith("pipeline/") else 10**6)}
    assert not over, f"files over their size (a package waiting to happen): {over}"


MAX_FUNCTION_LINES = 80


def test_no_pipeline_function_over_80_lines():
    """A function reads top to bottom on one screen: def line to the body's last line, decorators excluded."""
    over = []
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    over.append(f"{rel}:{node.lineno} {node.name} ({length} lines)")
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): " + "; ".join(over)


def test_the_cycle_finder_finds_a_cycle():
    # The guard above passes on an empty graph too: show it can fail.
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The library's floors, bottom to top: a module imports from its own floor or below, never above (function-local
# imports count). A module's floor is that of the longest prefix listed; flows/ stands on top of them all. Found from
# the imports at issue 39, once the shard stage left scoring.py and train_stage stopped reading the augment stage.
FLOORS = (
    # the ground: errors, the artifact store, config, keys, IDs, metrics books and their wording
    ("pipeline", "pipeline.errors", "pipeline.store", "pipeline.codeversion", "pipeline.config", "pipeline.idindex",
     "pipeline.schema", "pipeline.lock", "pipeline.metrics", "pipeline.chance", "pipeline.perclass", "pipeline.report",
     "pipeline.meaning", "pipeline.answer_metrics", "pipeline.stage_ref", "pipeline.faiss_threads", "pipeline.round_state", "pipeline.boxes",
     "pipeline.mdtext", "pipeline.csvcells",  # user text made inert in markdown and in CSVs for spreadsheets
     # the answer schema the config checks, and an answer checked against it (ingest and the label import read it);
     # the rest of pipeline.fields is a stage floor
     "pipeline.fields.schema", "pipeline.fields.answers"),
    ("pipeline.data",),  # sources → the ingested table
    ("pipeline.scoring",),  # scorers of rows with a loaded model (the shard stage that loads it is above)
    ("pipeline.model",),  # families, loading, planning, training on given rows
    # prepared data and what is computed from it without a round: quality, augmentation, selection embeddings
    ("pipeline.preprocess", "pipeline.quality", "pipeline.augment", "pipeline.embedders", "pipeline.embeddings",
     "pipeline.several_images"),
    ("pipeline.strategies",),  # heuristics, selectors, candidates: arrays in, picks out
    # the round's stages and the annotation loop
    ("pipeline.score_stage", "pipeline.selection", "pipeline.evaluate", "pipeline.stopping", "pipeline.annotation",
     "pipeline.labelcheck",
     "pipeline.fields"),  # structured answers: per-field metrics use pipeline.evaluate's token F1
    # the round: its plan, its report, what reads a finished round
    ("pipeline.round", "pipeline.unchanged", "pipeline.status", "pipeline.roundreport", "pipeline.predict",
     "pipeline.export_model", "pipeline.dataexport", "pipeline.project_init", "pipeline.serving",
     "pipeline.predict_inputs"),
    ("flows",),
)


def floor_of(module: str) -> int:
    # "pipeline" names the package's __init__ only: a new top-level module must say where it stands.
    best = max((p for floor in FLOORS for p in floor
                if module == p or (p != "pipeline" and module.startswith(p + "."))), key=len, default=None)
    if best is None:
        raise AssertionError(f"{module} is on no floor: add it to FLOORS in tests/test_architecture.py")
    return next(i for i, floor in enumerate(FLOORS) if best in floor)


def test_no_module_imports_from_a_higher_floor():
    edges = graph()  # module → the modules it imports, names resolved to their modules
    up = sorted(f"{name} imports {target} (floor {floor_of(target)} > {floor_of(name)})"
                for name, targets in edges.items() for target in targets if floor_of(target) > floor_of(name))
    assert not up, "imports up the floors (move the shared part down, or hand the value in): " + "; ".join(up)


def test_the_floor_check_finds_an_upward_import():
    assert floor_of("pipeline.scoring") < floor_of("pipeline.model.loading") < floor_of("pipeline.augment")
    assert floor_of("pipeline.model.train_stage") < floor_of("pipeline.augment") < floor_of("flows.round")


def test_every_module_is_on_a_floor():
    assert all(floor_of(m) >= 0 for m in modules())


# Issue 48: the round's floor (what reads a finished round) grew files that held several ideas each; split, every one
# of its files stays within this many lines, with no exceptions.
MAX_ROUND_FLOOR_LINES = 300


def test_round_floor_files_stay_within_300_lines():
    top = floor_of("pipeline.round")
    sizes = {str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
             for name, path in modules().items() if name.startswith("pipeline.") and floor_of(name) == top}
    assert "pipeline/roundreport/gather.py" in sizes and "pipeline/project_init/detect.py" in sizes
    big = sorted(f"{p} ({n} lines)" for p, n in sizes.items() if n > MAX_ROUND_FLOOR_LINES)
    assert not big, f"round-floor files over {MAX_ROUND_FLOOR_LINES} lines (split them along their ideas): " + ", ".join(big)


# ------------------------------------------------------------------------------------------- narrow signatures
# The round's planning functions (and the config's own loader) read several sections to build one stage's
# parameters: they may take the whole ProjectConfig, and at most this many do.
MAX_WHOLE_CONFIG = 8  # issue 39 asked for at most 10; training took its sections (TrainSpec) since: 8


def annotated(node: ast.AST | None) -> str:
    return "" if node is None else ast.unparse(node).strip("'\"")


def signatures(predicate) -> list[str]:
    """`path:line name(param)` for every function parameter in pipeline/ that `predicate(param)` flags."""
    out = []
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            for p in a.posonlyargs + a.args + a.kwonlyargs:
                if predicate(p):
                    out.append(f"{rel}:{node.lineno} {node.name}({p.arg})")
    return out


# A config section keeps its own type all the way down: a parameter that receives one (a call anywhere in pipeline/
# or flows/ passes it `cfg.<section>`, `project.<section>`, `*_cfg.<section>` or a dict of those), or that is named
# `cfg`, `sections` or `*_cfg`, is not typed `Any` or a `Mapping`/`dict` of `Any`.
LOOSE = ("Any", "typing.Any", "Mapping[str, Any]", "dict[str, Any]", "Mapping", "dict", "")
SECTION_HOLDERS = ("cfg", "config", "project")


def config_sections() -> set[str]:
    from pipeline.config import ProjectConfig

    return set(ProjectConfig.model_fields) - {"paths"}


def carries_section(expr: ast.AST, sections: set[str]) -> bool:
    """`cfg.model`, `self.cfg.train`, `project.select`, `base_cfg.data`, or a dict literal holding one."""
    if isinstance(expr, ast.Dict):
        return any(v is not None and carries_section(v, sections) for v in expr.values)
    if not (isinstance(expr, ast.Attribute) and expr.attr in sections):
        return False
    base = expr.value
    name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
    return name in SECTION_HOLDERS or name.endswith("_cfg")


def library_defs() -> dict[str, list[tuple[str, str | None, ast.FunctionDef]]]:
    """Function name -> (file, enclosing class or None, def) for every function in pipeline/."""
    out: dict[str, list] = {}
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for owner in ast.walk(tree):
            for node in (owner.body if isinstance(getattr(owner, "body", None), list) else []):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    cls = owner.name if isinstance(owner, ast.ClassDef) else None
                    out.setdefault(node.name, []).append((str(path.relative_to(ROOT)), cls, node))
    return out


def loose_section_parameters(calls: list[ast.Call], defs: dict, sections: set[str]) -> list[str]:
    out = set()
    for call in calls:
        f = call.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
        for rel, cls, d in defs.get(name, []):
            if owner and owner[:1].isupper() and cls != owner:  # `Spec.of(...)`: only Spec's own `of`
                continue
            a = d.args
            positional = a.posonlyargs + a.args
            if cls and positional and positional[0].arg in ("self", "cls"):
                positional = positional[1:]
            by_name = {p.arg: p for p in a.posonlyargs + a.args + a.kwonlyargs}
            pairs = [(positional[i], v) for i, v in enumerate(call.args) if i < len(positional)]
            pairs += [(by_name[k.arg], k.value) for k in call.keywords if k.arg in by_name]
            out.update(f"{rel}:{d.lineno} {d.name}({p.arg}: {annotated(p.annotation) or 'no type'})"
                       for p, v in pairs if carries_section(v, sections) and annotated(p.annotation) in LOOSE)
    return sorted(out)


def test_no_library_function_takes_a_config_section_as_any():
    defs, calls = library_defs(), []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            calls += [n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(n, ast.Call)]
    bad = loose_section_parameters(calls, defs, config_sections())
    bad += signatures(lambda p: (p.arg in ("cfg", "sections") or p.arg.endswith("_cfg"))
                      and annotated(p.annotation) in ("Any", "typing.Any", "Mapping[str, Any]", "Mapping"))
    assert not bad, "a config section typed Any or a Mapping (take the typed sections read): " + "; ".join(bad)


def test_the_section_check_finds_a_section_passed_as_any():
    tree = ast.parse("def export(out, *, sections: Mapping[str, Any], seed: int): ...\n"
                     "def predict(path, data: Any, model: ModelConfig): ...\n"
                     "class Spec:\n    def of(cls, select: Any): ...\n"
                     "class Pool:\n    def of(cls, prepared: Any): ...\n")
    defs: dict = {}
    for owner in ast.walk(tree):
        for node in (owner.body if isinstance(getattr(owner, "body", None), list) else []):
            if isinstance(node, ast.FunctionDef):
                defs.setdefault(node.name, []).append(("m.py", getattr(owner, "name", None), node))
    calls = [n for n in ast.walk(ast.parse(
        "export(o, sections={'data': cfg.data}, seed=cfg.seed)\npredict(p, cfg.data, cfg.model)\n"
        "Spec.of(cfg.select)\nPool.of(ds)\nexport(o, sections=params.data, seed=1)")) if isinstance(n, ast.Call)]
    assert loose_section_parameters(calls, defs, {"data", "model", "select", "seed"}) == [
        "m.py:1 export(sections: Mapping[str, Any])", "m.py:2 predict(data: Any)", "m.py:4 of(select: Any)"]


def test_few_library_functions_take_the_whole_project_config():
    whole = signatures(lambda p: annotated(p.annotation).split(" |")[0] == "ProjectConfig")
    assert len(whole) <= MAX_WHOLE_CONFIG, (f"{len(whole)} functions take a whole ProjectConfig (at most "
                                            f"{MAX_WHOLE_CONFIG}; take the sections read): " + "; ".join(whole))


# ------------------------------------------------------------------------------------------- stages apart
# The round's stage modules: each runs one cached stage of a round (a package counts as one stage; its modules may
# import each other). What two of them share lives on a floor below both, so an edit to one stage's code never moves
# another stage's code version (pipeline/codeversion.py digests import closures). The prepare stages (ingest,
# preprocess, quality, augment, embeddings) stand a floor below these and are read by them through FLOORS.
STAGE_MODULES = ("pipeline.model.train_stage", "pipeline.score_stage", "pipeline.selection", "pipeline.evaluate",
                 "pipeline.labelcheck")


def stage_of(module: str) -> str | None:
    return next((s for s in STAGE_MODULES if module == s or module.startswith(s + ".")), None)


def stage_imports(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{name} imports {target}" for name, targets in edges.items() for target in targets
                  if stage_of(name) and stage_of(target) and stage_of(target) != stage_of(name))


def test_no_stage_module_imports_another_stage_module():
    bad = stage_imports(graph())
    assert not bad, "a stage imports another stage (move what they share down a floor): " + "; ".join(bad)


def test_the_stage_check_finds_a_stage_importing_a_stage():
    edges = {"pipeline.evaluate": {"pipeline.selection", "pipeline.meaning"},
             "pipeline.labelcheck.knn": {"pipeline.labelcheck.base"}}
    assert stage_imports(edges) == ["pipeline.evaluate imports pipeline.selection"]


def test_every_stage_module_exists():
    known = modules()
    assert all(s in known for s in STAGE_MODULES), [s for s in STAGE_MODULES if s not in known]


def test_evaluations_code_version_holds_no_selection_code():
    """EVAL_VERSION digests evaluate's import closure: a selector's edit must not re-run every evaluation."""
    from pipeline.codeversion import code_closure, code_digest
    from pipeline.evaluate import EVAL_VERSION

    closure = code_closure("pipeline.evaluate")
    assert EVAL_VERSION.endswith(code_digest("pipeline.evaluate"))
    bad = [m for m in closure if m.startswith("pipeline.strategies") or m == "pipeline.selection"]
    assert not bad, f"EVAL_VERSION's closure ({len(closure)} modules) holds selection code: {bad}"


# ------------------------------------------------------------------------------------------- one read per round
# Issue 48: the round's import step, its training sets and its label carrying each re-read the prepare stage's folder
# (its manifest, then the dataset), so a round went down to the store and back once per reader. The round reads it
# once (`PoolData.load`) and hands the pool, dataset included, down; these files may open it nowhere else.
ROUND_READERS = ("flows/round.py", "flows/train.py", "pipeline/round", "pipeline/annotation/carry.py")
PREPARED_READS = ("load_prepared", "load_stage_dataset", "read_manifest")


def prepared_reads(path: Path, source: str) -> list[str]:
    """`file:line function` of each call of a PREPARED_READS name outside `PoolData.load`."""
    out = []

    def visit(node: ast.AST, owner: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                visit(child, f"{owner}.{child.name}".lstrip("."))
                continue
            if isinstance(child, ast.Call):
                f = child.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if name in PREPARED_READS and owner != "PoolData.load":
                    out.append(f"{path}:{child.lineno} {owner} calls {name}")
            visit(child, owner)

    visit(ast.parse(source), "")
    return out


def test_the_round_reads_the_prepared_dataset_once():
    files = sorted(p for r in ROUND_READERS for p in ([ROOT / r] if r.endswith(".py") else (ROOT / r).rglob("*.py")))
    bad = [b for p in files for b in prepared_reads(p.relative_to(ROOT), p.read_text(encoding="utf-8"))]
    assert not bad, ("the round reads the prepare stage's folder once (PoolData.load) and hands the pool down; "
                     "take a PoolData instead: " + "; ".join(bad))


def test_the_prepared_read_check_finds_a_second_read():
    source = ("class PoolData:\n    def load(cls, d):\n        return load_prepared(d)\n"
              "def labeled_set(ref, plan):\n    m = store.read_manifest(ref['dir'])\n    return load_prepared(ref['dir'])\n")
    assert prepared_reads(Path("m.py"), source) == ["m.py:5 labeled_set calls read_manifest",
                                                    "m.py:6 labeled_set calls load_prepared"]
