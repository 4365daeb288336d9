"""How the offloaded optimizer's parameters are cut into units."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

Units = list[tuple[str, list["torch.Tensor"]]]


def fsdp_units(model: nn.Module) -> Units:
    """Each FSDP2 unit of ``model`` with its own parameters (not those of units inside
    it), bottom-up as FSDP2 shards them; empty without FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    units: Units = []
    inside: set[int] = set()
    for name, module in reversed(list(model.named_modules())):
        sharded = isinstance(module, FSDPModule)
        if not sharded:
            continue
        own = [p for p in module.parameters() if id(p) not in inside]
        inside.update(id(p) for p in own)
        if own:
            units.append((name or "root", own))
    return units


def chunk_units(optimizer: torch.optim.Optimizer, unit_bytes: int) -> Units:
    """The optimizer's parameters, in group order, in runs of about ``unit_bytes`` bytes
    of (local) parameters; a larger parameter is a unit of its own."""
    from torch.distributed.tensor import DTensor

    units: Units = []
    current: list[torch.Tensor] = []
    size = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            local = param.to_local() if isinstance(param, DTensor) else param
            nbytes = local.numel() * local.element_size()
            if current and size + nbytes > unit_bytes:
                units.append((f"chunk {len(units)}", current))
                current, size = [], 0
            current.append(param)
            size += nbytes
    if current:
        units.append((f"chunk {len(units)}", current))
    return units
