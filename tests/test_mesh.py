"""MeshSpec: construction errors, -1 inference, equations, and rank arithmetic.

The rank groups MeshSpec computes on a laptop must equal what ``init_device_mesh``
builds on the cluster. That is checked here without real processes: torch's fake
process group lets one process pretend to be any rank of any world size, so every
rank's DeviceMesh can be built and asked for its group on every mesh dim.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from composer_par.mesh import INFER, MeshError, MeshSpec

# -- construction errors ---------------------------------------------------------------


def test_dims_keep_their_order_outermost_first() -> None:
    spec = MeshSpec(dp_replicate=2, dp_shard=4, tp=2)
    assert spec.names == ("dp_replicate", "dp_shard", "tp")
    assert spec.sizes == (2, 4, 2)
    assert spec.to_dict() == {"dp_replicate": 2, "dp_shard": 4, "tp": 2}
    assert list(spec) == [("dp_replicate", 2), ("dp_shard", 4), ("tp", 2)]
    assert "tp" in spec and "pp" not in spec
    assert repr(spec) == "MeshSpec(dp_replicate=2, dp_shard=4, tp=2)"
    assert spec.world_size == 16


def test_from_pairs_keeps_order_and_equals_keyword_form() -> None:
    assert MeshSpec.from_pairs([("tp", 2), ("dp_shard", 4)]).names == ("tp", "dp_shard")
    assert MeshSpec.from_pairs({"dp_shard": 4, "tp": 2}) == MeshSpec(dp_shard=4, tp=2)


@pytest.mark.parametrize("size", [0, -2, -100])
def test_non_positive_size_names_the_dim_expected_and_received(size: int) -> None:
    with pytest.raises(MeshError) as err:
        MeshSpec(dp_shard=4, tp=size)
    text = str(err.value)
    assert "'tp'" in text  # the field
    assert ">= 1 or -1" in text  # what was expected
    assert f"got {size}" in text  # what was received


@pytest.mark.parametrize("size", [True, False, 2.0, "4", None])
def test_non_int_size_is_rejected_with_the_value(size: object) -> None:
    with pytest.raises(MeshError) as err:
        MeshSpec(dp_shard=size)  # type: ignore[arg-type]
    text = str(err.value)
    assert "'dp_shard'" in text
    assert "must be an int" in text
    assert f"got {size!r}" in text


def test_two_inferred_sizes_name_both_dims() -> None:
    with pytest.raises(MeshError) as err:
        MeshSpec(dp_replicate=-1, dp_shard=-1, tp=2)
    text = str(err.value)
    assert "at most one mesh dim may be -1" in text
    assert "'dp_replicate'" in text and "'dp_shard'" in text
    assert "'tp'" not in text


def test_duplicate_names_are_rejected() -> None:
    with pytest.raises(MeshError, match="mesh dim 'tp' appears twice"):
        MeshSpec.from_pairs([("tp", 2), ("dp_shard", 2), ("tp", 2)])


@pytest.mark.parametrize("name", ["", "dp-shard", "1tp", "dp shard"])
def test_names_must_be_identifiers(name: str) -> None:
    with pytest.raises(MeshError) as err:
        MeshSpec.from_pairs([(name, 2)])
    assert "identifiers" in str(err.value)
    assert repr(name) in str(err.value)


def test_mesh_spec_is_frozen() -> None:
    import attrs

    spec = MeshSpec(dp_shard=2)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        spec.dims = ()  # type: ignore[misc]


def test_unknown_dim_lookups_say_what_the_mesh_has() -> None:
    spec = MeshSpec(dp_replicate=2, dp_shard=4)
    with pytest.raises(MeshError) as err:
        spec.size("dp_shrad")
    assert "did you mean 'dp_shard'" in str(err.value)
    assert "['dp_replicate', 'dp_shard']" in str(err.value)
    with pytest.raises(MeshError, match="no mesh dim 'tp'"):
        spec.rank_groups("tp")


# -- -1 inference and the equation ------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "world", "expected"),
    [
        ({"dp_shard": -1}, 8, (8,)),
        ({"dp_replicate": -1, "dp_shard": 8}, 32, (4, 8)),
        ({"dp_replicate": 4, "dp_shard": -1, "tp": 2}, 64, (4, 8, 2)),
        ({"dp_replicate": 2, "dp_shard": 4, "tp": -1}, 8, (2, 4, 1)),
    ],
)
def test_minus_one_is_inferred_from_the_world_size(
    sizes: dict[str, int], world: int, expected: tuple[int, ...]
) -> None:
    spec = MeshSpec(**sizes)
    assert not spec.is_resolved
    resolved = spec.resolve(world)
    assert resolved.is_resolved
    assert resolved.names == spec.names
    assert resolved.sizes == expected
    assert resolved.world_size == world
    assert spec.check_world_size(world) is None


def test_resolved_mesh_resolves_to_itself() -> None:
    spec = MeshSpec(dp_shard=4, tp=2)
    assert spec.resolve(8) is spec


def test_world_size_mismatch_prints_the_whole_equation() -> None:
    spec = MeshSpec(dp_replicate=4, dp_shard=8, tp=2)
    assert spec.equation() == "dp_replicate(4) * dp_shard(8) * tp(2) = 64"
    assert spec.equation(64) == "dp_replicate(4) * dp_shard(8) * tp(2) = 64 == world_size(64)"
    expected = "dp_replicate(4) * dp_shard(8) * tp(2) = 64 != world_size(32)"
    assert spec.check_world_size(32) == expected
    with pytest.raises(MeshError) as err:
        spec.resolve(32)
    assert expected in str(err.value)


def test_inferred_size_that_does_not_divide_shows_the_equation() -> None:
    spec = MeshSpec(dp_replicate=-1, dp_shard=8)
    with pytest.raises(MeshError) as err:
        spec.resolve(12)
    text = str(err.value)
    assert "dp_replicate(-1) * dp_shard(8) = 8 * ? != world_size(12)" in text
    assert "12 is not divisible by 8" in text


@pytest.mark.parametrize("world", [0, -8, True])
def test_nonsense_world_size_is_a_mesh_error(world: int) -> None:
    with pytest.raises(MeshError, match="world_size must be a positive int"):
        MeshSpec(dp_shard=-1).resolve(world)


def test_unresolved_mesh_refuses_rank_arithmetic() -> None:
    spec = MeshSpec(dp_replicate=2, dp_shard=-1)
    for call in (
        lambda: spec.world_size,
        lambda: spec.rank_groups("dp_shard"),
        lambda: spec.coordinate(0),
        lambda: spec.rank_of({"dp_shard": 0}),
    ):
        with pytest.raises(MeshError, match=r"dp_replicate\(2\) \* dp_shard\(-1\).*resolve"):
            call()


def test_empty_mesh_is_one_rank() -> None:
    spec = MeshSpec()
    assert spec.world_size == 1
    assert spec.equation(1) == "(no mesh dims) = 1 == world_size(1)"
    assert spec.coordinate(0) == {}


# -- coordinates -------------------------------------------------------------------------


def test_coordinate_is_row_major_outermost_first() -> None:
    spec = MeshSpec(dp_replicate=2, dp_shard=4, tp=2)
    assert spec.coordinate(0) == {"dp_replicate": 0, "dp_shard": 0, "tp": 0}
    assert spec.coordinate(1) == {"dp_replicate": 0, "dp_shard": 0, "tp": 1}
    assert spec.coordinate(2) == {"dp_replicate": 0, "dp_shard": 1, "tp": 0}
    assert spec.coordinate(8) == {"dp_replicate": 1, "dp_shard": 0, "tp": 0}
    assert spec.coordinate(15) == {"dp_replicate": 1, "dp_shard": 3, "tp": 1}
    assert list(spec.coordinate(5)) == ["dp_replicate", "dp_shard", "tp"]


def test_coordinate_and_rank_of_round_trip() -> None:
    spec = MeshSpec(a=3, b=1, c=4, d=2)
    for rank in range(spec.world_size):
        assert spec.rank_of(spec.coordinate(rank)) == rank


def test_rank_of_defaults_missing_dims_to_zero() -> None:
    spec = MeshSpec(dp_replicate=2, dp_shard=4)
    assert spec.rank_of({"dp_replicate": 1}) == 4
    assert spec.rank_of({}) == 0


@pytest.mark.parametrize("rank", [-1, 16, 100])
def test_coordinate_of_a_rank_outside_the_mesh(rank: int) -> None:
    spec = MeshSpec(dp_replicate=2, dp_shard=4, tp=2)
    with pytest.raises(MeshError) as err:
        spec.coordinate(rank)
    assert f"rank {rank} is outside the mesh" in str(err.value)
    assert "dp_replicate(2) * dp_shard(4) * tp(2) = 16" in str(err.value)


def test_rank_of_rejects_out_of_range_and_unknown_coordinates() -> None:
    spec = MeshSpec(dp_shard=4, tp=2)
    with pytest.raises(MeshError, match=r"tp=2 is outside mesh dim tp\(2\)"):
        spec.rank_of({"dp_shard": 0, "tp": 2})
    with pytest.raises(MeshError, match=r"dp_shard=-1 is outside"):
        spec.rank_of({"dp_shard": -1})
    with pytest.raises(MeshError, match=r"no mesh dim 'tpp'.*did you mean 'tp'"):
        spec.rank_of({"tpp": 1})


# -- rank groups by hand -----------------------------------------------------------------


def test_rank_groups_of_a_known_hsdp_layout() -> None:
    spec = MeshSpec(dp_replicate=2, dp_shard=4)
    assert spec.rank_groups("dp_shard") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert spec.rank_groups("dp_replicate") == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_size_one_dim_has_singleton_groups() -> None:
    spec = MeshSpec(dp_shard=4, tp=1)
    assert spec.rank_groups("tp") == [(0,), (1,), (2,), (3,)]


# -- rank groups equal DeviceMesh's (fake process group, one process) ---------------------

LAYOUTS = [
    {"dp_shard": 8},
    {"dp_replicate": 2, "dp_shard": 4},
    {"dp_replicate": 4, "dp_shard": 8},
    {"dp_shard": 8, "dp_replicate": 4},  # a reversed HSDP mesh lays out just as well
    {"a": 2, "b": 2, "c": 2},
    {"dp_replicate": 2, "dp_shard": 4, "tp": 8},
    {"pp": 3, "dp_shard": 1, "tp": 2},
    {"w": 2, "x": 3, "y": 1, "z": 2},
]


def _device_mesh(spec: MeshSpec) -> object:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", spec.sizes, mesh_dim_names=spec.names)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "x".join(f"{k}{v}" for k, v in d.items()))
def test_every_rank_gets_the_group_device_mesh_builds(fake_world, layout) -> None:  # type: ignore[no-untyped-def]
    """For every rank of the world: its DeviceMesh group on each mesh dim is ours."""
    import torch.distributed as dist

    spec = MeshSpec(**layout)
    for rank in range(spec.world_size):
        fake_world(spec.world_size, rank)
        mesh = _device_mesh(spec)
        assert mesh.mesh_dim_names == spec.names  # type: ignore[attr-defined]
        for name in spec.names:
            group = mesh.get_group(name)  # type: ignore[attr-defined]
            got = tuple(dist.get_process_group_ranks(group))
            assert rank in got, (layout, rank, name)
            assert got in spec.rank_groups(name), (layout, rank, name)
            assert mesh.get_local_rank(name) == spec.coordinate(rank)[name]  # type: ignore[attr-defined]
        # The rank's coordinate in the mesh tensor is ours too.
        assert list(mesh.get_coordinate()) == [spec.coordinate(rank)[n] for n in spec.names]  # type: ignore[attr-defined]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "x".join(f"{k}{v}" for k, v in d.items()))
def test_all_groups_in_device_mesh_order(fake_world, layout) -> None:  # type: ignore[no-untyped-def]
    """The whole list of groups per mesh dim, in the order DeviceMesh creates them."""
    from torch.distributed._mesh_layout import _MeshLayout

    spec = MeshSpec(**layout)
    fake_world(spec.world_size, 0)
    mesh = _device_mesh(spec)
    assert mesh.mesh.flatten().tolist() == list(range(spec.world_size))  # type: ignore[attr-defined]
    for i, name in enumerate(spec.names):
        size = spec.size(name)
        # What DeviceMesh._init_one_process_group passes to new_group, in order.
        created = _MeshLayout([mesh._layout[i]]).remap_to_tensor(mesh._rank_map)  # type: ignore[attr-defined]
        assert [tuple(g) for g in created.tolist()] == spec.rank_groups(name)
        # The textbook view of the mesh tensor: same groups (its order of groups differs).
        swapped = mesh.mesh.swapdims(-1, i).reshape(-1, size).tolist()  # type: ignore[attr-defined]
        assert sorted(tuple(g) for g in swapped) == sorted(spec.rank_groups(name))


def test_build_makes_the_named_device_mesh_and_infers_minus_one(fake_world) -> None:  # type: ignore[no-untyped-def]
    fake_world(8, 5)
    mesh = MeshSpec(dp_replicate=2, dp_shard=-1).build("cpu")
    assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
    assert tuple(mesh.shape) == (2, 4)
    assert list(mesh.get_coordinate()) == [1, 1]
    back = MeshSpec.from_device_mesh(mesh)
    assert back == MeshSpec(dp_replicate=2, dp_shard=4)


def test_build_rejects_a_mesh_that_does_not_fit_the_world(fake_world) -> None:  # type: ignore[no-untyped-def]
    fake_world(32, 0)
    with pytest.raises(MeshError, match=r"= 64 != world_size\(32\)"):
        MeshSpec(dp_replicate=4, dp_shard=8, tp=2).build("cpu")


def test_build_without_a_process_group_says_how_to_get_one() -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(MeshError, match="torchrun"):
        MeshSpec(dp_shard=2).build("cpu")


def test_from_device_mesh_needs_dim_names(fake_world) -> None:  # type: ignore[no-untyped-def]
    from torch.distributed.device_mesh import init_device_mesh

    fake_world(4, 0)
    mesh = init_device_mesh("cpu", (2, 2))
    with pytest.raises(MeshError, match="mesh_dim_names"):
        MeshSpec.from_device_mesh(mesh)


# -- properties --------------------------------------------------------------------------

NAMES = ("dp_replicate", "dp_shard", "cp", "tp")


@st.composite
def meshes(draw: st.DrawFn) -> MeshSpec:
    count = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(1, 8), min_size=count, max_size=count))
    names = draw(st.permutations(NAMES))[:count]
    return MeshSpec.from_pairs(zip(names, sizes, strict=True))


@settings(max_examples=60, deadline=None)
@given(meshes())
def test_rank_groups_partition_the_ranks(spec: MeshSpec) -> None:
    world = spec.world_size
    coords = [spec.coordinate(r) for r in range(world)]
    for name in spec.names:
        groups = spec.rank_groups(name)
        size = spec.size(name)
        assert len(groups) == world // size
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(world))  # a partition: each rank exactly once
        for group in groups:
            assert len(group) == size
            # Within a group only the coordinate on `name` varies, and it counts up.
            assert [coords[r][name] for r in group] == list(range(size))
            first = coords[group[0]]
            for r in group:
                assert {k: v for k, v in coords[r].items() if k != name} == {
                    k: v for k, v in first.items() if k != name
                }


@settings(max_examples=60, deadline=None)
@given(meshes(), st.data())
def test_coordinate_round_trip_property(spec: MeshSpec, data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, spec.world_size - 1))
    coord = spec.coordinate(rank)
    assert list(coord) == list(spec.names)
    assert all(0 <= coord[n] < spec.size(n) for n in spec.names)
    assert spec.rank_of(coord) == rank


@settings(max_examples=60, deadline=None)
@given(meshes(), st.data())
def test_inference_property(spec: MeshSpec, data: st.DataObject) -> None:
    """Replacing any one size by -1 and resolving on the world size gives the mesh back."""
    index = data.draw(st.integers(0, len(spec.dims) - 1))
    pairs = [(n, INFER if i == index else s) for i, (n, s) in enumerate(spec.dims)]
    partial = MeshSpec.from_pairs(pairs)
    assert partial.resolve(spec.world_size) == spec
    known = math.prod(s for i, s in enumerate(spec.sizes) if i != index)
    bad = spec.world_size + 1
    if bad % known:
        assert partial.check_world_size(bad) is not None
