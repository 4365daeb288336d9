"""The replica check: every replicated parameter still equal on every rank holding it.

    check_replicas(model)                                   # raises ReplicaDriftError
    step = plan.training_step(model, loss_fn)               # checks every EVERY-th step
    step = plan.training_step(model, loss_fn, check_replicas_every=None)  # opted out
    guard_optimizer(optimizer, model)                       # a trainer's own loop

On by default: ``plan.training_step`` and every trainer adapter check before every
:data:`EVERY`-th optimizer step (the first included), an interval at which the check
costs at most 0.1 % of a training step (``benchmarks/bench_replica_check.py``).

A parameter is replicated over a mesh dim when its DTensor placement on that dim is
``Replicate()``: TP's norms over ``tp``, FSDP2 parameters under HSDP over
``dp_replicate``. A plain (non-DTensor) parameter is replicated over every rank of
``plain_group`` (the world by default, as under replicate-only data parallel). Nothing
keeps those copies equal but the arithmetic being the same on every rank; when it is not
(a gradient reduced over the wrong group, a rank-dependent init, a nondeterministic
kernel), the copies drift apart silently and training goes on with several models.

The check is one collective per replicated group: each rank computes, for each of its
parameters replicated over that group, two integer checksums of its local tensor and
all-gathers them, so every rank of the group sees every rank's checksums and compares
them alike. One all-reduce of a flag over the world then tells every rank whether some
group drifted; if one did, the findings are gathered everywhere and every rank raises
the same :class:`ReplicaDriftError` (none goes on to wait on another that raised),
naming the parameter, the mesh dim and the global ranks of each distinct value.

The checksums read the tensor's bits as integers: the sum of the bit patterns, and their
sum weighted by position (both wrapping in int64). A change of any one element changes
its bit pattern, so it changes the first sum by a nonzero amount below 2**32 for every
dtype, which no wrap-around can cancel: one changed element is always caught, however
small the change (a float sum can absorb a last-bit change into a large total). The
weighted sum also catches elements that moved. Integer sums do not depend on the order
of addition, so equal tensors give equal checksums whatever the kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from composer_par.blocks import clean_name

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

# Integer dtype of each element width, to read a tensor's bits.
_BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}

#: The default interval of the check, in optimizer steps: one check costs well under a
#: step even when every parameter is replicated (benchmarks/bench_replica_check.py), so
#: at this interval it costs at most 0.1 % of a step.
EVERY = 100


def check_every(value: object) -> int | None:
    """``value`` as a check interval (a positive int, or None: no check); ValueError."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise ValueError(f"check_replicas_every must be a positive int or None (no check); "
                         f"got {value!r}")
    return value


class ReplicaDriftError(RuntimeError):
    """Replicated parameters differ across the ranks that hold them.

    ``drifts`` lists each case as ``(parameter, dim, ranks by value)``: the clean
    parameter name, the mesh dim (``"world"`` or the group's name for plain parameters)
    and the group's global ranks, partitioned by the value each holds."""

    def __init__(self, drifts: list[tuple[str, str, list[list[int]]]]) -> None:
        self.drifts = drifts
        lines = [f"  {name} over {dim}: ranks " + " != ".join(str(r) for r in ranks)
                 for name, dim, ranks in drifts]
        super().__init__(
            f"{len(drifts)} replicated parameter(s) differ across their replicas:\n"
            + "\n".join(lines))


# Elements read per pass: the int64 copies a pass makes stay this small, whatever the
# parameter (an embedding of half a billion elements would otherwise need three int64
# copies of itself at once).
CHUNK = 1 << 22


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 checksums of ``tensor``'s bits: their sum and their position-weighted
    sum (see the module), read :data:`CHUNK` elements at a time (integer sums wrap
    alike in any grouping, so the result is the same as in one pass)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    width = flat.element_size()
    if width not in _BITS:  # complex: read as pairs of its parts
        flat = torch.view_as_real(flat).reshape(-1)
        width = flat.element_size()
    bits = flat.view(getattr(torch, _BITS[width]))
    total = torch.zeros(2, dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), CHUNK):
        part = bits[start:start + CHUNK].to(torch.int64)
        position = torch.arange(start + 1, start + part.numel() + 1, dtype=torch.int64,
                                device=bits.device)
        total += torch.stack([part.sum(), (part * position).sum()])
    return total


def _replicated(model: nn.Module, plain_group: Any
                ) -> Iterator[tuple[str, str, Any, torch.Tensor]]:
    """``(clean name, dim name, group, local tensor)`` for each parameter and each group
    it is replicated over."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        seen.add(id(param))
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            names = mesh.mesh_dim_names or tuple(str(d) for d in range(mesh.ndim))
            for dim, placement in enumerate(param.placements):
                if placement.is_replicate() and mesh.size(dim) > 1:
                    yield clean_name(name), names[dim], mesh.get_group(dim), param.to_local()
        elif plain_group is not None:
            yield clean_name(name), "world", plain_group, param


def check_replicas(model: nn.Module, *, plain_group: Any = "world") -> None:
    """Raise :class:`ReplicaDriftError` on every rank if a replicated parameter of
    ``model`` differs across the ranks holding it (see the module).

    Call it on every rank at the same point (a collective per replicated group).
    ``plain_group`` is the process group plain parameters are replicated over: the
    default process group by default, ``None`` to leave plain parameters unchecked (a
    pipeline stage's, which no other stage holds). Without an initialized process group
    there are no replicas and it returns at once."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if plain_group == "world":
        plain_group = dist.group.WORLD if dist.get_world_size() > 1 else None
    # One batch per (dim, ranks): parameters on different meshes sharing a group go
    # together, and every rank of a group issues its collectives in the same order.
    batches: dict[tuple[str, tuple[int, ...]], tuple[Any, list[str], list[torch.Tensor]]] = {}
    for name, dim, group, local in _replicated(model, plain_group):
        ranks = tuple(dist.get_process_group_ranks(group))
        _, names, sums = batches.setdefault((dim, ranks), (group, [], []))
        names.append(name)
        sums.append(checksum(local))
    drifts: list[tuple[str, str, list[list[int]]]] = []
    for (dim, ranks), (group, names, sums) in sorted(batches.items(), key=lambda kv: kv[0]):
        mine = torch.stack(sums)
        gathered = [torch.empty_like(mine) for _ in ranks]
        dist.all_gather(gathered, mine, group=group)
        every = torch.stack(gathered).cpu()  # (ranks, parameters, 2)
        differs = (every != every[:1]).any(dim=2).any(dim=0)
        for index in differs.nonzero().flatten().tolist():
            by_value: dict[tuple[int, ...], list[int]] = {}
            for rank, row in zip(ranks, every[:, index].tolist(), strict=True):
                by_value.setdefault(tuple(row), []).append(rank)
            drifts.append((names[index], dim, list(by_value.values())))
    drifts = _everyone_s(drifts)
    if drifts:
        raise ReplicaDriftError(drifts)


def guard_optimizer(optimizer: Any, model: nn.Module | Any, *, every: int | None = EVERY,
                    plain_group: Any = "world") -> Any:
    """Check the replicas of ``model`` (a module, or several in a list) before every
    ``every``-th ``optimizer.step()`` (the first included), on every rank: what a
    trainer adapter installs, so that a loop the user writes is guarded as
    ``plan.training_step`` is. Returns the hook's handle (``.remove()`` it to stop), or
    None with ``every=None``. ``plain_group``: as :func:`check_replicas`."""
    every = check_every(every)
    if every is None:
        return None
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    taken = [0]

    def before_step(opt: Any, args: Any, kwargs: Any) -> None:
        if taken[0] % every == 0:
            for each in models:
                check_replicas(each, plain_group=plain_group)
        taken[0] += 1

    return optimizer.register_step_pre_hook(before_step)


def _everyone_s(drifts: list[tuple[str, str, list[list[int]]]]
                ) -> list[tuple[str, str, list[list[int]]]]:
    """The drifts every rank found, on every rank: a rank outside the groups that drifted
    raises too, rather than going on to wait in the next step's collectives."""
    import torch
    import torch.distributed as dist

    found = torch.tensor([len(drifts)], dtype=torch.int64, device=_device_of_world())
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    if not int(found.item()):
        return []
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, drifts)
    merged: list[tuple[str, str, list[list[int]]]] = []
    for name, dim, ranks in (drift for found_by in every for drift in found_by):
        if (name, dim, ranks) not in merged:
            merged.append((name, dim, ranks))
    return merged


def _device_of_world() -> Any:
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


__all__ = ["EVERY", "ReplicaDriftError", "check_every", "check_replicas", "checksum",
           "guard_optimizer"]
