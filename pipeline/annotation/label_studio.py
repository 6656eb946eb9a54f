"""A live Label Studio project (annotate.label_studio), through the official `label-studio-sdk`.

A round pushes its exported batch (tasks with the model's predictions, the labeling interface) and a later round
pulls the finished annotations back through the same importer as a dropped-in export, so matching, validation,
conflicts and idempotence are the same. The API token is read from the environment variable the config names and
goes nowhere else: not into artifacts, manifests, round state or log lines.

Pulled annotations are written as a Label Studio JSON export under artifacts/label_studio/project-<id>/ (sorted,
without timestamps) and imported from there; artifacts/label_studio/project-<id>/pulled.json lists the annotations
already imported, so a re-pull with nothing new imports nothing.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pipeline.annotation.export import LABEL_CONFIG_FILE, TASKS_FILE
from pipeline.config import AnnotateConfig, DataConfig, LabelStudioConfig
from pipeline.errors import ConfigError, TamisError
from pipeline.store import atomic_write_text, digest_bytes, digest_json

log = logging.getLogger(__name__)

STATE_DIR = "label_studio"
STORAGE_TITLE = "tamis exports"
PULLED_FILE = "pulled.json"  # annotation keys already pulled into the ledger
IMPORT_CHUNK = 100  # tasks per import request


class LabelStudioError(TamisError):
    """Label Studio could not be reached or refused a request; the message never holds the token."""


def _sdk() -> Any:
    try:
        from label_studio_sdk.client import LabelStudio
    except ImportError:
        raise ConfigError(
            "annotate.label_studio needs the Label Studio SDK: pip install 'tamis[labelstudio]' (or "
            "pip install label-studio-sdk)"
        ) from None
    return LabelStudio


def token_from_env(ls: LabelStudioConfig) -> str:
    token = os.environ.get(ls.token_env, "").strip()
    if not token:
        raise ConfigError(
            f"annotate.label_studio: the environment variable {ls.token_env} is not set; export your Label Studio "
            "access token there (Account & Settings → Access Token), it is never read from the config file"
        )
    return token


def _safe(exc: BaseException, token: str) -> str:
    """An exception's text with the token masked; an API error gives its status and body only (its headers hold a
    session cookie)."""
    status, body = getattr(exc, "status_code", None), getattr(exc, "body", None)
    if status is not None:
        if isinstance(body, dict):
            body = {k: body[k] for k in ("detail", "validation_errors") if body.get(k)} or body
        text = f"HTTP {status}: {body}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return text.replace(token, "***") if token else text


class LabelStudioProject:
    """One Label Studio project: created or updated with tamis's labeling interface on first use."""

    def __init__(self, annotate: AnnotateConfig, artifacts: str | os.PathLike[str], client: Any | None = None):
        if annotate.label_studio is None:
            raise ConfigError("annotate.label_studio is not set; add {url, project, token_env} to the config")
        self.annotate, self.artifacts = annotate, Path(artifacts)
        self.ls = annotate.label_studio
        self._token = token_from_env(self.ls)
        self.client = client or _sdk()(base_url=self.ls.url, api_key=self._token)
        self._id: int | None = None

    def _call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except TamisError:
            raise
        except Exception as exc:  # noqa: BLE001 - any SDK / HTTP failure is the same user-facing fault
            raise LabelStudioError(f"Label Studio at {self.ls.url}: {what} failed ({_safe(exc, self._token)})") from None

    # ------------------------------------------------------------------------------------------------ project
    def project_id(self, label_config: str | None = None) -> int:
        """The project's ID: `project` itself when a number, else the project with that title (created if none)."""
        if self._id is not None:
            return self._id
        projects = self.client.projects
        if isinstance(self.ls.project, int):
            p = self._call(f"reading project {self.ls.project}", projects.get, id=self.ls.project)
        else:
            found = [p for p in self._call("listing projects", lambda: list(projects.list()))
                     if getattr(p, "title", None) == self.ls.project]
            if len(found) > 1:
                raise LabelStudioError(f"Label Studio at {self.ls.url}: {len(found)} projects are titled "
                                       f"{self.ls.project!r} (IDs {', '.join(str(p.id) for p in found)}); set "
                                       "annotate.label_studio.project to one of these IDs")
            p = found[0] if found else None
            if p is None:
                if label_config is None:
                    raise LabelStudioError(f"Label Studio at {self.ls.url}: no project titled {self.ls.project!r} "
                                           "yet; a round creates it when it pushes its first batch")
                p = self._call(f"creating project {self.ls.project!r}", projects.create, title=self.ls.project,
                               label_config=label_config)
                log.info("Label Studio: created project %s (%r)", p.id, self.ls.project)
        self._id = int(p.id)
        if label_config is not None and (getattr(p, "label_config", "") or "").strip() != label_config.strip():
            self._call(f"updating the labeling interface of project {self._id}", projects.update, id=self._id,
                       label_config=label_config)
            log.info("Label Studio: project %s labeling interface set from %s", self._id, LABEL_CONFIG_FILE)
        return self._id

    def _tasks(self, pid: int) -> list[Any]:
        return self._call(f"listing the tasks of project {pid}",
                          lambda: list(self.client.tasks.list(project=pid, fields="all")))

    def _ensure_storage(self, pid: int, export_dir: Path) -> None:
        """Attach a Local Files storage over the rounds' folders: Label Studio serves /data/local-files/ only from
        one, and only from a strict sub-folder of its document root (annotate.document_root)."""
        root = (Path(self.annotate.document_root) if self.annotate.document_root else self.artifacts).resolve()
        export_dir = export_dir.resolve()
        local = self.client.import_storage.local
        have = self._call("listing local storages", lambda: list(local.list(project=pid)))
        if any(getattr(s, "path", None) and export_dir.is_relative_to(Path(s.path)) for s in have):
            return
        folder = (Path(self.artifacts) / "rounds").resolve()
        if not (folder.is_relative_to(root) and folder != root and export_dir.is_relative_to(folder)):
            folder = export_dir  # the exporter already checked it is a strict sub-folder of the document root
        self._call(f"attaching a Local Files storage on {folder}", local.create, project=pid, path=str(folder),
                   title=STORAGE_TITLE, use_blob_urls=False)

    # --------------------------------------------------------------------------------------------------- push
    def push(self, export_dir: str | os.PathLike[str]) -> dict[str, Any]:
        """Import an exported task set's tasks (with predictions) the project does not have yet.

        Idempotent by (sample_id, task set): each task carries `data.tamis_set` (e.g. "001/export", "001/relabel"),
        so a re-label task for a sample labeled before is a new task. Tasks go in requests of IMPORT_CHUNK, so a push
        that dies part-way is finished by the next one. Returns {"project", "pushed", "already"}.
        """
        export_dir = Path(export_dir)
        tasks = json.loads((export_dir / TASKS_FILE).read_text(encoding="utf-8"))
        label_config = (export_dir / LABEL_CONFIG_FILE).read_text(encoding="utf-8")
        pid = self.project_id(label_config)
        task_set = task_set_name(self.artifacts, export_dir)
        have = {(str(d.get("sample_id")), d.get("tamis_set")) for t in self._tasks(pid)
                if isinstance(d := _plain(t).get("data"), dict)}
        new = [{**t, "data": {**t["data"], "tamis_set": task_set}} for t in tasks
               if (t["data"]["sample_id"], task_set) not in have]
        if new and self.ls.images == "inline":
            new = [_inline(t, export_dir) for t in new]
        elif new:
            self._ensure_storage(pid, export_dir)
        # In chunks, in export order: a push killed or failing part-way leaves whole chunks on the server, and the
        # next push (which skips tasks already there) sends the rest, so the project ends as one uninterrupted push
        # leaves it. One request per chunk also stays far below Label Studio's 200 MB request limit with inline
        # images.
        for start in range(0, len(new), IMPORT_CHUNK):
            chunk = new[start:start + IMPORT_CHUNK]
            self._call(f"importing tasks {start + 1}-{start + len(chunk)} of {len(new)} into project {pid}",
                       self.client.projects.import_tasks, id=pid, request=chunk)
        log.info("Label Studio: project %s ← %d new tasks from %s (%d already there)", pid, len(new), export_dir,
                 len(tasks) - len(new))
        return {"project": pid, "pushed": len(new), "already": len(tasks) - len(new)}

    # --------------------------------------------------------------------------------------------------- pull
    def _state_path(self, pid: int) -> Path:
        return pulled_path(self.artifacts, pid)

    def pulled(self, pid: int) -> set[str]:
        p = self._state_path(pid)
        return set(json.loads(p.read_text(encoding="utf-8"))) if p.is_file() else set()

    def pull(self) -> tuple[Path | None, set[str]]:
        """Write the tasks with annotations not pulled before as a Label Studio JSON export.

        Returns (the file or None when nothing is new, the annotation keys it holds). A task is pulled whole (all its
        annotations, so votes stay complete) when any of its annotations is new or was edited since the last pull;
        tasks pulled before are not, so a label corrected in tamis afterwards is never reverted by a re-pull. Call
        `mark_pulled` once the file is imported.
        """
        pid = self.project_id()
        seen = self.pulled(pid)
        tasks = sorted((_task_json(t) for t in self._tasks(pid)), key=lambda t: t["id"])
        new = [t for t in tasks if t["annotations"] and not {annotation_key(a) for a in t["annotations"]} <= seen]
        if not new:
            log.info("Label Studio: project %s has no new annotations", pid)
            return None, set()
        text = json.dumps(new, sort_keys=True, indent=1, ensure_ascii=False) + "\n"
        out = self._state_path(pid).parent / f"pull-{digest_bytes(text.encode())[:16]}.json"
        if not out.is_file():
            atomic_write_text(out, text)
        log.info("Label Studio: project %s → %d tasks with new annotations in %s", pid, len(new), out)
        return out, {annotation_key(a) for t in new for a in t["annotations"]}

    def mark_pulled(self, keys: set[str]) -> None:
        pid = self.project_id()
        atomic_write_text(self._state_path(pid), json.dumps(sorted(self.pulled(pid) | keys), indent=0) + "\n")


def pulled_path(artifacts: str | os.PathLike[str], pid: int) -> Path:
    """The annotation keys already pulled from project `pid` into the ledger."""
    return Path(artifacts) / STATE_DIR / f"project-{pid}" / PULLED_FILE


def task_set_name(artifacts: str | os.PathLike[str], export_dir: str | os.PathLike[str]) -> str:
    """The `data.tamis_set` of an exported task set's tasks: its folder under rounds/, e.g. "001/export"."""
    rounds, where = (Path(artifacts) / "rounds").resolve(), Path(export_dir).resolve()
    return where.relative_to(rounds).as_posix() if where.is_relative_to(rounds) else where.name


def annotation_key(a: Mapping[str, Any]) -> str:
    """An annotation as pulled: its ID and its content, so an annotation edited in Label Studio is pulled again."""
    return f"{a.get('id')}:{digest_json([a.get('result'), a.get('was_cancelled')])[:12]}"


PULL_FAILED = "pull_failed"  # marks the import record of a pull that did not reach (or was refused by) Label Studio


def pull_labels(annotate: AnnotateConfig, data: DataConfig, artifacts: str | os.PathLike[str], *, known_ids: Any,
                round_index: int, client: Any | None = None) -> list[dict[str, Any]]:
    """Pull new annotations from annotate.label_studio into the ledger through the file importer.

    Returns import records like the inbox's (ImportReport.record: counts, summary, first rejected rows, or
    {"file", "error"} when Label Studio cannot be reached or the pull is refused); [] when not configured.
    """
    from pipeline.annotation.labels import LabelKeys, import_labels
    from pipeline.annotation.ledger import Ledger, ledger_path
    from pipeline.errors import LabelImportError

    if annotate.label_studio is None:
        return []
    artifacts = Path(artifacts)
    where = f"Label Studio {annotate.label_studio.url} project {annotate.label_studio.project!r}"
    try:
        project = LabelStudioProject(annotate, artifacts, client)
        path, keys = project.pull()
        if path is None:
            return []
        rep = import_labels(path, known_ids=known_ids, answers=data.scored_answers,
                            ledger=Ledger(ledger_path(artifacts)), round_index=round_index,
                            rejections_dir=artifacts / "rejections", keys=LabelKeys.from_config(data),
                            aliases=data.answer_aliases)
        project.mark_pulled(keys)
    except (LabelStudioError, LabelImportError) as exc:
        log.error("%s: nothing imported: %s", where, exc)
        return [{"file": where, "error": str(exc), PULL_FAILED: True}]
    return [rep.record()]


def push_batch(annotate: AnnotateConfig, artifacts: str | os.PathLike[str], export_dir: str | os.PathLike[str],
               client: Any | None = None) -> dict[str, Any]:
    """Push an exported batch to annotate.label_studio; {"project", "pushed", "already"} or {"error"}."""
    try:
        return LabelStudioProject(annotate, artifacts, client).push(export_dir)
    except LabelStudioError as exc:
        log.error("batch %s not pushed: %s", export_dir, exc)
        return {"error": str(exc)}


def _inline(task: Mapping[str, Any], export_dir: Path) -> dict[str, Any]:
    """The task with its image as a data: URL (no file serving needed)."""
    name = str(task["data"]["image"]).rsplit("/", 1)[-1]
    data = (export_dir / "images" / name).read_bytes()
    ext = name.rsplit(".", 1)[-1].lower()
    mime = {"jpg": "jpeg", "tif": "tiff"}.get(ext, ext)
    t = json.loads(json.dumps(task))
    t["data"]["image"] = f"data:image/{mime};base64,{base64.b64encode(data).decode()}"
    return t


def _plain(obj: Any) -> Any:
    """SDK models (pydantic) and plain dicts alike → JSON data."""
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


# lead_time: the annotator's seconds on the task (Label Studio records it; the annotation-time log keeps it).
_ANNOTATION_KEYS = ("id", "completed_by", "result", "was_cancelled", "ground_truth", "lead_time")


def _task_json(task: Any) -> dict[str, Any]:
    """The parts of a task the importer reads (no timestamps: an unchanged project pulls identical bytes)."""
    t = _plain(task)
    data = t.get("data") or {}
    if isinstance(data.get("image"), str) and data["image"].startswith("data:"):
        data = {**data, "image": "(inline image)"}  # the sample_id in data names the sample; keep the pull small
    anns: Iterable[Any] = t.get("annotations") or []
    return {
        "id": t.get("id"),
        "data": data,
        "meta": t.get("meta") or {},
        "annotations": sorted(({k: a.get(k) for k in _ANNOTATION_KEYS if k in a} for a in map(_plain, anns)),
                              key=lambda a: a.get("id") or 0),
    }
