"""Tensors split by a strided placement alone, as DCP chunks.

TP's packed projections (a fused gate and up, an expert's packed ``gate_up_proj``) are
split with ``_StridedShard`` so that each rank holds a slice of every packed part: a
rank's part of the tensor is then several boxes of it. DTensor describes its part to DCP
as one box (torch 2.13's ``compute_local_shape_and_global_offset``), with the wrong
offsets: a save fails (ranks' chunks overlap) and a load into such a tensor would read
other values. :func:`for_dcp` hands DCP those tensors as :class:`Boxed`: the same local
tensor, described as its boxes, so DCP saves, loads and reshards them as any sharded
tensor, each rank writing and reading only its own part.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def held_indices(tensor: Any) -> list[torch.Tensor]:
    """For each dim of ``tensor`` (a DTensor or a plain tensor), the global index of each
    of this rank's positions along it, in local order. A placement splits one dim, so
    each dim's indices are those of a 1-D tensor split by the placements on that dim."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from composer_par.plugin import torch_private

    strided_shard = torch_private.strided_shard()
    if not isinstance(tensor, DTensor):
        return [torch.arange(n) for n in tensor.shape]
    out = []
    for dim, size in enumerate(tensor.shape):
        placements: list[Any] = []
        for p in tensor.placements:
            if isinstance(p, strided_shard) and p.dim == dim:
                placements.append(strided_shard(0, split_factor=p.split_factor))
            elif isinstance(p, Shard) and p.dim == dim:
                placements.append(Shard(0))
            else:
                placements.append(Replicate())
        index = torch.arange(size, device=tensor.device_mesh.device_type)
        out.append(distribute_tensor(index, tensor.device_mesh, placements,
                                     src_data_rank=None).to_local().cpu())
    return out


def runs(indices: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(first index, length, first position)`` of each run of consecutive indices."""
    out: list[tuple[int, int, int]] = []
    values = indices.tolist()
    for position, value in enumerate(values):
        if out and value == values[position - 1] + 1:
            first, length, start = out[-1]
            out[-1] = (first, length + 1, start)
        else:
            out.append((value, 1, position))
    return out


def boxes(tensor: Any) -> list[Box]:
    """This rank's part of ``tensor`` as boxes of the whole: ``(global offsets, sizes,
    local offsets)`` each, in local order."""
    per_dim = [runs(indices) for indices in held_indices(tensor)]
    return [(tuple(r[0] for r in combo), tuple(r[1] for r in combo),
             tuple(r[2] for r in combo)) for combo in itertools.product(*per_dim)]


def _boxed_class() -> type:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.tensor import DTensor

    from composer_par.plugin import torch_private

    class Boxed(DTensor):
        """A DTensor whose part on this rank is described to DCP as its boxes."""

        _boxes: list[Box]

        def _local_box(self, offsets: Any) -> torch.Tensor:
            for begin, sizes, local in self._boxes:
                if tuple(begin) == tuple(offsets):
                    view = torch_private.local_tensor(self)
                    for dim, (start, length) in enumerate(zip(local, sizes, strict=True)):
                        view = view.narrow(dim, start, length)
                    return view
            raise ValueError(f"no part of this rank begins at {list(offsets)}")

        def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
            properties = TensorProperties.create_from_tensor(torch_private.local_tensor(self))
            return [WriteItem(index=MetadataIndex(fqn, torch_size(begin)),
                              type=WriteItemType.SHARD,
                              tensor_data=TensorWriteData(
                                  chunk=ChunkStorageMetadata(offsets=torch_size(begin),
                                                             sizes=torch_size(sizes)),
                                  properties=properties, size=self.size()))
                    for begin, sizes, _ in self._boxes]

        def __create_chunk_list__(self) -> list[Any]:
            return [ChunkStorageMetadata(offsets=torch_size(begin), sizes=torch_size(sizes))
                    for begin, sizes, _ in self._boxes]

        def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
            return self._local_box(index.offset)

    return Boxed


def torch_size(values: Any) -> torch.Size:
    import torch

    return torch.Size(values)


_BOXED: list[type] = []


def boxed(tensor: Any) -> Any:
    """``tensor`` (a DTensor) as a :class:`Boxed` sharing its local tensor."""
    if not _BOXED:
        _BOXED.append(_boxed_class())
    cls = _BOXED[0]
    from composer_par.plugin import torch_private

    out = cls(torch_private.local_tensor(tensor), torch_private.dtensor_spec(tensor),
              requires_grad=False)
    out._boxes = boxes(tensor)
    return out


def strided_alone(placements: Any) -> bool:
    """A strided split that is not FSDP2's own (``_StridedShard(d)`` on the shard dim over
    ``Shard(d)`` on an inner dim): TP's packed projections, each rank holding a slice of
    each packed part. A rank's part is then several boxes of the tensor, while DTensor
    describes it to DCP as one: checkpoints describe it box by box (:func:`for_dcp`), and
    the safetensors export gathers it whole."""
    from torch.distributed.tensor import Shard

    from composer_par.plugin import torch_private

    strided_shard = torch_private.strided_shard()

    for i, placement in enumerate(placements):
        if isinstance(placement, strided_shard) and not any(
                isinstance(p, Shard) and not isinstance(p, strided_shard)
                and p.dim == placement.dim for p in placements[i + 1:]):
            return True
    return False


def for_dcp(state: Any) -> Any:
    """``state`` (a nested state dict) with each tensor a strided placement alone splits
    replaced by its :func:`boxed` form; everything else as it is. The boxed tensors share
    the originals' storage, so what DCP loads into them lands in the originals."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: for_dcp(v) for k, v in state.items()}
    if isinstance(state, list):
        return [for_dcp(v) for v in state]
    if isinstance(state, DTensor) and strided_alone(state.placements):
        return boxed(state)
    return state
