"""Text from users (answer names, annotator names, file names, questions) placed in markdown that tamis writes.

A name is data, never markup: a `|` would shift a table's columns, `![](http://…)` would fetch a remote image when
the page is viewed, `<script>` would reach the page as HTML, and a newline would end a table row or start a heading.
A floor below every writer of markdown (the model card, the round summary), importing nothing of tamis.
"""

from __future__ import annotations

import re

# CommonMark lets any ASCII punctuation be backslash-escaped; these are the characters that start markup inline or in
# a GFM table cell: code, emphasis, links and images, table cells, raw HTML and autolinks, entities, headings, and
# the backslash itself (so a name ending in one cannot escape what follows).
MD_SPECIAL = frozenset("\\`*_[]()!|<>#&")
_LINE_BREAKS = re.compile(r"\r\n|[\r\n\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


def escape_md(text: str) -> str:
    """`text` as literal inline markdown (a table cell, a list item, a heading): each markup character
    backslash-escaped, line breaks turned into spaces (a newline would end the table row or the list item)."""
    escaped = "".join("\\" + c if c in MD_SPECIAL else c for c in str(text))
    return _LINE_BREAKS.sub(" ", escaped)


def _longest_backticks(text: str) -> int:
    longest = run = 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    return longest


def code_span(text: str) -> str:
    """`text` as inline code, verbatim (line breaks become spaces: a blank line would end the paragraph): delimited
    by one backtick more than its longest run of them, padded when it starts or ends with one."""
    text = _LINE_BREAKS.sub(" ", str(text))
    ticks = "`" * (_longest_backticks(text) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def fenced(text: str, info: str = "") -> list[str]:
    """A fenced code block holding `text` verbatim: the fence is one backtick longer than any run of backticks in
    the text, so no line of it can close the block early."""
    fence = "`" * max(3, _longest_backticks(text) + 1)
    return [fence + info, *str(text).splitlines(), fence]
