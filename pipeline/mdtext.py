"""Text from users (answer names, annotator names, questions) placed in markdown that tamis writes.

A name is data, never markup: a `|` would shift a table's columns, `![](http://…)` would fetch a remote image when
the page is viewed, `<script>` would reach the page as HTML, and a newline would end a table row or start a heading.
A floor below every writer of markdown (the model card, the round summary), importing nothing of tamis.
"""

from __future__ import annotations

# CommonMark lets any ASCII punctuation be escaped with a backslash; these are the ones that make markup here: code
# spans, table cells, links and images, emphasis, and the backslash itself (so a name ending in one cannot escape
# what follows). `<`, `>` and `&` become entities, which every renderer reads as text, inside tables too.
_BACKSLASHED = frozenset("\\`|[]!*_")
_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}


def escape_md(text: str) -> str:
    """`text` as inline markdown that renders as exactly that text (line breaks become spaces), safe in a table
    cell, a list item or a heading."""
    out = []
    for ch in " ".join(str(text).splitlines()):
        if ch in _BACKSLASHED:
            out.append("\\" + ch)
        else:
            out.append(_ENTITIES.get(ch, ch))
    return "".join(out)


def _longest_backticks(text: str) -> int:
    longest = run = 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    return longest


def code_span(text: str) -> str:
    """`text` as inline code, verbatim (line breaks become spaces: a blank line would end the paragraph): delimited
    by one backtick more than its longest run of them, padded when it starts or ends with one."""
    text = " ".join(str(text).splitlines())
    ticks = "`" * (_longest_backticks(text) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def fenced(text: str, info: str = "") -> list[str]:
    """A fenced code block holding `text` verbatim: the fence is one backtick longer than any run of backticks in
    the text, so no line of it can close the block early."""
    fence = "`" * max(3, _longest_backticks(text) + 1)
    return [fence + info, *str(text).splitlines(), fence]
