"""Plain-text tables: the one renderer behind every table the project prints (the CLI's
plugin and rule lists, the estimate, the dry run, the suggestions)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def table(rows: Sequence[Sequence[object]], header: Sequence[str], *,
          right: Iterable[int] = (), indent: str = "") -> str:
    """``header`` and ``rows`` in columns two spaces apart, each as wide as its widest
    cell; the columns numbered in ``right`` are right-aligned (numbers), the others left.
    Every line starts with ``indent`` and has no trailing spaces."""
    right = set(right)
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    lines = []
    for row in (header, *rows):
        cells = [str(cell).rjust(width) if i in right else str(cell).ljust(width)
                 for i, (cell, width) in enumerate(zip(row, widths, strict=True))]
        lines.append(indent + "  ".join(cells).rstrip())
    return "\n".join(lines)


__all__ = ["table"]
