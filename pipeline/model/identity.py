"""What a model is, for cache keys: its checkpoint's content and the versions of the libraries that run it.

The model section names a checkpoint (a folder or a hub ID); new weights at the same path, a hub ID that moved on,
or a torch / transformers / peft / bitsandbytes upgrade change what training, evaluation, scoring and the label check
compute without changing that name. So those stages key on `model.identity` as well (`keyed_model`):
- a local folder: sha256 over its files' relative paths and content digests, each digest from a persisted index
  (path, size, mtime, inode) → digest (pipeline/data/file_index.py), so an unchanged folder costs a `stat` per file
  and only a rewritten file is read again (a 16 GB checkpoint is read once);
- a hub ID: the commit it resolves to (the hub, unless offline, else the local cache's snapshot); one that cannot be
  resolved keys on the ID alone and says so in the log;
- the versions of torch, transformers, peft and bitsandbytes.
"""

from __future__ import annotations

import functools
import logging
import os
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline.config import ModelConfig
from pipeline.store import digest_json

log = logging.getLogger(__name__)

LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes")
INDEX_FILE = Path("train") / "model_file_index.npz"  # under artifacts/


def library_versions() -> dict[str, str]:
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def folder_digest(folder: Path, artifacts: str | os.PathLike[str] | None) -> str:
    """sha256 over (relative path, content digest) of every file in `folder` (hidden ones aside: download caches,
    .DS_Store), the digests from the persisted index under `artifacts`."""
    from pipeline.data.file_index import FileIndex

    index = FileIndex(None if artifacts is None else Path(artifacts) / INDEX_FILE)
    files = sorted(p for p in folder.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    rows = [(p.relative_to(folder).as_posix(), index.digest(p.resolve())) for p in files]
    index.save()
    return digest_json(rows)


@functools.lru_cache(maxsize=16)  # a round keys four stages on it: ask the hub once per process
def hub_revision(name: str) -> str | None:
    """The commit a hub ID resolves to now: asked of the hub unless HF_HUB_OFFLINE, else the cached snapshot's."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.utils import HfHubHTTPError

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("1", "true", "True", "YES", "yes"):
        try:
            return HfApi().model_info(name).sha
        except (HfHubHTTPError, OSError, ValueError) as exc:
            log.warning("model %s: the hub did not answer (%s); keying on the cached snapshot", name, exc)
    try:
        return Path(snapshot_download(name, local_files_only=True)).name
    except Exception:  # not in the cache (LocalEntryNotFoundError and friends): nothing to resolve
        return None


def model_identity(model: ModelConfig, artifacts: str | os.PathLike[str] | None) -> dict[str, Any]:
    """{"checkpoint": what the weights are, "libraries": versions}: the part of a model's key its name misses."""
    path = Path(model.name_or_path)
    if path.is_absolute() and not path.exists() and model.build_tiny_if_missing:
        from pipeline.model.loading import _resolve_source

        _resolve_source(model)  # built now, so the key is the built folder's from the first round on
    if path.is_dir():
        checkpoint = "sha256:" + folder_digest(path, artifacts)
    else:
        rev = hub_revision(model.name_or_path)
        if rev is None:
            log.warning("model %s: its hub revision cannot be resolved (offline, not cached); caches key on the ID "
                        "alone", model.name_or_path)
        checkpoint = f"hub:{model.name_or_path}@{rev or 'unresolved'}"
    return {"checkpoint": checkpoint, "libraries": library_versions()}


def with_identity(model: ModelConfig, artifacts: str | os.PathLike[str] | None) -> ModelConfig:
    """The model section as the train, evaluate, score and label-check stages take it (their key): with its
    identity filled in."""
    return model.model_copy(update={"identity": model_identity(model, artifacts)})


def keyed_model(model: ModelConfig, artifacts: str | os.PathLike[str] | None) -> dict[str, Any]:
    """`with_identity` as the plain JSON data a stage's parameters hold."""
    return with_identity(model, artifacts).model_dump(mode="json")
