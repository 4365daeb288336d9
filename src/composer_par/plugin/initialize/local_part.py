"""This rank's part of a whole tensor: what a rank keeps of a parameter initialized (or
gathered) whole."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def keep_local_part(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into ``target`` (a DTensor or a plain tensor)."""
    if isinstance(target, DTensor):
        local_target = target.to_local()
        local = _local_slice(full, target)
        if local is None or local.shape != local_target.shape:
            # src_data_rank=None: every rank slices its own part locally, no
            # communication; every rank computed the same full tensor from the same seed.
            local = distribute_tensor(
                full, target.device_mesh, target.placements, src_data_rank=None
            ).to_local()
        local_target.copy_(local)
    else:
        target.copy_(full)


def _local_slice(full: torch.Tensor, target: DTensor) -> torch.Tensor | None:
    """This rank's part of ``full`` under ``target``'s placements, as a view, for the
    plain placements (``Shard`` and ``Replicate``, applied mesh dim by mesh dim as DTensor
    does, each split in ``torch.chunk``'s sizes); None for any other placement, which the
    caller hands to ``distribute_tensor``. It is DTensor's own split, worked out here:
    ``distribute_tensor`` would build and dispatch a DTensor for every parameter of the
    model, to keep a view of it."""
    from torch.distributed.tensor import Replicate, Shard

    from composer_par.plugin import torch_private

    strided_shard = torch_private.strided_shard()

    coordinate = target.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    part = full
    for mesh_dim, placement in enumerate(target.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard or isinstance(placement, strided_shard):
            return None
        dim = placement.dim if placement.dim >= 0 else placement.dim + part.dim()
        count = target.device_mesh.size(mesh_dim)
        size = part.size(dim)
        step = -(-size // count)  # torch.chunk's chunk size; the last chunks may be short
        start = min(step * coordinate[mesh_dim], size)
        part = part.narrow(dim, start, min(step, size - start))
    return part
