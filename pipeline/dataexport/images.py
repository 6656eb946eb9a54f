"""Images beside the export under their own names: DIR/images/<the path under the project's image folder>.

The folder layout is the user's: each image's path relative to the deepest folder holding every image the project
ingested (so `cats/001.jpg` stays `images/cats/001.jpg` however few cats are labeled). Images that came as bytes
(a Hugging Face dataset source) have no file name and are written as `images/<sample_id>.<format>`. Two different
images whose names would collide (`A.jpg` and `a.jpg` on a case-insensitive disk) are told apart the same way on
every run: the first in name order keeps the name, the next gets `~<digest>` before its suffix; lineage.json lists
each renamed file. A file whose bytes are still the ingested ones is hard-linked when the export is on the same
filesystem (no copy), else copied; a file changed or gone since ingest is written from the ingested bytes, so the
image always matches its label.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TypeVar

IMAGES_DIR = "images"
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class SourceImage:
    """One labeled sample's image as the ingested dataset holds it."""

    sample_id: str
    image_path: str  # the file ingest read ("" when the source held bytes)
    digest: str  # of the ingested bytes


def common_root(paths: Iterable[str]) -> str | None:
    """The deepest folder holding every file in `paths` (empty ones skipped); None without any."""
    parents = sorted({os.path.dirname(p) for p in paths if p})
    return os.path.commonpath(parents) if parents else None


def _suffix(data: bytes) -> str:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return "." + (im.format or "png").lower().replace("jpeg", "jpg")


def own_name(img: SourceImage, root: str | None, data: bytes | None = None) -> str:
    """The image's path under images/, POSIX, from the user's layout (module docstring)."""
    if img.image_path and root is not None:
        rel = PurePosixPath(*Path(os.path.relpath(img.image_path, root)).parts)
        if ".." not in rel.parts:
            return f"{IMAGES_DIR}/{rel}"
    return f"{IMAGES_DIR}/{img.sample_id}{_suffix(data) if data is not None else ''}"


def place(named: Mapping[K, tuple[str, str]]) -> tuple[dict[K, str], list[dict[str, str]]]:
    """(image key → its file under the export, the renamed files) from image key (a sample ID, or (sample ID, its
    place) for samples of several images) → (own name, digest). The same
    bytes under the same name share one file; different bytes on a name already taken (compared without case, as
    macOS and Windows disks do) get `~<digest[:8]>` before the suffix, in name then digest order."""
    taken: dict[str, str] = {}  # casefolded name → digest that holds it
    chosen: dict[tuple[str, str], str] = {}
    renamed = []
    for name, digest in sorted(set(named.values())):
        final = name
        if taken.get(name.casefold(), digest) != digest:
            p = PurePosixPath(name)
            final = str(p.with_name(f"{p.stem}~{digest[:8]}{p.suffix}"))
            renamed.append({"file": final, "original": name})
        taken.setdefault(final.casefold(), digest)
        chosen[(name, digest)] = final
    return {sid: chosen[key] for sid, key in named.items()}, renamed


def write_file(dest: Path, source: str, data: bytes) -> str:
    """Put one image at `dest`: "linked" (hard link to the unchanged original), "copied" or "written" (from the
    ingested bytes, the original having changed or gone)."""
    src = Path(source) if source else None
    if src is not None and src.is_file() and src.stat().st_size == len(data) and src.read_bytes() == data:
        try:
            os.link(src, dest)
            return "linked"
        except OSError:  # another filesystem, or one without hard links
            shutil.copyfile(src, dest)
            return "copied"
    dest.write_bytes(data)
    return "written"


def write_images(out: Path, files: Mapping[K, str], sources: Mapping[K, SourceImage],
                 read: Callable[[K], bytes]) -> dict[str, int]:
    """out/images/ holding `files` (image key → path under out), swapped in whole once written (an earlier export's
    images/ is replaced). Not through store.atomic_dir: that resets file modes, which on a hard link would change the
    user's original. `read(key)`: the image's ingested bytes."""
    counts = {"linked": 0, "copied": 0, "written": 0}
    from pipeline.store import current_umask

    tmp = Path(tempfile.mkdtemp(dir=out, prefix=f".{IMAGES_DIR}.", suffix=".tmp"))
    os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it 0700
    try:
        done: set[str] = set()
        for sid, rel in sorted(files.items(), key=lambda kv: kv[1]):
            if rel in done:
                continue
            done.add(rel)
            dest = tmp / PurePosixPath(rel).relative_to(IMAGES_DIR)
            dest.parent.mkdir(parents=True, exist_ok=True)
            counts[write_file(dest, sources[sid].image_path, read(sid))] += 1
        final = out / IMAGES_DIR
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return counts
