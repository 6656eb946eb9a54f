"""Where the model comes from, decided before any heavy stage: a local folder, the HF cache, or the hub.

A round used to find out that its hub model was unreachable only when it loaded it, after preparing and
quality-checking every image, and then transformers retried each file URL several times. `resolve_model` answers in
seconds, through huggingface_hub's own API: a local folder (or a tiny stand-in the config asks to build); a snapshot
already in the HF cache (`snapshot_download(local_files_only=True)`: the round works offline from it, and says so);
else the hub, asked once with a short timeout (no retries) unless HF_HUB_OFFLINE is set. Offline or unreachable, it
raises one ModelError naming the fixes: download the model elsewhere and point model.name_or_path at the folder, or a
tiny stand-in (`tamis make-tiny-model`, model.build_tiny_if_missing).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.config import ModelConfig
from pipeline.errors import ModelError, ModelUnreachable

log = logging.getLogger(__name__)

# One request to the hub, this long at most: a machine that cannot reach it learns so in seconds.
HUB_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ResolvedModel:
    """What `model.name_or_path` names and where it is: `folder` (a local checkpoint), `tiny` (a local folder the
    round builds: model.build_tiny_if_missing), `cache` (a snapshot in the HF cache at `path`) or `hub` (reachable,
    downloaded into the HF cache when first loaded). `note` is the sentence a command prints."""

    name: str
    where: Literal["folder", "tiny", "cache", "hub"]
    path: str | None
    note: str


def looks_local(name: str) -> bool:
    """A path rather than a hub ID: absolute, existing, or starting with ./ ../ ~ (a hub ID is `org/name`)."""
    path = Path(name)
    return path.is_absolute() or path.exists() or name.startswith((".", "~")) or name.count("/") > 1


def fixes(name: str, family: str | None) -> str:
    """The ways out when a hub model cannot be had here: the sentence every refusal ends with."""
    fam = family if family not in (None, "auto") else "idefics3"
    return (f"either download it on a machine that can reach the hub (`hf download {name} --local-dir models/"
            f"{name.rsplit('/', 1)[-1]}`), copy that folder here and set model.name_or_path to it; or use a tiny "
            f"random-weight stand-in to try the loop: `tamis make-tiny-model --family {fam} --out models/tiny` and "
            "point model.name_or_path at it (or set model.build_tiny_if_missing: true with a local path)")


def _local(name: str, family: str | None, build_tiny: bool) -> ResolvedModel:
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return ResolvedModel(name, "folder", str(path), f"model: local folder {path}")
    if path.exists():
        raise ModelError(f"{path}: not a model folder (no config.json); point model.name_or_path at a saved "
                         "checkpoint folder (config.json, weights, processor files)")
    if build_tiny:
        if family in (None, "auto"):
            raise ModelError(f"{path}: missing, and model.build_tiny_if_missing needs model.family to know which "
                             "tiny model to build; set model.family (e.g. idefics3)")
        return ResolvedModel(name, "tiny", str(path), f"model: {path} is missing; a tiny random-weight {family} "
                             "model will be built there (model.build_tiny_if_missing)")
    raise ModelError(f"{path}: model folder does not exist; build a tiny stand-in with `tamis make-tiny-model "
                     f"--family {family if family not in (None, 'auto') else 'idefics3'} --out {path}`, set "
                     "model.build_tiny_if_missing: true, or point model.name_or_path at a checkpoint folder")


def _from_cache(name: str) -> str | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(name, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None
    return folder if (Path(folder) / "config.json").is_file() else None


def resolve_model(name: str, *, family: str | None = None, build_tiny_if_missing: bool = False,
                  timeout_s: float = HUB_TIMEOUT_S) -> ResolvedModel:
    """Resolve `model.name_or_path` (module docstring); raises ModelError naming the fixes when it cannot be had."""
    if looks_local(name):
        return _local(name, family, build_tiny_if_missing)
    cached = _from_cache(name)
    if cached is not None:
        return ResolvedModel(name, "cache", cached, f"model: {name} from the HF cache snapshot {cached} (works "
                             "offline; set HF_HUB_OFFLINE=1 to never ask the hub for updates)")
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if constants.is_offline_mode():
        raise ModelUnreachable(f"model.name_or_path {name!r}: not in the HF cache ({constants.HF_HUB_CACHE}) and "
                               "the hub is off (HF_HUB_OFFLINE is set), so this round cannot load it; "
                               f"{fixes(name, family)}")
    try:
        HfApi().model_info(name, timeout=timeout_s)
    except GatedRepoError:
        raise ModelError(f"model.name_or_path {name!r}: a gated model on the hub; accept its licence on its hub page "
                         "and log in (`hf auth login`), or " + fixes(name, family)) from None
    except RepositoryNotFoundError:
        raise ModelError(f"model.name_or_path {name!r}: no such model on the hub ({constants.ENDPOINT}) and no such "
                         "local folder; check its spelling, or point it at a checkpoint folder") from None
    except Exception as exc:  # noqa: BLE001 - a refused connection, a timeout, a proxy: the hub is out of reach
        raise ModelUnreachable(f"model.name_or_path {name!r}: not in the HF cache ({constants.HF_HUB_CACHE}) and "
                               f"the hub ({constants.ENDPOINT}) did not answer within {timeout_s:g} s "
                               f"({type(exc).__name__}); {fixes(name, family)}") from None
    return ResolvedModel(name, "hub", None, f"model: {name} from the hub ({constants.ENDPOINT}), downloaded into the "
                         "HF cache when first loaded")


def resolve_configured(model_cfg: ModelConfig) -> ResolvedModel:
    """resolve_model for the model section (its name_or_path, family and build_tiny_if_missing)."""
    return resolve_model(model_cfg.name_or_path, family=model_cfg.family,
                         build_tiny_if_missing=model_cfg.build_tiny_if_missing)


def local_folder(resolved: ResolvedModel) -> str:
    """A local folder holding the resolved model: its own, the cache snapshot, or the hub's download into the cache
    (for commands that read the checkpoint's files, as `tamis check-model` does)."""
    if resolved.path is not None:
        return resolved.path
    from huggingface_hub import snapshot_download

    log.info("downloading %s into the HF cache", resolved.name)
    return snapshot_download(resolved.name)
