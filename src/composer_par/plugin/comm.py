"""Comm hooks: a plugin customizes the collectives of ONE mesh dim.

A plugin answers the composition hook ``composer_par_comm_hooks`` with :class:`CommHook`
values; the data-parallel plugin that owns the dim consults them when it shards or
replicates, and installs them on every FSDP module it made (FSDP2's setters act on the
module they are called on, not on its FSDP submodules). What can be customized depends
on the role of the dim:

* a **replicate** dim (HSDP's): the gradient **all-reduce**. The hook receives a
  :class:`GradBucket` -- one FSDP module's flat gradient buffer (already reduce-scattered
  over the shard dim, if any), per-parameter views into it, the process group of the
  dim and the divisor that turns the group's sum into the gradient the optimizer must
  see -- and reduces it in place.

  - With FSDP2 (HSDP): FSDP2 builds a 1-D ``fully_shard`` mesh over its shard dim only,
    so FSDP2 never all-reduces over the replicate dim; the hook runs through
    ``FSDPModule.set_all_reduce_hook``, which FSDP2 calls with the reduce-scatter
    output of each module.
  - Alone (replicate-only): torch's ``replicate`` all-reduces *before* its
    ``set_all_reduce_hook`` runs (measured: the hook sees the already-reduced gradient,
    and a compressing hook would add its bytes to the full fp32 all-reduce). So the
    replicate modules' own all-reduce is pointed at a 1-rank process group (it moves no
    bytes), and the hook does the reduction over the dim's group. Parameters keep the
    layout of the plan without the hook: ``(Replicate(),)`` DTensors over the dim.

* a **shard** dim (FSDP2's): the parameter **all-gather** and the gradient
  **reduce-scatter**, through FSDP2's custom comm classes (``set_custom_all_gather`` /
  ``set_custom_reduce_scatter``): the hook's factories return instances of
  ``torch.distributed.fsdp._fully_shard._fsdp_api.AllGather`` / ``ReduceScatter``.

Validation (static, no torch): a hook on a dim no data-parallel plugin owns is CP218,
two plugins hooking one dim CP219, a collective the dim does not run (an all-reduce on
a shard dim, an all-gather on a replicate dim) CP220.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from composer_par.plugin.base import Role

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from composer_par.plugin.context import ApplyContext

__all__ = [
    "COLLECTIVES",
    "CommHook",
    "CommSetup",
    "GradBucket",
    "GradReducer",
    "InstalledCommHook",
    "all_reduce_mean",
]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
# Which collectives the owner of a dim runs over it, by the owner's role.
RUNS: dict[Role, frozenset[str]] = {
    Role.REPLICATE: frozenset({"all_reduce"}),
    Role.SHARD: frozenset({"all_gather", "reduce_scatter"}),
}


@attrs.frozen
class CommSetup:
    """What a comm-hook factory is told at apply time, once per plan apply and dim."""

    dim: str
    size: int  # the size of the mesh dim (the group size)
    group: dist.ProcessGroup  # the dim's process group for this rank
    device: torch.device
    ctx: ApplyContext


@attrs.define(eq=False)
class GradBucket:
    """One FSDP module's gradients on their way over a replicate dim.

    Reduce ``buffer`` in place: afterwards it must hold the sum over ``group`` divided
    by ``divisor``, the same on every rank of the group.
    """

    key: str  # a stable name for per-bucket state (the FSDP module's path, "<root>")
    buffer: torch.Tensor  # flat, 1-D, in the reduce dtype (fp32 unless mixed precision)
    # (parameter name, view of this rank's gradient shard in ``buffer``) in buffer order;
    # None when the layout is not known (e.g. some parameters got no gradient).
    params: tuple[tuple[str, torch.Tensor], ...] | None
    group: dist.ProcessGroup
    divisor: float  # the group size, or 1.0 when a gradient divide factor already divided


class GradReducer(Protocol):
    """What an all-reduce factory returns: called once per FSDP module per backward."""

    def __call__(self, bucket: GradBucket) -> None: ...


AllReduceFactory = Callable[[CommSetup], GradReducer]
CommFactory = Callable[[CommSetup], Any]


@attrs.frozen
class CommHook:
    """A plugin's customization of the collectives over one mesh dim.

    Give ``all_reduce`` for a replicate dim; ``all_gather`` and/or ``reduce_scatter``
    for a shard dim. Each is a factory called once per apply with a :class:`CommSetup`
    (so creating state, and importing torch, waits until then); ``plugin`` is filled in
    with the name of the plugin that answered.
    """

    dim: str
    all_reduce: AllReduceFactory | None = None
    all_gather: CommFactory | None = None
    reduce_scatter: CommFactory | None = None
    description: str = ""
    plugin: str | None = None

    def collectives(self) -> tuple[str, ...]:
        return tuple(c for c in COLLECTIVES if getattr(self, c) is not None)


@attrs.frozen
class InstalledCommHook:
    """A record, in ``ctx.installed_comm_hooks``, of one hook an owner installed."""

    dim: str
    plugin: str
    collective: str
    modules: int
    owner: str


def all_reduce_mean(bucket: GradBucket) -> None:
    """The plain reduction: SUM over the group, then divide. A reference for hook authors."""
    import torch.distributed as dist

    dist.all_reduce(bucket.buffer, group=bucket.group)
    bucket.buffer.div_(bucket.divisor)
