"""Pictures of a layout: a nodes x devices grid per mesh dim, in the terminal and as SVG.

Each mesh dim gets one grid: a row per node (or, without a topology, per run of ranks),
a cell per device, and in each cell the index of the rank group that device belongs to
on that mesh dim. Cells of the same group share a number (and a color on a terminal, a
fill in SVG), so a group that stays inside a node shows as a run within one row and a
group that crosses nodes as the same number in several rows. Pure Python: no torch.

Large layouts are cut, not dropped: the terminal shows at most :data:`MAX_ROWS` rows of
:data:`MAX_COLUMNS` cells, the SVG at most :data:`SVG_MAX_RANKS` ranks, and both say what
was left out.
"""

from __future__ import annotations

import colorsys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any
from xml.sax.saxutils import escape

import attrs

if TYPE_CHECKING:
    from composer_par.mesh import MeshSpec
    from composer_par.plugin.pipeline import Timeline
    from composer_par.topology import Topology

MAX_ROWS = 16
MAX_COLUMNS = 32
SVG_MAX_RANKS = 4096
# Colors cycled on a terminal (ANSI foreground codes); bold for every other cycle.
_ANSI = ("31", "32", "33", "34", "35", "36", "91", "92", "93", "94", "95", "96")
CELL, GAP, LABEL_WIDTH, TITLE_HEIGHT = 28, 4, 70, 40


@attrs.frozen
class DimGrid:
    """One mesh dim over the grid: the group index of every rank, and where groups lie."""

    name: str
    size: int
    group_of_rank: tuple[int, ...]  # rank -> index of its group on this mesh dim
    groups: int
    nodes_spanned: int | None  # widest group, in nodes; None without a topology

    @property
    def crosses_nodes(self) -> bool | None:
        return None if self.nodes_spanned is None else self.nodes_spanned > 1

    def summary(self) -> str:
        where = ""
        if self.nodes_spanned is not None:
            where = (f", each spans {self.nodes_spanned} nodes: crosses nodes"
                     if self.nodes_spanned > 1 else ", inside a node")
        plural = "s" if self.groups != 1 else ""
        return f"{self.name}({self.size}): {self.groups} group{plural} of {self.size}{where}"


@attrs.frozen
class Grid:
    """The whole layout: rows x columns of ranks and one :class:`DimGrid` per mesh dim."""

    world_size: int
    rows: int
    columns: int
    row_label: str  # "node" with a topology, else "ranks"
    dims: tuple[DimGrid, ...]
    topology: Topology | None

    @classmethod
    def of(
        cls, mesh: MeshSpec, topology: Topology | None = None,
        groups: Mapping[str, Sequence[Sequence[int]]] | None = None,
    ) -> Grid:
        """The grid of a resolved mesh; a topology whose size differs is ignored.
        ``groups`` (``{dim: rank groups}``, as ``ParallelPlan.explain`` has them) saves
        computing them again."""
        world = mesh.world_size
        if topology is not None and topology.world_size != world:
            topology = None
        if topology is not None:
            rows, columns, label = topology.nodes, topology.devices_per_node, "node"
        else:
            columns = 1
            for size in reversed(mesh.sizes):  # whole inner mesh dims per row, up to 32
                if columns * size > MAX_COLUMNS:
                    break
                columns *= size
            if columns < 8:  # rows of at least 8 (or 16) ranks, whole inner groups each
                columns *= max(1, min(world, 16) // columns)
            rows, label = -(-world // columns), "ranks"
        dims = []
        for name, size in mesh.dims:
            owner = [0] * world
            of_dim = groups[name] if groups and name in groups else mesh.rank_groups(name)
            spanned = 0
            for index, group in enumerate(of_dim):
                for rank in group:
                    owner[rank] = index
                if topology is not None:
                    spanned = max(spanned, len({rank // topology.devices_per_node
                                                for rank in group}))
            dims.append(DimGrid(name, size, tuple(owner), len(of_dim),
                                spanned if topology is not None else None))
        return cls(world, rows, columns, label, tuple(dims), topology)

    def row_name(self, row: int) -> str:
        if self.row_label == "node":
            return f"node {row}"
        first = row * self.columns
        return f"ranks {first}-{min(first + self.columns, self.world_size) - 1}"

    def rank_at(self, row: int, column: int) -> int | None:
        rank = row * self.columns + column
        return rank if rank < self.world_size else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size, "rows": self.rows, "columns": self.columns,
            "row_label": self.row_label,
            "dims": [{"name": d.name, "size": d.size, "groups": d.groups,
                      "nodes_spanned": d.nodes_spanned, "crosses_nodes": d.crosses_nodes}
                     for d in self.dims],
        }


# -- terminal --------------------------------------------------------------------------------


def _ansi(index: int) -> str:
    code = _ANSI[index % len(_ANSI)]
    return f"1;{code}" if (index // len(_ANSI)) % 2 else code


def render_text(grid: Grid, *, color: bool = False) -> str:
    """The grid for a terminal: ranks first, then one block per mesh dim."""
    shown_rows = min(grid.rows, MAX_ROWS)
    shown_cols = min(grid.columns, MAX_COLUMNS)
    label_width = max(len(grid.row_name(r)) for r in range(shown_rows))
    rank_width = len(str(grid.world_size - 1))
    head = "layout: " + (grid.topology.describe() if grid.topology else
                         f"{grid.world_size} ranks (no topology: rows of {grid.columns} ranks)")
    lines = [head, "ranks:"]
    lines += _rows(grid, shown_rows, shown_cols, label_width, rank_width,
                   lambda rank: (str(rank), None))
    for dim in grid.dims:
        width = len(str(dim.groups - 1))
        summary = dim.summary()
        if color and dim.crosses_nodes:
            summary = f"\x1b[33m{summary}\x1b[0m"
        lines.append(summary + " (cells: group index)")

        def cell(rank: int, dim: DimGrid = dim) -> tuple[str, str | None]:
            index = dim.group_of_rank[rank]
            return str(index), _ansi(index) if color else None

        lines += _rows(grid, shown_rows, shown_cols, label_width, max(width, 1), cell)
    cut = []
    if grid.rows > shown_rows:
        cut.append(f"{grid.rows - shown_rows} more {grid.row_label} row(s)")
    if grid.columns > shown_cols:
        cut.append(f"{grid.columns - shown_cols} more device column(s)")
    if cut:
        lines.append(f"(not shown: {', '.join(cut)}; `explain --json` has every rank group)")
    return "\n".join(lines)


def _rows(grid: Grid, rows: int, cols: int, label_width: int, width: int,
          cell: Any) -> list[str]:
    out = []
    for row in range(rows):
        cells = []
        for column in range(cols):
            rank = grid.rank_at(row, column)
            if rank is None:
                cells.append(" " * width)
                continue
            text, style = cell(rank)
            text = text.rjust(width)
            cells.append(f"\x1b[{style}m{text}\x1b[0m" if style else text)
        more = " ..." if grid.columns > cols else ""
        out.append(f"  {grid.row_name(row).ljust(label_width)} | {' '.join(cells)}{more}".rstrip())
    return out


# -- SVG -------------------------------------------------------------------------------------


def _fill(index: int, groups: int) -> str:
    """A distinct fill per group: hues spread by the golden ratio, pastel."""
    hue = (index * 0.618033988749895) % 1.0
    lightness = 0.78 if groups > 1 else 0.85
    r, g, b = colorsys.hls_to_rgb(hue, lightness, 0.55)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def render_svg(grid: Grid, *, title: str = "") -> str:
    """The layout as an SVG document: one panel per mesh dim.

    Structure (for tools and tests): the root ``<svg>`` has ``data-world-size``; each
    panel is ``<g class="mesh-dim" data-dim=... data-size=... data-groups=...
    data-crosses-nodes=...>`` holding one ``<g class="node" data-node=...>`` per grid row
    and one ``<rect class="rank" data-rank=... data-group=...>`` (with a ``<title>``
    tooltip) per rank.
    """
    shown = min(grid.world_size, SVG_MAX_RANKS)
    rows = min(grid.rows, -(-shown // grid.columns))
    cols = grid.columns
    panel_height = TITLE_HEIGHT + rows * (CELL + GAP) + GAP
    heading = title or "layout"
    where = grid.topology.describe() if grid.topology else f"{grid.world_size} ranks"
    # wide enough for the longest line of text too (monospace: ~7 px per character at 12)
    longest = max([len(f"{heading}: {where}") + 2, *(len(d.summary()) for d in grid.dims)])
    width = max(LABEL_WIDTH + cols * (CELL + GAP) + 2 * GAP, 8 * longest + 2 * GAP)
    height = 50 + len(grid.dims) * (panel_height + 20) + (20 if shown < grid.world_size else 0)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="11" '
        f'data-world-size="{grid.world_size}" data-rows="{grid.rows}" '
        f'data-columns="{grid.columns}">',
        f"<title>{escape(heading)}: {escape(where)}</title>",
        f'<text x="{GAP}" y="20" font-size="14" font-weight="bold">{escape(heading)}: '
        f"{escape(where)}</text>",
    ]
    y = 40
    for dim in grid.dims:
        crosses = dim.crosses_nodes
        color = "#b00020" if crosses else ("#1b5e20" if crosses is False else "#333333")
        out.append(
            f'<g class="mesh-dim" data-dim="{escape(dim.name)}" data-size="{dim.size}" '
            f'data-groups="{dim.groups}" data-crosses-nodes="{_attr(crosses)}" '
            f'data-nodes-spanned="{_attr(dim.nodes_spanned)}" transform="translate(0,{y})">')
        out.append(f'<text class="summary" x="{GAP}" y="16" font-size="12" fill="{color}">'
                   f"{escape(dim.summary())}</text>")
        for row in range(rows):
            top = TITLE_HEIGHT - 14 + row * (CELL + GAP)
            out.append(f'<g class="node" data-node="{row}">')
            out.append(f'<text x="{GAP}" y="{top + CELL // 2 + 4}">'
                       f"{escape(grid.row_name(row))}</text>")
            out.append(f'<rect class="node-box" x="{LABEL_WIDTH - 2}" y="{top - 2}" '
                       f'width="{cols * (CELL + GAP) + 4 - GAP}" height="{CELL + 4}" '
                       'fill="none" stroke="#999999" rx="4"/>')
            for column in range(cols):
                rank = grid.rank_at(row, column)
                if rank is None or rank >= shown:
                    continue
                index = dim.group_of_rank[rank]
                x = LABEL_WIDTH + column * (CELL + GAP)
                tip = (f"rank {rank}, {grid.row_name(row)}, device {column}: "
                       f"{dim.name} group {index}")
                out.append(
                    f'<rect class="rank" data-rank="{rank}" data-group="{index}" x="{x}" '
                    f'y="{top}" width="{CELL}" height="{CELL}" rx="3" '
                    f'fill="{_fill(index, dim.groups)}" stroke="#555555">'
                    f"<title>{escape(tip)}</title></rect>")
                out.append(f'<text x="{x + CELL // 2}" y="{top + CELL // 2 + 4}" '
                           f'text-anchor="middle">{rank}</text>')
            out.append("</g>")
        out.append("</g>")
        y += panel_height + 20
    if shown < grid.world_size:
        out.append(f'<text class="cut" x="{GAP}" y="{y}">first {shown} of {grid.world_size} '
                   "ranks drawn</text>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _attr(value: Any) -> str:
    if value is None:
        return "unknown"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# -- a pipeline schedule's timeline -----------------------------------------------------------

TIMELINE_MAX_TICKS = 120  # terminal columns of ticks; longer steps are cut and say so
TICK = 22  # SVG pixels per tick
_KIND_HUE = {"F": 0.58, "B": 0.08, "I": 0.08, "W": 0.33}  # forward blue, backward orange


def render_timeline_text(timeline: Timeline) -> str:
    """One row per rank, one column per tick: each action's label (``2F3``: stage 2,
    forward, microbatch 3) where it starts, ``-`` while it runs on, ``.`` idle."""
    width = max([3, *(len(a.label) + 1 for row in timeline.actions for a in row)])
    shown = min(timeline.length, TIMELINE_MAX_TICKS)
    label_width = max(len(r) for r in timeline.rows) if timeline.rows else 0
    lines = [f"timeline: {timeline.title}; bubble {timeline.bubble:.1%} of "
             f"{timeline.length} ticks x {len(timeline.rows)} ranks ({timeline.note})"]
    for label, row in zip(timeline.rows, timeline.actions, strict=True):
        cells = ["." * (width - 1)] * shown
        for action in row:
            for tick in range(action.start, min(action.end, shown)):
                cells[tick] = (action.label if tick == action.start else "-" * (width - 1))
        lines.append(f"  {label.ljust(label_width)} |" + "".join(
            c.rjust(width) for c in cells))
    if shown < timeline.length:
        lines.append(f"  ... first {shown} of {timeline.length} ticks shown")
    return "\n".join(lines)


def _action_fill(kind: str, stage: int, stages: int) -> str:
    light = 0.45 + 0.35 * (stage / max(1, stages - 1))
    sat = 0.6
    r, g, b = colorsys.hls_to_rgb(_KIND_HUE.get(kind, 0.0), light, sat)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def stack_svgs(documents: list[str]) -> str:
    """One SVG document holding ``documents`` (each a whole ``<svg>`` with ``width`` and
    ``height``) one below the other, each kept whole as a nested ``<svg>``."""
    import re

    sizes = []
    for doc in documents:
        root = re.match(r'\s*<svg\b[^>]*\bwidth="(\d+)"[^>]*\bheight="(\d+)"', doc)
        if root is None:
            raise ValueError("stack_svgs needs documents whose root <svg> gives width and "
                             "height")
        sizes.append((int(root.group(1)), int(root.group(2))))
    width = max(w for w, _ in sizes)
    height = sum(h for _, h in sizes)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">']
    y = 0
    for doc, (_, h) in zip(documents, sizes, strict=True):
        # The nested root keeps its own attributes; only its place moves.
        out.append(doc.replace("<svg ", f'<svg y="{y}" ', 1))
        y += h
    out.append("</svg>")
    return "\n".join(out)


def render_timeline_svg(timeline: Timeline) -> str:
    """The timeline as SVG: a lane per rank, a box per action (forward blue, backward
    orange, weight backward green; lighter for later stages), the label inside."""
    stages = 1 + max((s for row in timeline.actions for a in row for _, s, _ in a.runs),
                     default=0)
    lane, top, left = CELL + GAP, TITLE_HEIGHT, LABEL_WIDTH
    width = left + timeline.length * TICK + GAP * 2
    height = top + len(timeline.rows) * lane + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="10">',
           f'<text x="{GAP}" y="18" font-size="13">{escape(timeline.title)}: bubble '
           f"{timeline.bubble:.1%}</text>",
           f'<text x="{GAP}" y="32">{escape(timeline.note)}</text>']
    for index, (label, row) in enumerate(zip(timeline.rows, timeline.actions, strict=True)):
        y = top + index * lane
        out.append(f'<text x="{GAP}" y="{y + CELL // 2 + 4}">{escape(label)}</text>')
        out.append(f'<rect x="{left}" y="{y}" width="{timeline.length * TICK}" '
                   f'height="{CELL}" fill="#f2f2f2" stroke="#cccccc"/>')
        for action in row:
            kind, stage, _ = action.runs[0]
            x = left + action.start * TICK
            w = (action.end - action.start) * TICK
            out.append(f'<rect class="action" x="{x}" y="{y}" width="{w}" height="{CELL}" '
                       f'fill="{_action_fill(kind, stage, stages)}" stroke="#555555">'
                       f"<title>{escape(label)}: {escape(action.label)} ticks "
                       f"{action.start}-{action.end}</title></rect>")
            out.append(f'<text x="{x + w // 2}" y="{y + CELL // 2 + 4}" '
                       f'text-anchor="middle">{escape(action.label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


__all__ = ["DimGrid", "Grid", "render_svg", "render_text",
           "render_timeline_svg", "render_timeline_text", "stack_svgs"]
