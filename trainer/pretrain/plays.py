"""The embedded plays (Markdown) as plain play text: `NAME:` on its own line, then the speech.

The Markdown marks a speaker as `**ROMEO**` with a trailing two-space line break, stage directions as
`_Exit_` and `_\\[Aside]_`, acts and scenes as headings. A model trained on that learns `**` and trailing
spaces before it learns speech, and a prompt of `ROMEO:` matches nothing it has seen. Rendered:

    ROMEO:
    But, soft! what light through yonder window breaks?

Acts, scenes and stage directions stay, as plain lines.
"""
from __future__ import annotations

import re

_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+?)\*\*\s*$")
_HEADING = re.compile(r"^#{1,6}\s+")
_ESCAPED = re.compile(r"\\([\\`*_{}\[\]()#+\-.!>|])")
_EMPHASIS = re.compile(r"(?<!\\)[*_]+")


def render(markdown: str) -> str:
    """One play's Markdown -> plain speaker-turn text (no `*`/`_` markup, no trailing spaces)."""
    out: list[str] = []
    for line in markdown.splitlines():
        m = _SPEAKER.match(line)
        if m:
            out.append(f"{m.group('name').strip()}:")
            continue
        line = _HEADING.sub("", line)
        line = _EMPHASIS.sub("", line)
        line = _ESCAPED.sub(r"\1", line)
        out.append(line.rstrip())
    text = "\n".join(out).strip("\n") + "\n"
    return re.sub(r"\n{3,}", "\n\n", text)
