"""Plain-text tables and sizes for terminals, logs and scripts."""

from __future__ import annotations

from typing import Sequence


def render(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell; the last column is never padded."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        padded = [cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])] + [row[-1]]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)


def human_size(nbytes: float) -> str:
    """Bytes as GB from 0.1 GB up, as MB below (``12.3 MB``, ``1.5 GB``)."""
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def clip(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was: what a caller sent is
    echoed in replies and logs at a bounded size (a 10 MB profile name is not a 10 MB reply)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text)} characters)"
