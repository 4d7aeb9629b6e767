"""Line handling shared by every parser.

Captured files may begin with a provenance header (``# source: ...`` or ``<!-- source: ... -->``,
as in ``tests/fixtures``); it is not tool output and is skipped. Parsers work on
``(line_number, text)`` pairs so that errors can name the line of the original file.
"""

from __future__ import annotations

import re
from typing import List, Tuple

__all__ = ["numbered_lines", "strip_source_header", "is_source_header"]

_HEADER = re.compile(r"^\s*(#\s*source:|<!--\s*source:)", re.IGNORECASE)


def is_source_header(line: str) -> bool:
    """True for a provenance header line (``# source: ...``, ``<!-- source: ... -->``)."""
    return bool(_HEADER.match(line))


def numbered_lines(text: str) -> List[Tuple[int, str]]:
    """Every line of ``text`` with its 1-based number, the provenance header skipped.

    Trailing ``\\r`` is removed (files captured on Windows); other whitespace is kept.
    """
    out = []
    for i, line in enumerate(text.splitlines(), start=1):
        if i == 1 and is_source_header(line):
            continue
        out.append((i, line.rstrip("\r")))
    return out


def strip_source_header(text: str) -> str:
    """``text`` without its provenance header line (line count preserved: it becomes empty)."""
    lines = text.splitlines(keepends=True)
    if lines and is_source_header(lines[0]):
        lines[0] = "\n"
    return "".join(lines)
