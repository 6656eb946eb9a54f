"""What `tamis init` found in one source (Found) and the image sizes it reads from a sample of headers; shared by the
detectors (detect.py, conversations.py) and the config it renders."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.project_init.tables import IMAGE_SUFFIXES

SIZE_SAMPLE = 200  # images whose header is read for their size (the preprocess size reads their median)


@dataclass
class Found:
    """One source as `tamis init` writes it (`source`: a data.sources entry) and what it holds."""

    source: dict[str, Any]
    images: int
    labeled: int
    answers: list[str] = field(default_factory=list)  # the answers seen (class folders, answer cells)
    sizes: list[tuple[int, int]] = field(default_factory=list)  # (width, height) of a sample of its images
    what: str = ""  # one line for the report: "flat folder of 1,000 images (unlabeled pool)"
    counts: dict[str, int] = field(default_factory=dict)  # labeled images per answer
    test: int = 0  # rows in the test split (a split cell saying test, or a --test file)
    test_counts: dict[str, int] = field(default_factory=dict)  # labeled test rows per answer
    free_text: bool = False  # answers typed per row (a manifest's cells), not class folder names
    box_classes: list[str] = field(default_factory=list)  # a COCO file's categories: the project labels boxes


def _is_image(name: str) -> bool:
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_SUFFIXES


def image_sizes(paths: list[Path], limit: int = SIZE_SAMPLE) -> list[tuple[int, int]]:
    """(width, height) of up to `limit` of `paths`, spread over the list; reads headers only. Unreadable files are
    left to ingest, which quarantines them with a reason."""
    from PIL import Image

    step = max(1, len(paths) // limit)
    out = []
    for p in paths[::step][:limit]:
        try:
            with Image.open(p) as im:
                out.append(im.size)
        except (OSError, ValueError, Image.DecompressionBombError):
            continue
    return out
