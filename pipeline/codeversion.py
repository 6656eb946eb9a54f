"""Code-aware stage versions: a stage's version string carries a digest of the library code it runs.

A stage module keeps one hand-bumped version constant beside its code, written as
`SELECT_VERSION = stage_version("3", "pipeline.selection")` (the module named, not `__name__`, which a module run as
a script would not have; a stage may name the module that runs it, as TRAIN_VERSION names pipeline.model.train_stage,
LABELCHECK_VERSION the whole pipeline.labelcheck package). Every version a key holds is made here: the stages', the
candidate clusters' (CANDIDATES_VERSION) and the redundancy queue's (REDUNDANCY_VERSION); tests/test_code_keys.py
refuses a hand-written one. The value is `"1+<12 hex>"`: the hand-kept marker,
then the digest of the stage module's *code closure* — the module plus every `pipeline.*` module it imports, transitively, function-local
imports included, found statically with `ast` (nothing is imported or executed). Every key derived from the constant
(the Prefect task key in flows/stages.py, the manifest keys and folder names in pipeline/, the benchmarks' cache
look-ups) therefore moves when, and only when, that closure's code moves.

What counts as code: each file is parsed, its docstrings (module, class, function) are dropped, and the digest is taken
over `ast.dump` of the rest, which holds no comments, formatting or line numbers. A comment, docstring or re-wrapping
edit does not recompute a two-hour scoring stage; any change to what runs does. `ast.dump`'s text can differ between
Python minor versions, so a Python upgrade recomputes every stage once (a different interpreter may give different
numbers anyway).

What a closure follows: `import pipeline.a.b` and `from pipeline.a import b` (b a submodule) depend on pipeline.a.b;
`from pipeline.a import name` depends on pipeline/a/__init__.py and whatever it imports. A submodule import does not
pull in its parent package's `__init__` (those are re-export lists here, as tests/test_architecture.py reads them).
Imports built from strings at run time (importlib) are not seen; tamis has none. This module is in no closure: it
shapes keys, not outputs, and every stage module imports it.

Installed without sources (a wheel of .pyc files only): the digest cannot be taken, and the version falls back to
`"1+v<tamis version>"`, so an upgrade of the package still moves every key once, but an edit inside one release does
not; say so in the bug report if you hit it.

Cost: parsing all of pipeline/ takes about half a second on a small CPU, so each file's parse is cached on disk by the
sha256 of its bytes (and the Python version) in `$TAMIS_CODE_CACHE` or `~/.cache/tamis/code-digests.json`; a warm run
reads and hashes the files of each closure (tens of milliseconds for all stages). The cache holds no code and
is rebuilt if unreadable.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from pipeline import __version__

PACKAGE = "pipeline"
DIGEST_CHARS = 12
_CACHE_LIMIT = 4000  # entries (one per file version seen); the oldest go first
_PY = f"py{sys.version_info[0]}.{sys.version_info[1]}"

# content sha256 -> [normalised digest, [[module or "", level, [names]], ...]]; loaded from disk once per process
_parsed: dict[str, list] | None = None
_dirty = False
# every version stage_version() returned -> the module whose closure it digests (tests re-derive keys from it)
_MODULES: dict[str, str] = {}


def package_root() -> Path:
    """The folder holding the `pipeline` package this process imported."""
    return Path(__file__).resolve().parent.parent


def module_files(root: Path, package: str = PACKAGE) -> dict[str, str]:
    """Dotted module name -> source file, for every .py under root/package (plain strings and os.walk: pathlib's
    objects were most of a warm run's time)."""
    out = {}
    for folder, dirs, files in os.walk(os.path.join(root, package)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        prefix = os.path.relpath(folder, root).replace(os.sep, ".")
        for f in files:
            if f.endswith(".py"):
                out[prefix if f == "__init__.py" else f"{prefix}.{f[:-3]}"] = os.path.join(folder, f)
    return out


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def normalise(source: bytes, filename: str = "<source>") -> tuple[str, list]:
    """(digest of the code without comments, docstrings or layout, the file's import statements at any depth)."""
    tree = ast.parse(source, filename=filename)
    imports: list = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imports += [[a.name, 0, []] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            imports.append([node.module or "", node.level, [a.name for a in node.names]])
    digest = hashlib.sha256(ast.dump(_strip_docstrings(tree)).encode()).hexdigest()
    return digest, imports


def _cache_path() -> Path:
    if os.environ.get("TAMIS_CODE_CACHE"):
        return Path(os.environ["TAMIS_CODE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tamis" / "code-digests.json"


def _load_cache() -> dict[str, list]:
    global _parsed
    if _parsed is None:
        try:
            data = json.loads(_cache_path().read_text(encoding="utf-8"))
            _parsed = data if isinstance(data, dict) and data.get("_format") == 1 else {}
        except (OSError, ValueError):
            _parsed = {}  # a missing or damaged cache costs one parse per file, nothing else
        _parsed["_format"] = 1
    return _parsed


def _save_cache() -> None:
    global _dirty
    if not _dirty or _parsed is None:
        return
    from pipeline.store import atomic_write_json

    keep = dict(list(_parsed.items())[-_CACHE_LIMIT:])
    keep["_format"] = 1
    try:
        _cache_path().parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(_cache_path(), keep, indent=None)
    except OSError:
        pass  # a read-only home only makes the next process parse again
    _dirty = False


def _parse(path: str) -> tuple[str, list]:
    global _dirty
    with open(path, "rb") as f:
        data = f.read()
    key = f"{_PY}:{hashlib.sha256(data).hexdigest()}"
    cache = _load_cache()
    if key not in cache:
        cache[key] = list(normalise(data, path))
        _dirty = True
    return cache[key][0], cache[key][1]


def _targets(name: str, path: str, imports: Iterable[list], known: dict[str, str]) -> set[str]:
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for module, level, names in imports:
        if level:
            up = package.split(".")[: len(package.split(".")) - level + 1]
            module = ".".join(up + ([module] if module else []))
        candidates = [f"{module}.{n}" if f"{module}.{n}" in known else module for n in names] if names else [module]
        for target in candidates:
            while target and target not in known:  # `import pipeline.x.y` of a name in x: its module x
                target = target.rpartition(".")[0]
            if target:
                out.add(target)
    return out


def _closure(module: str, root: Path | None, package: str) -> dict[str, tuple[str, str]]:
    root = package_root() if root is None else Path(root)
    known = module_files(root, package)
    if module not in known:
        raise KeyError(f"{module}: no source file under {root / package}; pass a module of the {package!r} package")
    seen: dict[str, tuple[str, str]] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        digest, imports = _parse(known[name])  # each file read and hashed once per call
        seen[name] = (known[name], digest)
        todo += sorted(_targets(name, known[name], imports, known) - seen.keys() - {__name__})
    _save_cache()
    return dict(sorted(seen.items()))


def code_closure(module: str, root: Path | None = None, package: str = PACKAGE) -> dict[str, Path]:
    """Module name -> file of `module` and every `package.*` module it imports, transitively (sorted by name)."""
    return {name: Path(path) for name, (path, _) in _closure(module, root, package).items()}


def code_digest(module: str, root: Path | None = None, package: str = PACKAGE) -> str:
    """First DIGEST_CHARS hex of the sha256 over (name, normalised code digest) of each module of the closure."""
    h = hashlib.sha256()
    for name, (_, digest) in _closure(module, root, package).items():
        h.update(f"{name}\0{digest}\n".encode())
    return h.hexdigest()[:DIGEST_CHARS]


def stage_version(version: str, module: str) -> str:
    """`version` (the hand-bumped marker) + the digest of `module`'s code closure: what every key of a stage uses.

    Only a tree without sources falls back (see the module docstring); a module name that is not in a tree that has
    them is a typo, and raises.
    """
    if not (package_root() / PACKAGE / "__init__.py").is_file():
        out = f"{version}+v{__version__}"
    else:
        out = f"{version}+{code_digest(module)}"
    _MODULES[out] = module
    return out


def version_module(version: str) -> str:
    """The module whose code closure a version string from stage_version() digests (KeyError if none did)."""
    return _MODULES[version]
