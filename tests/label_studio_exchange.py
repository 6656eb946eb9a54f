"""The Label Studio SDK surface tamis's connector uses, recorded from the real SDK against a real server.

tests/data/label_studio_exchange.json holds:
- "label_studio", "label_studio_sdk": the versions it was recorded with;
- "signatures": `inspect.signature` of the client's constructor and of every SDK method the connector called;
- "scenarios": name → every call the connector made, in order: {"method", "kwargs", "response"} (the response as
  the SDK's pydantic models dump it; a pager as the list of its items). The recording's project folder (a temp
  dir) is written as ROOT and put back on replay.

`RecordedLS` replays one scenario strictly: an attribute, method or keyword the recording lacks raises
(AttributeError / TypeError, as the real SDK would), a call out of order or with other arguments raises
`ExchangeMismatch`, and its response objects raise AttributeError on any field the server did not send. So a change
in the connector's calls, or an SDK whose surface moved (once re-recorded), fails the fast tests.

The scenarios themselves live here, run identically against the real server (tests/record_label_studio.py, and the
slow test that checks the recording is still what the pinned SDK and server do) and against the replay.
Re-record after changing the connector's SDK calls or bumping the pinned Label Studio:
    python tests/record_label_studio.py
"""

from __future__ import annotations

import copy
import inspect
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXCHANGE = Path(__file__).parent / "data" / "label_studio_exchange.json"
ROOT = "{root}"
DIGITS = [str(i) for i in range(10)]
TOKEN_ENV = "TAMIS_TEST_LS_TOKEN"
SCENARIO_TITLE = "tamis recorded "  # every scenario's project title starts so


class ExchangeMismatch(AssertionError):
    """The connector made a call the recording does not have at this point."""


# ----------------------------------------------------------------------------------------------- json helpers
def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if hasattr(obj, "__iter__"):  # an SDK pager: the connector reads it whole
        return [_jsonable(v) for v in obj]
    raise TypeError(f"cannot record a {type(obj).__name__}")


def _swap(obj: Any, old: str, new: str) -> Any:
    """`obj` with every occurrence of the string `old` inside its strings replaced by `new`."""
    return json.loads(json.dumps(obj).replace(json.dumps(old)[1:-1], json.dumps(new)[1:-1]))


def _passes_through(sig: inspect.Signature) -> bool:
    return all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name == "self" for p in sig.parameters.values())


def signature_record(owner: type, name: str) -> dict[str, Any]:
    """The parameters of `owner.name`; where a subclass's override only passes `**kwargs` on (the SDK's `*Ext`
    clients do), those of the nearest base class that declares them, so the record keeps real argument names."""
    defined = [c for c in owner.__mro__ if name in vars(c)]
    sigs = [inspect.signature(vars(c)[name]) for c in defined]
    sig = next((s for s in sigs if not _passes_through(s)), sigs[0])
    where = defined[sigs.index(sig)]
    return {"text": str(sig), "defined_in": f"{where.__module__}.{where.__qualname__}", "params": [
        {"name": p.name, "kind": p.kind.name, "required": p.default is inspect.Parameter.empty}
        for p in sig.parameters.values() if p.name != "self"]}


def skeleton(obj: Any) -> Any:
    """Keys and value types without the values: what a surface check compares (IDs and timestamps vary)."""
    if isinstance(obj, dict):
        return {k: skeleton(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [skeleton(v) for v in obj]
    return type(obj).__name__


def call_shape(call: dict[str, Any]) -> dict[str, Any]:
    """A recorded call without its server-assigned IDs: the method, its exact arguments but IDs, the response's
    skeleton."""
    kwargs = {k: ("<id>" if k in ("id", "project") else v) for k, v in call["kwargs"].items()}
    response = call["response"]
    if call["method"] == "projects.list":  # other tests' projects on the same server are none of the scenario's
        response = [p for p in response if str(p.get("title", "")).startswith(SCENARIO_TITLE)]
    return {"method": call["method"], "kwargs": kwargs, "response": skeleton(response)}


# -------------------------------------------------------------------------------------------------- recorder
class Recorder:
    """Wraps a real `label_studio_sdk.client.LabelStudio`: every method call is made for real and recorded."""

    def __init__(self, client: Any, root: Path, calls: list[dict[str, Any]], signatures: dict[str, Any],
                 path: str = ""):
        self._client, self._root, self._calls, self._sigs, self._path = client, str(root), calls, signatures, path

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._client, name)
        path = f"{self._path}.{name}" if self._path else name
        if not inspect.ismethod(target):
            return Recorder(target, Path(self._root), self._calls, self._sigs, path)

        def call(*args: Any, **kwargs: Any) -> Any:
            if args:
                raise ExchangeMismatch(f"{path}: called with positional arguments {args!r}; the recording keeps "
                                       "argument names, so the connector passes keywords")
            self._sigs[path] = signature_record(type(self._client), name)
            result = target(**kwargs)
            if not (result is None or hasattr(result, "model_dump") or isinstance(result, (dict, list))):
                result = list(result)  # a pager: read it once, whole, as the connector does
            self._calls.append({"method": path, "kwargs": _swap(_jsonable(kwargs), self._root, ROOT),
                                "response": _swap(_jsonable(result), self._root, ROOT)})
            return result

        return call


# ------------------------------------------------------------------------------------------------ strict fake
class Strict(dict):
    """A recorded response object: the fields the server sent, nothing else."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"the recorded response has no field {name!r} "
                                 f"(it has {', '.join(sorted(self))})") from None

    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        if mode != "json":
            raise TypeError(f"model_dump(mode={mode!r}): the recording holds the JSON dump only")
        return copy.deepcopy(dict(self))


def _response(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_response(v) for v in obj]
    return Strict(obj) if isinstance(obj, dict) else obj


class RecordedLS:
    """A `LabelStudio` client that replays one recorded scenario and raises on anything else.

    `fail`: an exception every (signature-valid) call raises instead, for a server that cannot be reached.
    """

    def __init__(self, scenario: str, root: Path, *, exchange: dict[str, Any] | None = None,
                 fail: BaseException | None = None, _path: str = "", _state: dict[str, Any] | None = None):
        ex = exchange or json.loads(EXCHANGE.read_text(encoding="utf-8"))
        if _state is None:
            if scenario not in ex["scenarios"]:
                raise KeyError(f"{EXCHANGE.name} has no scenario {scenario!r}; re-record (see {__name__})")
            _state = {"calls": _swap(ex["scenarios"][scenario], ROOT, str(root)), "next": 0,
                      "signatures": ex["signatures"], "fail": fail, "scenario": scenario}
        self._state, self._path = _state, _path

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        path = f"{self._path}.{name}" if self._path else name
        sigs = self._state["signatures"]
        if path in sigs:
            return self._method(path, sigs[path])
        if any(m.startswith(path + ".") for m in sigs):
            return RecordedLS("", Path(), exchange={}, _path=path, _state=self._state)
        raise AttributeError(f"the recorded Label Studio SDK has no {path!r} (recorded: {', '.join(sorted(sigs))}); "
                             f"if the connector needs it, re-record {EXCHANGE.name}")

    def _method(self, path: str, sig: dict[str, Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            params = {p["name"]: p for p in sig["params"]}
            positional = [p for p in sig["params"] if p["kind"] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
            if len(args) > len(positional):
                raise TypeError(f"{path}{sig['text']}: takes {len(positional)} positional arguments, got {len(args)}")
            if args:
                raise ExchangeMismatch(f"{path}: positional arguments {args!r}; pass keywords (the recording keeps "
                                       "argument names)")
            takes_any = any(p["kind"] == "VAR_KEYWORD" for p in sig["params"])
            unknown = sorted(k for k in kwargs if k not in params or params[k]["kind"] == "VAR_KEYWORD")
            if unknown and not takes_any:
                raise TypeError(f"{path}{sig['text']}: unexpected keyword argument(s) {', '.join(unknown)}")
            missing = [n for n, p in params.items() if p["required"] and p["kind"] not in ("VAR_KEYWORD",
                       "VAR_POSITIONAL") and n not in kwargs]
            if missing:
                raise TypeError(f"{path}{sig['text']}: missing required argument(s) {', '.join(missing)}")
            if self._state["fail"] is not None:
                raise self._state["fail"]
            calls, i = self._state["calls"], self._state["next"]
            got = {"method": path, "kwargs": _jsonable(kwargs)}
            if i >= len(calls):
                raise ExchangeMismatch(f"scenario {self._state['scenario']!r}: call {i + 1} {got} is beyond the "
                                       f"{len(calls)} recorded calls")
            want = {"method": calls[i]["method"], "kwargs": calls[i]["kwargs"]}
            if got != want:
                raise ExchangeMismatch(f"scenario {self._state['scenario']!r}, call {i + 1}: the connector made\n"
                                       f"  {json.dumps(got)[:2000]}\nwhere the recording has\n"
                                       f"  {json.dumps(want)[:2000]}")
            self._state["next"] = i + 1
            self._state.setdefault("sent", []).append(got)
            return _response(copy.deepcopy(calls[i]["response"]))

        return call

    def sent(self, method: str) -> list[dict[str, Any]]:
        """The keyword arguments of every replayed call of `method` (what the connector sent)."""
        return [c["kwargs"] for c in self._state.get("sent", []) if c["method"] == method]

    def unused(self) -> list[str]:
        """The recorded calls not made (a scenario replayed in full leaves none)."""
        return [c["method"] for c in self._state["calls"][self._state["next"]:]]


# ------------------------------------------------------------------------------------------------- scenarios
def make_project(root: Path, title: str, *, n_selected: int = 4, **ls: Any) -> tuple[Any, set[str]]:
    """A project under `root` with round 0's export (`n_selected` of 6 tiny samples) and annotate.label_studio
    pointing at `title`. The URL is a placeholder: a scenario's client is passed in."""
    from conftest import make_tiny_vqa

    from pipeline.annotation.export import export_dir, export_selection
    from pipeline.config import parse_config

    ds, _ = make_tiny_vqa(root / "vqa", 6)
    cfg = parse_config({"paths": {"artifacts": str(root / "art")}, "data": {"answers": DIGITS},
                        # prepared: the recorded exchange holds the prepared PNGs' tasks (the default is legible).
                        "annotate": {"export_images": "prepared",
                                     "label_studio": {"url": "http://127.0.0.1:9", "project": title,
                                                      "token_env": TOKEN_ENV, **ls}}})
    sel = [{"sample_id": f"s{i:03d}", "rank": i, "score": 1.0, "scores": {}, "prediction": "1", "confidence": 0.5}
           for i in range(n_selected)]
    export_selection(sel, ds, cfg.annotate, cfg.data.answers, cfg.artifacts, export_dir(cfg.artifacts, 0), round_index=0)
    return cfg, set(ds["sample_id"])


# annotate(project_id, task_set, {sample_id: (label, lead_time or None)}): posts annotations on the real server; a
# no-op on replay, whose recorded responses already hold them.
Annotate = Callable[[int, str, dict[str, tuple[str, float | None]]], None]


def round_trip(root: Path, client: Any, annotate: Annotate) -> dict[str, Any]:
    """Push, re-push, pull (timed and untimed annotations), re-pull, a later pull beside a tamis correction, a
    re-label task set pushed beside the batch and its answer pulled as a correction."""
    from pipeline.annotation.export import export_dir
    from pipeline.annotation.label_studio import pull_labels, push_batch
    from pipeline.annotation.ledger import Ledger, ledger_path

    cfg, known = make_project(root, SCENARIO_TITLE + "round trip")
    batch = export_dir(cfg.artifacts, 0)
    out: dict[str, Any] = {"cfg": cfg, "known": known}
    out["push"] = push_batch(cfg.annotate, cfg.artifacts, batch, client=client)
    out["push_again"] = push_batch(cfg.annotate, cfg.artifacts, batch, client=client)
    pid = out["push"]["project"]
    out["pull_before"] = pull_labels(cfg.annotate, cfg.data, cfg.artifacts, known_ids=known, round_index=1, client=client)
    annotate(pid, "000/export", {"s000": ("3", 14.0), "s001": ("4", 9.5), "s002": ("5", None)})
    out["pull"] = pull_labels(cfg.annotate, cfg.data, cfg.artifacts, known_ids=known, round_index=1, client=client)
    out["repull"] = pull_labels(cfg.annotate, cfg.data, cfg.artifacts, known_ids=known, round_index=1, client=client)
    ledger = Ledger(ledger_path(cfg.artifacts))
    ledger.append([{**ledger.current()["s000"], "label": "8", "kind": "correction"}])  # corrected in tamis
    annotate(pid, "000/export", {"s003": ("6", 3.25)})
    out["pull_later"] = pull_labels(cfg.annotate, cfg.data, cfg.artifacts, known_ids=known, round_index=2, client=client)
    out["labels_after_later"] = ledger.labels()
    relabel = cfg.artifacts / "rounds" / "001" / "relabel"
    shutil.copytree(batch, relabel)
    out["push_relabel"] = push_batch(cfg.annotate, cfg.artifacts, relabel, client=client)
    out["push_relabel_again"] = push_batch(cfg.annotate, cfg.artifacts, relabel, client=client)
    annotate(pid, "001/relabel", {"s000": ("6", 7.0)})
    out["pull_relabel"] = pull_labels(cfg.annotate, cfg.data, cfg.artifacts, known_ids=known, round_index=2, client=client)
    return out


def by_id(root: Path, client: Any, annotate: Annotate, project: int) -> dict[str, Any]:
    """annotate.label_studio.project given as the numeric ID of an existing project: read, not listed by title."""
    from pipeline.annotation.label_studio import pull_labels

    cfg, known = make_project(root, "unused")
    cfg = cfg.model_copy(update={"annotate": cfg.annotate.model_copy(update={
        "label_studio": cfg.annotate.label_studio.model_copy(update={"project": project})})})
    return {"cfg": cfg, "pull": pull_labels(cfg.annotate, cfg.data, cfg.artifacts, known_ids=known, round_index=1, client=client)}


def inline(root: Path, client: Any, annotate: Annotate) -> dict[str, Any]:
    """images: inline: the tasks carry their images as data: URLs, no storage is attached."""
    from pipeline.annotation.export import export_dir
    from pipeline.annotation.label_studio import push_batch

    cfg, _ = make_project(root, SCENARIO_TITLE + "inline", n_selected=2, images="inline")
    return {"cfg": cfg, "push": push_batch(cfg.annotate, cfg.artifacts, export_dir(cfg.artifacts, 0), client=client)}


class _DropsSecondImport:
    """A client whose connection drops on the second import request (before it is sent)."""

    class _Projects:
        def __init__(self, projects: Any):
            self._projects, self._imports = projects, 0

        def __getattr__(self, name: str) -> Any:
            return getattr(self._projects, name)

        def import_tasks(self, **kw: Any) -> Any:
            self._imports += 1
            if self._imports == 2:
                raise ConnectionError("connection reset by peer (simulated)")
            return self._projects.import_tasks(**kw)

    def __init__(self, client: Any):
        self._client, self.projects = client, self._Projects(client.projects)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def interrupted_push(root: Path, client: Any, annotate: Annotate) -> dict[str, Any]:
    """A push in chunks of 2 that fails after its first chunk; the next push sends only the rest, a third nothing."""
    from pipeline.annotation import label_studio
    from pipeline.annotation.export import export_dir
    from pipeline.annotation.label_studio import push_batch

    cfg, _ = make_project(root, SCENARIO_TITLE + "interrupted push")
    batch, chunk = export_dir(cfg.artifacts, 0), label_studio.IMPORT_CHUNK
    label_studio.IMPORT_CHUNK = 2
    try:
        out = {"cfg": cfg, "failed": push_batch(cfg.annotate, cfg.artifacts, batch, client=_DropsSecondImport(client))}
        out["resumed"] = push_batch(cfg.annotate, cfg.artifacts, batch, client=client)
        out["again"] = push_batch(cfg.annotate, cfg.artifacts, batch, client=client)
    finally:
        label_studio.IMPORT_CHUNK = chunk
    return out


def run_scenarios(root: Path, client_for: Callable[[str, Path], Any], annotate: Annotate) -> dict[str, Any]:
    """Every scenario in order, each in its own folder under `root` with its own client (client_for(name, folder)).
    Returns name → the scenario's results."""
    res: dict[str, Any] = {}
    for name, fn in (("round_trip", round_trip), ("inline", inline), ("interrupted_push", interrupted_push)):
        folder = root / name
        res[name] = fn(folder, client_for(name, folder), annotate)
    folder = root / "by_id"
    res["by_id"] = by_id(folder, client_for("by_id", folder), annotate, res["round_trip"]["push"]["project"])
    return res
