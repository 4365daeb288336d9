"""Topology: nodes x devices per node, ranks contiguous per node as torchrun lays them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from composer_par.mesh import MeshSpec
from composer_par.topology import Topology, TopologyError

# -- construction ------------------------------------------------------------------------


def test_world_size_and_describe() -> None:
    topo = Topology(nodes=4, devices_per_node=8)
    assert topo.world_size == 32
    assert topo.describe() == "4 node(s) x 8 device(s) = 32 ranks"
    assert topo.to_dict() == {"nodes": 4, "devices_per_node": 8}
    assert Topology.single_node(8) == Topology(nodes=1, devices_per_node=8)


def test_bandwidths_are_optional_keywords() -> None:
    topo = Topology(2, 8, intra_node_gbps=900, inter_node_gbps=400.0)
    assert topo.to_dict() == {
        "nodes": 2, "devices_per_node": 8, "intra_node_gbps": 900, "inter_node_gbps": 400.0,
    }
    with pytest.raises(TypeError):
        Topology(2, 8, 900)  # type: ignore[misc]


@pytest.mark.parametrize("field", ["nodes", "devices_per_node"])
@pytest.mark.parametrize("value", [0, -1, True, 2.0, "4", None])
def test_counts_must_be_positive_ints(field: str, value: object) -> None:
    kwargs: dict[str, object] = {"nodes": 2, "devices_per_node": 4, field: value}
    with pytest.raises(TopologyError) as err:
        Topology(**kwargs)  # type: ignore[arg-type]
    assert f"{field} must be a positive int; got {value!r}" in str(err.value)


@pytest.mark.parametrize("field", ["intra_node_gbps", "inter_node_gbps"])
@pytest.mark.parametrize("value", [0, -5.0, True, "fast", float("inf"), float("nan")])
def test_bandwidths_must_be_positive_numbers(field: str, value: object) -> None:
    with pytest.raises(TopologyError, match=f"{field} must be a (finite )?positive number; got"):
        Topology(1, 8, **{field: value})  # type: ignore[arg-type]


def test_topology_is_frozen() -> None:
    topo = Topology(2, 4)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        topo.nodes = 3  # type: ignore[misc]
    assert attrs.evolve(topo, nodes=3).world_size == 12


# -- from_env ----------------------------------------------------------------------------


def test_from_env_reads_torchrun_variables() -> None:
    # torchrun --nnodes 4 --nproc-per-node 8 exports these on every rank.
    env = {"WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "8", "RANK": "9", "LOCAL_RANK": "1"}
    assert Topology.from_env(env) == Topology(nodes=4, devices_per_node=8)


def test_from_env_single_node() -> None:
    assert Topology.from_env({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}) == Topology(1, 4)


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"WORLD_SIZE": "8"},
        {"LOCAL_WORLD_SIZE": "8"},
        {"WORLD_SIZE": "x", "LOCAL_WORLD_SIZE": "8"},
    ],
)
def test_from_env_outside_torchrun_is_none(env: dict[str, str]) -> None:
    assert Topology.from_env(env) is None


def test_from_env_uneven_nodes_is_an_error() -> None:
    with pytest.raises(TopologyError) as err:
        Topology.from_env({"WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "8"})
    assert "WORLD_SIZE=12" in str(err.value) and "LOCAL_WORLD_SIZE=8" in str(err.value)


@pytest.mark.parametrize("local", ["0", "-8"])
def test_from_env_non_positive_local_world_size_is_an_error(local: str) -> None:
    with pytest.raises(TopologyError, match=f"LOCAL_WORLD_SIZE={local}"):
        Topology.from_env({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": local})


def test_from_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert Topology.from_env() == Topology(4, 4)
    monkeypatch.delenv("WORLD_SIZE")
    assert Topology.from_env() is None


# -- node_of and crossing ------------------------------------------------------------------


def test_node_of_is_contiguous_like_torchrun() -> None:
    topo = Topology(nodes=3, devices_per_node=4)
    assert [topo.node_of(r) for r in range(12)] == [0] * 4 + [1] * 4 + [2] * 4


@pytest.mark.parametrize("rank", [-1, 12, 99])
def test_node_of_outside_the_topology(rank: int) -> None:
    with pytest.raises(TopologyError) as err:
        Topology(nodes=3, devices_per_node=4).node_of(rank)
    assert f"rank {rank} is outside 3 node(s) x 4 device(s) = 12 ranks" in str(err.value)


def test_hsdp_mesh_shards_inside_and_replicates_across_nodes() -> None:
    topo = Topology(nodes=4, devices_per_node=8)
    mesh = MeshSpec(dp_replicate=4, dp_shard=8)
    assert not topo.crosses_nodes(mesh, "dp_shard")
    assert topo.nodes_spanned(mesh, "dp_shard") == 1
    assert topo.crosses_nodes(mesh, "dp_replicate")
    assert topo.nodes_spanned(mesh, "dp_replicate") == 4


def test_reversed_hsdp_mesh_shards_across_nodes() -> None:
    topo = Topology(nodes=4, devices_per_node=8)
    mesh = MeshSpec(dp_shard=8, dp_replicate=4)
    assert topo.crosses_nodes(mesh, "dp_shard")
    assert topo.nodes_spanned(mesh, "dp_shard") == 4
    assert not topo.crosses_nodes(mesh, "dp_replicate")


def test_three_d_mesh_tp_inside_a_node() -> None:
    topo = Topology(nodes=2, devices_per_node=8)
    mesh = MeshSpec(dp_replicate=2, dp_shard=4, tp=2)
    assert not topo.crosses_nodes(mesh, "tp")
    assert not topo.crosses_nodes(mesh, "dp_shard")  # stride 2, size 4: 8 ranks, one node
    assert topo.crosses_nodes(mesh, "dp_replicate")


def test_tp_too_large_for_a_node_crosses() -> None:
    topo = Topology(nodes=2, devices_per_node=4)
    mesh = MeshSpec(dp_shard=1, tp=8)
    assert topo.crosses_nodes(mesh, "tp")
    assert not topo.crosses_nodes(mesh, "dp_shard")  # size 1: never crosses


def test_inner_dim_not_dividing_the_node_crosses() -> None:
    # 3 does not divide 4: the group (3, 4, 5) straddles nodes 0 and 1.
    topo = Topology(nodes=3, devices_per_node=4)
    mesh = MeshSpec(dp_replicate=4, dp_shard=3)
    assert topo.crosses_nodes(mesh, "dp_shard")


def test_single_node_never_crosses() -> None:
    topo = Topology.single_node(16)
    mesh = MeshSpec(a=2, b=4, c=2)
    assert not any(topo.crosses_nodes(mesh, n) for n in mesh.names)


# -- properties ----------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def inner_dim_layouts(draw: st.DrawFn) -> tuple[Topology, MeshSpec]:
    """A topology and a mesh whose innermost dim's size divides devices_per_node."""
    per_node = draw(st.integers(1, 8))
    nodes = draw(st.integers(1, 4))
    inner = draw(st.sampled_from(_divisors(per_node)))
    rest = nodes * per_node // inner
    outer: list[int] = []
    while rest > 1 and len(outer) < 2:  # split the rest into up to 3 outer dims
        factor = draw(st.sampled_from(_divisors(rest)))
        outer.append(factor)
        rest //= factor
    outer.append(rest)
    pairs = [(f"o{i}", s) for i, s in enumerate(outer)] + [("inner", inner)]
    return Topology(nodes, per_node), MeshSpec.from_pairs(pairs)


@settings(max_examples=100, deadline=None)
@given(inner_dim_layouts())
def test_innermost_dim_dividing_the_node_never_crosses(layout: tuple[Topology, MeshSpec]) -> None:
    topo, mesh = layout
    assert mesh.world_size == topo.world_size
    assert not topo.crosses_nodes(mesh, "inner")
    assert topo.nodes_spanned(mesh, "inner") == 1


@settings(max_examples=100, deadline=None)
@given(inner_dim_layouts())
def test_crossing_matches_the_span_of_ranks(layout: tuple[Topology, MeshSpec]) -> None:
    """A dim crosses nodes iff one of its groups holds ranks of two nodes; spans agree."""
    topo, mesh = layout
    for name in mesh.names:
        spans = [len({r // topo.devices_per_node for r in g}) for g in mesh.rank_groups(name)]
        assert topo.nodes_spanned(mesh, name) == max(spans)
        assert topo.crosses_nodes(mesh, name) == (max(spans) > 1)
        # A dim that spans several nodes spans at most ceil(size * stride / per_node) + 1.
        stride = math.prod(mesh.sizes[mesh.names.index(name) + 1 :])
        assert max(spans) <= -(-mesh.size(name) * stride // topo.devices_per_node) + 1


@st.composite
def any_layouts(draw: st.DrawFn) -> tuple[Topology, MeshSpec, tuple[str, ...]]:
    """Any mesh of 1 to 4 dims on any node shape that holds its ranks, and a subset of
    its dims to flatten together."""
    sizes = draw(st.lists(st.sampled_from([1, 2, 3, 4, 6, 8]), min_size=1, max_size=4))
    mesh = MeshSpec.from_pairs((f"d{i}", s) for i, s in enumerate(sizes))
    per_node = draw(st.sampled_from(_divisors(mesh.world_size)))
    names = tuple(draw(st.lists(st.sampled_from(mesh.names), min_size=1, unique=True)))
    return Topology(mesh.world_size // per_node, per_node), mesh, names


@settings(max_examples=200, deadline=None)
@given(any_layouts())
def test_node_patterns_stand_for_every_group(layout: tuple[Topology, MeshSpec, tuple[str, ...]]
                                             ) -> None:
    """Every group of the flattened dims sits on the nodes as one of the patterns does,
    moved by whole nodes; the span is the widest group's, counted rank by rank."""
    topo, mesh, names = layout
    per_node = topo.devices_per_node
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(mesh.world_size):
        coord = mesh.coordinate(rank)
        groups.setdefault(tuple(v for n, v in coord.items() if n not in names), []).append(rank)

    def shape(group: Sequence[int]) -> tuple[int, ...]:
        first = group[0] // per_node
        return tuple(r // per_node - first for r in group)

    patterns = topo.node_patterns(mesh, names)
    assert len(patterns) <= per_node
    real = {tuple(g) for g in groups.values()}
    assert all(p in real for p in patterns)
    assert {shape(g) for g in groups.values()} == {shape(p) for p in patterns}
    widest = max(len({r // per_node for r in g}) for g in groups.values())
    assert topo.nodes_spanned(mesh, *names) == widest
    if len(names) == 1:
        assert sorted(patterns) == sorted(set(patterns))
        assert set(patterns) <= set(mesh.rank_groups(names[0]))
