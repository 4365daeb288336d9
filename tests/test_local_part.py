"""keep_local_part slices a rank's part itself for plain placements; it must give exactly
what ``distribute_tensor`` gives, on every rank, for uneven sizes and every placement mix.

One process, torch's fake process group: the slicing is local (no communication), so a
fake world of any size shows each rank's part.
"""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

from composer_par.plugin.initialize.local_part import _local_slice, keep_local_part  # noqa: E402

SHAPES = [(7, 5), (3,), (1, 9), (8, 4), (2, 3, 5)]
MESHES = [(4,), (2, 2), (3, 2), (2, 2, 2)]


def _placements(ndim_mesh: int, ndim_tensor: int) -> list[tuple[object, ...]]:
    options: list[object] = [Replicate()] + [Shard(d) for d in range(ndim_tensor)] + [Shard(-1)]
    return list(itertools.product(options, repeat=ndim_mesh))


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_every_rank_keeps_the_part_distribute_tensor_gives(fake_world, mesh_shape) -> None:  # type: ignore[no-untyped-def]
    from torch.distributed.device_mesh import init_device_mesh

    world = 1
    for size in mesh_shape:
        world *= size
    checked = 0
    for rank in range(world):
        fake_world(world, rank)
        mesh = init_device_mesh("cpu", mesh_shape)
        for shape in SHAPES:
            full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
            for placements in _placements(len(mesh_shape), len(shape)):
                want = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
                target = distribute_tensor(torch.full(shape, -1.0), mesh, placements,
                                           src_data_rank=None)
                # The fast path itself gives the part, not only its fallback.
                sliced = _local_slice(full, target)
                assert sliced is not None and torch.equal(sliced, want), placements
                keep_local_part(target, full)
                got = target.to_local()
                assert got.shape == want.shape and torch.equal(got, want), (
                    rank, mesh_shape, shape, placements)
                checked += 1
    assert checked > 0


def test_a_strided_placement_goes_to_distribute_tensor(fake_world) -> None:  # type: ignore[no-untyped-def]
    """Placements this slicer does not describe (TP's packed and FSDP2xTP's strided
    splits) are left to torch, and still give torch's part."""
    from torch.distributed.device_mesh import init_device_mesh

    for rank in range(4):
        fake_world(4, rank)
        mesh = init_device_mesh("cpu", (2, 2))
        placements = (_StridedShard(0, split_factor=2), Shard(0))
        full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
        target = distribute_tensor(torch.zeros(8, 6), mesh, placements, src_data_rank=None)
        assert _local_slice(full, target) is None
        keep_local_part(target, full)
        want = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
        assert torch.equal(target.to_local(), want)
