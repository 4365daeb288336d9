"""Gradient accumulation under each sync policy of the training step: what each costs.

For ``grad_accum`` = k micro-batches per optimizer step, the training step's ``sync``
(``plan.training_step(model, loss_fn, accumulate=k, sync=...)``) decides when the
data-parallel plugins reduce (docs/accumulation.md):

* ``"last"``: one reduce-scatter and one replicate all-reduce per unit per step; a
  sharding plugin keeps every unit's unsharded gradients between micro-batches;
* ``"reduce_scatter"``: k reduce-scatters, one all-reduce per unit; sharded gradients;
* ``"every"``: k of each; sharded gradients.

:func:`sync_costs` gives, for each policy, the gradient bytes a rank holds and the
gradient reduce-scatters (shard dims) and all-reduces (replicate dims) of one optimizer
step, calls and payload, from what the plan's plugins state under that policy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.gradient_sync import SYNC_POLICIES
from composer_par.plugin.base import Role

if TYPE_CHECKING:
    from composer_par.estimate.collectives import Collective
    from composer_par.estimate.layout import Layout
    from composer_par.estimate.memory import Memory
    from composer_par.estimate.workload import Workload


@attrs.frozen
class SyncCost:
    """One sync policy's gradient memory per rank and gradient reductions per step."""

    sync: str
    grads: int  # gradient bytes a rank holds between micro-batches
    unsharded: bool  # the gradients held are every unit's whole, not its shard
    reduce_scatter_calls: int
    reduce_scatter_bytes: int
    all_reduce_calls: int
    all_reduce_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def sync_costs(
    layout: Layout, workload: Workload,
    terms_of: Callable[[Workload], tuple[Memory, list[Collective]]],
) -> tuple[SyncCost, ...]:
    """Each policy of :data:`SYNC_POLICIES` for ``workload.grad_accum`` micro-batches;
    ``terms_of(workload)``: the memory and collectives of the plan under that workload."""
    roles = {d.name: d.role for d in layout.dims}
    out = []
    for sync in SYNC_POLICIES:
        memory, collectives = terms_of(attrs.evolve(workload, sync=sync))
        scatters = [c for c in collectives
                    if c.kind == "reduce_scatter" and roles.get(c.dim) is Role.SHARD]
        reduces = [c for c in collectives
                   if c.kind == "all_reduce" and roles.get(c.dim) is Role.REPLICATE]
        out.append(SyncCost(
            sync, memory.grads,
            unsharded=layout.shard_size() > 1 and sync == "last" and workload.grad_accum > 1,
            reduce_scatter_calls=sum(c.calls for c in scatters),
            reduce_scatter_bytes=sum(c.payload for c in scatters),
            all_reduce_calls=sum(c.calls for c in reduces),
            all_reduce_bytes=sum(c.payload for c in reduces)))
    return tuple(out)


__all__ = ["SyncCost", "sync_costs"]
