"""User text (class names, annotator names, file names, questions) placed into markdown that tamis writes, as inert
text: a `|` must not shift a table's columns, `![](http://…)` must not fetch a remote image when the markdown is
viewed, and `<script>` must not reach the renderer as HTML."""

from __future__ import annotations

import re

# CommonMark lets any ASCII punctuation be backslash-escaped; these are the characters that start markup inline or
# in a GFM table cell: code, emphasis, links and images, table cells, raw HTML and autolinks, headings.
MD_SPECIAL = frozenset("\\`*_[]()!|<>#")
_LINE_BREAKS = re.compile(r"\r\n|[\r\n\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


def escape_md(text: str) -> str:
    """`text` as literal inline markdown (a table cell, a list item): each markup character backslash-escaped, line
    breaks turned into spaces (a newline would end the table row or the list item)."""
    escaped = "".join("\\" + c if c in MD_SPECIAL else c for c in str(text))
    return _LINE_BREAKS.sub(" ", escaped)
