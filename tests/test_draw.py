"""Layout pictures: the terminal grid and the SVG (checked by structure, not pixels)."""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from composer_par import MeshSpec, Topology
from composer_par.tools.draw import MAX_ROWS, SVG_MAX_RANKS, Grid, render_svg, render_text
from tests.cli_run import run

SVG = "{http://www.w3.org/2000/svg}"


def hsdp_grid() -> Grid:
    return Grid.of(MeshSpec(dp_replicate=4, dp_shard=8), Topology(4, 8))


def test_grid_knows_which_mesh_dims_cross_nodes() -> None:
    grid = hsdp_grid()
    replicate, shard = grid.dims
    assert (grid.rows, grid.columns, grid.row_label) == (4, 8, "node")
    assert (replicate.groups, replicate.nodes_spanned, replicate.crosses_nodes) == (8, 4, True)
    assert (shard.groups, shard.nodes_spanned, shard.crosses_nodes) == (4, 1, False)
    mesh = MeshSpec(dp_replicate=4, dp_shard=8)
    for rank in range(32):
        for dim in grid.dims:
            group = mesh.rank_groups(dim.name)[dim.group_of_rank[rank]]
            assert rank in group


def test_terminal_picture() -> None:
    text = render_text(hsdp_grid())
    lines = text.splitlines()
    assert lines[0] == "layout: 4 node(s) x 8 device(s) = 32 ranks"
    assert "  node 1 |  8  9 10 11 12 13 14 15" in lines
    at = lines.index("dp_replicate(4): 8 groups of 4, each spans 4 nodes: crosses nodes "
                     "(cells: group index)")
    assert lines[at + 1:at + 5] == [f"  node {n} | 0 1 2 3 4 5 6 7" for n in range(4)]
    at = lines.index("dp_shard(8): 4 groups of 8, inside a node (cells: group index)")
    assert lines[at + 3] == "  node 2 | 2 2 2 2 2 2 2 2"
    assert "\x1b[" not in text
    colored = render_text(hsdp_grid(), color=True)
    assert "\x1b[33mdp_replicate(4)" in colored and "\x1b[32m" in colored


def test_terminal_picture_without_a_topology_and_cut_when_large() -> None:
    text = render_text(Grid.of(MeshSpec(dp_shard=16, tp=4)))
    assert "64 ranks (no topology: rows of 16 ranks)" in text
    assert "  ranks 0-15  |  0  1  2" in text and "crosses" not in text
    big = Grid.of(MeshSpec(dp_replicate=64, dp_shard=8), Topology(64, 8))
    text = render_text(big)
    assert f"not shown: {64 - MAX_ROWS} more node row(s)" in text
    assert f"node {MAX_ROWS - 1} |" in text and f"node {MAX_ROWS} |" not in text


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def test_svg_structure() -> None:
    root = parse(render_svg(hsdp_grid(), title="plan.toml"))
    assert root.tag == f"{SVG}svg" and root.get("data-world-size") == "32"
    panels = root.findall(f"{SVG}g[@class='mesh-dim']")
    assert [p.get("data-dim") for p in panels] == ["dp_replicate", "dp_shard"]
    assert [p.get("data-crosses-nodes") for p in panels] == ["true", "false"]
    assert [p.get("data-groups") for p in panels] == ["8", "4"]
    mesh = MeshSpec(dp_replicate=4, dp_shard=8)
    for panel in panels:
        nodes = panel.findall(f"{SVG}g[@class='node']")
        assert [n.get("data-node") for n in nodes] == ["0", "1", "2", "3"]
        rects = panel.findall(f".//{SVG}rect[@class='rank']")
        assert sorted(int(r.get("data-rank", "")) for r in rects) == list(range(32))
        groups = mesh.rank_groups(panel.get("data-dim", ""))
        fills: dict[str, str] = {}
        for rect in rects:
            rank, group = int(rect.get("data-rank", "")), int(rect.get("data-group", ""))
            assert rank in groups[group]
            # one fill per group, distinct across groups
            assert fills.setdefault(rect.get("data-group", ""), rect.get("fill", "")) == \
                rect.get("fill")
            title = rect.find(f"{SVG}title")
            assert title is not None and f"rank {rank}," in (title.text or "")
        assert len(set(fills.values())) == len(groups)
        # every rank of node k sits in node k's row
        for node in nodes:
            ranks = [int(r.get("data-rank", "")) for r in node.findall(f"{SVG}rect[@class='rank']")]
            assert ranks == list(range(8 * int(node.get("data-node", "")), 8 *
                                       int(node.get("data-node", "")) + 8))


def test_svg_of_a_large_layout_is_cut_and_says_so() -> None:
    grid = Grid.of(MeshSpec(dp_replicate=1024, dp_shard=8), Topology(1024, 8))
    root = parse(render_svg(grid))
    panel = root.find(f"{SVG}g[@class='mesh-dim']")
    assert panel is not None
    assert len(panel.findall(f".//{SVG}rect[@class='rank']")) == SVG_MAX_RANKS
    cut = root.find(f"{SVG}text[@class='cut']")
    assert cut is not None and f"first {SVG_MAX_RANKS} of 8192 ranks" in (cut.text or "")


PLAN = """
[mesh]
dp_replicate = 2
dp_shard = 4
[topology]
nodes = 2
devices_per_node = 4
[[plugins]]
name = "{replicate}"
[[plugins]]
name = "fsdp2"
"""


@pytest.fixture
def plan(tmp_path: Path) -> str:
    from composer_par import Registry

    replicate = "hsdp" if "hsdp" in Registry().names() else "meta_init"
    path = tmp_path / "plan.toml"
    path.write_text(PLAN.format(replicate=replicate))
    return str(path)


def test_explain_draws_and_writes_svg(plan: str, tmp_path: Path) -> None:
    svg = tmp_path / "layout.svg"
    _, out, _ = run(["explain", plan, "--svg", str(svg)])
    assert "layout: 2 node(s) x 4 device(s) = 8 ranks" in out
    assert "dp_replicate(2): 4 groups of 2, each spans 2 nodes: crosses nodes" in out
    assert f"SVG written to {svg}" in out
    root = parse(svg.read_text())
    assert len(root.findall(f"{SVG}g[@class='mesh-dim']")) == 2
    _, out, _ = run(["explain", plan, "--svg", str(svg), "--json"])
    data = json.loads(out)
    assert data["svg"] == str(svg)
    assert data["layout"]["dims"][0] == {"name": "dp_replicate", "size": 2, "groups": 4,
                                         "nodes_spanned": 2, "crosses_nodes": True}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_explain_colors_only_on_a_terminal(plan: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("TERM", raising=False)
    _, out, _ = run(["explain", plan], stdout=Terminal())
    assert "\x1b[" in out
    _, out, _ = run(["explain", plan])
    assert "\x1b[" not in out


def test_explain_svg_needs_a_known_world_size(tmp_path: Path) -> None:
    path = tmp_path / "inferred.toml"
    path.write_text('[mesh]\ndp_shard = -1\n[[plugins]]\nname = "fsdp2"\n')
    code, out, err = run(["explain", str(path), "--svg", str(tmp_path / "x.svg"), "--json"])
    assert code == 2 and "world size is unknown" in err
    code, out, _ = run(["explain", str(path)])  # without --svg: explained, not drawn
    assert code == 0 and "layout:" not in out


def test_explain_svg_into_a_missing_directory_is_exit_2(plan: str, tmp_path: Path) -> None:
    code, _, err = run(["explain", plan, "--svg", str(tmp_path / "no" / "such" / "x.svg")])
    assert code == 2 and "cannot write" in err
