"""The row contract every stage shares. Readers produce these columns; later stages add theirs beside them.

Ingested dataset (Hugging Face `datasets`, Arrow, saved with `save_to_disk`):

    sample_id   str          stable content digest of image bytes + question (see `sample_id_for`)
    image       bytes        the original encoded image file, exactly as read (validated by a full decode)
    image_path  str          absolute path of the image file ("" when the source held bytes, e.g. an HF dataset)
    question    str          the text asked about the image (prompt)
    answer      str | None   the label / reference answer when the source has one
    split       str          "train" (labeled seed), "pool" (unlabeled, selectable) or "test" (evaluation)
    source      str          where the row came from: "<file>:<line>" / "<folder>/<file>"
    sources     list[str]    every source of this content (exact duplicates are collapsed into one row)
    width       int          after EXIF transpose
    height      int
    mode        str          the decoded PIL mode before conversion (e.g. "CMYK", "I;16", "P", "RGBA")
    external_id str | None   the source's own ID of the row (its `id_column`, default "id"); label files may use it

A project with a conversation source (kind trl / sharegpt / swift, pipeline/data/conversations.py) has two more
columns, on every row (empty lists on a one-image row); a project without one has neither, so its rows, IDs and
cache keys are those it always had:

    more_images list[struct]   the sample's 2nd..Nth images, in order, each {image, image_path, width, height, mode}
                               as the first image's columns above (which stay the first image: a stage that reads one
                               image reads the sample's first)
    context     list[struct]   the turns before `question`, oldest first, each {role: system|user|assistant, text}

A sample's ID covers every image and turn (`sample_id_of`); one image and no context is `sample_id_for`'s ID, so
the same picture and question is the same sample whichever source it came from.

Prepared dataset adds:

    prepared    bytes        PNG of the preprocessed RGB image (aspect kept; optional square pad)
    prep_width  int
    prep_height int

Quality table (a separate Arrow/JSON output keyed by sample_id): flags list[str], reasons list[str], excluded bool,
blur_score float.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.store import canonical_json, digest_bytes

# Column names that mean "the answer" in a table of images: a source's manifest (`tamis init`) or a label file.
ANSWER_NAMES = ("answer", "label", "labels", "category", "class", "target", "caption", "y")


def answer_column(columns: list[str]) -> str | None:
    """The answer column among a table's other columns (its image and key columns left out): the first named like
    an answer (ANSWER_NAMES, any case), else the only column there is; None when neither tells."""
    low = {c.lower(): c for c in columns}
    return next((low[n] for n in ANSWER_NAMES if n in low), None) or (columns[0] if len(columns) == 1 else None)


SPLITS = ("train", "pool", "test")
# A question longer than this is refused on its row (ingest quarantines it, predict answers it with the reason):
# ~1,000 tokens, more than any VQA prompt, while a 5 MB one would be tokenized into a million positions past the
# model's context and abort the whole run.
MAX_QUESTION_CHARS = 4_000
INGEST_COLUMNS = (
    "sample_id", "image", "image_path", "question", "answer", "split", "source", "sources", "width", "height", "mode",
    "external_id",
)


def sample_id_for(image_bytes: bytes, question: str) -> str:
    """Stable ID from content alone, so the same sample keeps its ID across runs and sources.

    80 bits of sha256 (20 hex chars): collision-free in practice for any pool, short enough for file names.
    """
    return digest_bytes(image_bytes + b"\0" + question.encode("utf-8"))[:20]


MORE_COLUMNS = ("more_images", "context")


def sample_id_of(images: Sequence[bytes], question: str, context: Sequence[tuple[str, str]] = ()) -> str:
    """The ID of a sample of several images or turns: sample_id_for's when there is one image and no context, else
    a digest of every image's digest in order, the context and the question (module docstring)."""
    if len(images) == 1 and not context:
        return sample_id_for(images[0], question)
    parts = [digest_bytes(i) for i in images]
    return digest_bytes(canonical_json([parts, [list(c) for c in context], question]).encode("utf-8"))[:20]


@dataclass(frozen=True)
class Question:
    """What a sample asks beyond one image and one question: its earlier turns and how many pictures it shows.

    `context` is (role, text) pairs (system, user, assistant) that come before the question; `images` is the count of
    image items its chat holds (all at the start of the first user turn, in order, as an export writes them).
    `Question(text)` is a one-image sample's: the chat a family renders from it is byte for byte a plain string's."""

    text: str
    context: tuple[tuple[str, str], ...] = ()
    images: int = 1


def sample_chat(row: Mapping[str, Any]) -> tuple[list[bytes], str | Question]:
    """A prepared row's pictures (PNG bytes: `prepared`, then `more_prepared`'s) and what it asks: its question string
    when it has one picture and no earlier turns (the inputs a one-image project always had), else a Question."""
    pngs = [row["prepared"], *(row.get("more_prepared") or [])]
    context = tuple((c["role"], c["text"]) for c in row.get("context") or [])
    if len(pngs) == 1 and not context:
        return pngs, row["question"]
    return pngs, Question(row["question"], context, len(pngs))


def display_name(image_path: str | None, source: str | None, sample_id: str) -> str:
    """What a person knows a sample by: its image file's name (`image_path`'s last part), else its `source`
    (`<file>:<line>` of a manifest, or a Hugging Face dataset's row) when the row held bytes, else the sample ID.
    Cards and lists a person reads show this first and the sample ID second."""
    if image_path:
        return image_path.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1] or sample_id
    return source or sample_id
