"""Samples written as conversations: TRL's, LLaMA-Factory's (sharegpt) and ms-swift's formats, parsed into one shape.

| kind | turns | image placeholders |
|---|---|---|
| `trl` | `messages`: `role` + `content`, a string or a list of `{"type": "text", "text": …}` / `{"type": "image"}` | one `{"type": "image"}` item per image |
| `sharegpt` | `conversations`: `from` (human / gpt / system) + `value` (names from dataset_info.json's `columns` / `tags`) | one `<image>` tag per image |
| `swift` | `messages`: `role` + `content` string | one `<image>` tag per image |

Every kind lists the sample's image files in `images`, in the order the placeholders use them. The label is the last
assistant turn; the user turn before it is the question; everything earlier (a system prompt, earlier user and
assistant turns) is the sample's context. A conversation that ends on a user turn is unlabeled (the pool). The
placeholders are taken out of the text; the images keep their order (where in which turn each sat is not kept: an
export puts every image in the first user turn, before its text, as tamis's own prompt does).

`parse` is pure: a record in, a Conversation or the reason it cannot be one (which ingest quarantines on its row).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

IMAGE_TAG = "<image>"
CONVERSATION_KINDS = ("trl", "sharegpt", "swift")


@dataclass(frozen=True)
class Conversation:
    images: tuple[str, ...]  # the image references as written (paths), in placeholder order
    question: str  # the last user turn's text, placeholders taken out
    answer: str | None  # the last assistant turn's text; None when the conversation ends on a user turn
    context: tuple[tuple[str, str], ...]  # (role, text) of every earlier turn: system, user, assistant


@dataclass(frozen=True)
class ShareGptColumns:
    """LLaMA-Factory's names for a sharegpt file (its dataset_info.json entry's `columns` and `tags`)."""

    messages: str = "conversations"
    images: str = "images"
    system: str | None = "system"
    role_tag: str = "from"
    content_tag: str = "value"
    roles: Mapping[str, str] = field(default_factory=lambda: {"human": "user", "gpt": "assistant",
                                                              "system": "system"})

    @classmethod
    def of_entry(cls, entry: Mapping[str, Any]) -> ShareGptColumns:
        cols, tags = entry.get("columns") or {}, entry.get("tags") or {}
        d = cls()
        return cls(cols.get("messages", d.messages), cols.get("images", d.images), cols.get("system", d.system),
                   tags.get("role_tag", d.role_tag), tags.get("content_tag", d.content_tag),
                   {tags.get("user_tag", "human"): "user", tags.get("assistant_tag", "gpt"): "assistant",
                    tags.get("system_tag", "system"): "system"})


def sharegpt_columns(data_file: Path) -> tuple[ShareGptColumns, str | None]:
    """(the column mapping of `data_file`, "dataset_info.json:<entry>" it came from) from the dataset_info.json beside
    it (the entry whose `file_name` is the file); (the sharegpt defaults, None) when none names it. ValueError when
    that dataset_info.json cannot be read, or reads the file as another format: skipping it would read the file with
    the wrong column names."""
    info = data_file.parent / "dataset_info.json"
    if not info.is_file():
        return ShareGptColumns(), None
    try:
        entries = json.loads(info.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{info}: not readable JSON ({exc}); fix it or move it away from {data_file.name}") from None
    for name, entry in (entries.items() if isinstance(entries, dict) else []):
        if isinstance(entry, dict) and Path(str(entry.get("file_name", ""))).name == data_file.name:
            if entry.get("formatting", "alpaca") != "sharegpt":
                raise ValueError(f"{info}: entry {name!r} reads {data_file.name} as {entry.get('formatting', 'alpaca')}"
                                 ", not sharegpt; use a sharegpt file (conversations) or set formatting: sharegpt")
            return ShareGptColumns.of_entry(entry), f"{info.name}:{name}"
    return ShareGptColumns(), None


def _typed_text(content: list[Any]) -> tuple[str, int] | str:
    """(text, image items) of TRL's typed content, or the problem."""
    texts, images = [], 0
    for item in content:
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "image":
            images += 1
        elif kind == "text":
            texts.append(str(item.get("text") or ""))
        else:
            return f"a content item {item!r} is neither {{'type': 'image'}} nor {{'type': 'text', 'text': ...}}"
    return "\n".join(t for t in texts if t.strip()), images


def _turns(rec: Mapping[str, Any], kind: str, cols: ShareGptColumns) -> list[tuple[str, str, int]] | str:
    """(role, text without placeholders, images it places) per turn, or the problem."""
    key, role_key, text_key = ((cols.messages, cols.role_tag, cols.content_tag) if kind == "sharegpt"
                               else ("messages", "role", "content"))
    msgs = rec.get(key)
    if not isinstance(msgs, list) or not msgs:
        return f"no turns: field {key!r} is {'missing' if key not in rec else 'not a non-empty list'}"
    out: list[tuple[str, str, int]] = []
    system = rec.get(cols.system) if kind == "sharegpt" and cols.system else None
    if isinstance(system, str) and system.strip():
        out.append(("system", system.strip(), 0))
    for i, m in enumerate(msgs, 1):
        if not isinstance(m, dict) or role_key not in m:
            return f"turn {i} is not an object with {role_key!r}"
        role = cols.roles.get(m[role_key]) if kind == "sharegpt" else m[role_key]
        if role not in ("system", "user", "assistant"):
            return f"turn {i} has role {m[role_key]!r}; tamis reads system, user and assistant turns"
        content = m.get(text_key)
        if kind == "trl" and isinstance(content, list):
            parsed = _typed_text(content)
            if isinstance(parsed, str):
                return f"turn {i}: {parsed}"
            text, n = parsed
        elif isinstance(content, str):
            n = content.count(IMAGE_TAG) if kind != "trl" else 0
            text = content.replace(IMAGE_TAG, "").strip() if kind != "trl" else content.strip()
        else:
            return f"turn {i}: {text_key!r} is {type(content).__name__}, not text"
        out.append((role, text, n))
    return out


def _order_problem(roles: list[str]) -> str | None:
    body = roles[1:] if roles and roles[0] == "system" else roles
    want = ["user", "assistant"] * (len(body) // 2 + 1)
    if body != want[:len(body)]:
        return (f"turns go {' → '.join(roles)}; a conversation is an optional system turn, then user and assistant "
                "turns alternating from a user turn")
    return None


def placeholder(kind: str) -> str:
    return "{'type': 'image'} item" if kind == "trl" else IMAGE_TAG + " tag"


def parse(rec: Mapping[str, Any], kind: str, cols: ShareGptColumns | None = None) -> Conversation | str:
    """The conversation `rec` holds (module docstring), or the reason it holds none a person can act on."""
    cols = cols or ShareGptColumns()
    turns = _turns(rec, kind, cols)
    if isinstance(turns, str):
        return turns
    problem = _order_problem([r for r, _, _ in turns])
    if problem:
        return problem
    key = cols.images if kind == "sharegpt" else "images"
    images = rec.get(key, [])
    if isinstance(images, str):
        images = [images]
    if not isinstance(images, list) or not all(isinstance(i, str) and i.strip() for i in images):
        return f"field {key!r} is not a list of image paths ({images!r}); list each image's path as a string"
    placed = sum(n for _, _, n in turns)
    if placed != len(images):
        return (f"{placed} {placeholder(kind)}(s) in its turns but {len(images)} image(s) in {key!r}; put one "
                f"{placeholder(kind)} per image in the user turns, in the order of {key!r}, or list only the images "
                "the turns show")
    if not images:
        return (f"no image: {key!r} is empty; tamis samples have at least one image (list it in {key!r} and put "
                f"one {placeholder(kind)} where it goes)")
    last = len(turns) - 1 if turns[-1][0] == "user" else len(turns) - 2
    answer = turns[-1][1] if turns[-1][0] == "assistant" else None
    return Conversation(tuple(i.strip() for i in images), turns[last][1], answer,
                        tuple((r, t) for r, t, _ in turns[:last]))
