"""Layout-invariant initialization of one module: the torch side of MetaInit.

Plugins import this module when they materialize (it imports torch at its top: it runs
for every module of the model, so its helpers must not import anything per call).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

InitFn = Callable[[nn.Module], None]
TieGroup = list[tuple[nn.Module, str]]


def seed_device(device: torch.device, seed: int) -> None:
    """Seed the generator that init ops on ``device`` draw from, and no other.

    ``torch.manual_seed`` would also seed every accelerator, lazily: each call records a
    stack (about a millisecond, per module), and the accelerators' states would change
    behind fork_rng, which saves only the devices it is given.
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(seed)
    else:
        torch.random.default_generator.manual_seed(seed)


def init_module(module: nn.Module, init: InitFn, device: torch.device, seed: int) -> int:
    """Initialize ``module``'s own parameters as if they were whole, seeded with ``seed``,
    and keep this rank's part of each; the caller's random state is left as it was.

    Sharded (DTensor) parameters get full-size scratch tensors for the call; plain ones
    are written in place. Returns the bytes of scratch tensors held at once.
    """
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        seed_device(device, seed)
        return _init_with_full_tensors(module, init, device)


def _init_with_full_tensors(module: nn.Module, init: InitFn, device: torch.device) -> int:
    originals = {n: p for n, p in module._parameters.items() if p is not None}
    scratch_bytes = 0
    for name, param in originals.items():
        if isinstance(param, DTensor):
            full = torch.empty(param.shape, dtype=param.dtype, device=device)
            module._parameters[name] = nn.Parameter(full, requires_grad=param.requires_grad)
            scratch_bytes += full.numel() * full.element_size()
    try:
        with torch.no_grad():
            init(module)
            for name, original in originals.items():
                result = module._parameters[name]
                if result is not original and result is not None:
                    keep_local_part(original, result.detach())
    finally:
        for name, original in originals.items():
            module._parameters[name] = original
    return scratch_bytes


def keep_local_part(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into ``target`` (a DTensor or a plain tensor)."""
    if isinstance(target, DTensor):
        # src_data_rank=None: every rank slices its own part locally, no communication;
        # every rank computed the same full tensor from the same seed.
        local = distribute_tensor(
            full, target.device_mesh, target.placements, src_data_rank=None
        ).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)


def tie_groups(model: nn.Module) -> list[TieGroup]:
    """Parameters registered under several names (tied weights, e.g. an embedding shared
    with the output head), as ``[(module, attribute), ...]`` groups of two or more."""
    by_param: dict[int, TieGroup] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                by_param.setdefault(id(param), []).append((module, name))
    return [group for group in by_param.values() if len(group) > 1]


def to_empty_keeping_ties(model: nn.Module, device: torch.device) -> None:
    """``to_empty``, then each tied group made one parameter again: ``to_empty`` gives every
    registration its own new tensor, which silently unties them."""
    groups = tie_groups(model)
    model.to_empty(device=device)
    for (first_module, first_name), *rest in groups:
        shared = first_module._parameters[first_name]
        for module, name in rest:
            module._parameters[name] = shared
