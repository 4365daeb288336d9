"""Gradient accumulation under each sync policy of the training step: what each costs.

For ``grad_accum`` = k micro-batches per optimizer step, the training step's ``sync``
(``plan.training_step(model, loss_fn, accumulate=k, sync=...)``) decides when FSDP2 and
HSDP reduce (docs/accumulation.md):

* ``"last"``: one reduce-scatter and one replicate all-reduce per unit per step; every
  unit keeps its unsharded gradients between micro-batches (split by TP only, in the
  reduce dtype);
* ``"reduce_scatter"``: k reduce-scatters, one all-reduce per unit; sharded gradients;
* ``"every"``: k of each; sharded gradients.

:func:`sync_costs` gives, for each policy, the gradient bytes a rank holds and the
gradient reduce-scatters (shard dims) and all-reduces (replicate dims) of one optimizer
step, calls and payload, from the estimator's own memory and collective accounting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.estimate.collectives import communication
from composer_par.estimate.memory import memory_per_rank
from composer_par.gradient_sync import SYNC_POLICIES
from composer_par.plugin.base import Role

if TYPE_CHECKING:
    from composer_par.estimate.layout import Layout
    from composer_par.estimate.model_shape import ModelShape
    from composer_par.estimate.parts import EstimatePart
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
    layout: Layout, model: ModelShape, workload: Workload,
    parts: Sequence[tuple[str, EstimatePart]], *, dtype: str, reduce_dtype: str, mode: str,
    tp: int, shard: int,
) -> tuple[SyncCost, ...]:
    """Each policy of :data:`SYNC_POLICIES` for ``workload.grad_accum`` micro-batches."""
    roles = {d.name: d.role for d in layout.dims}
    out = []
    for sync in SYNC_POLICIES:
        work = attrs.evolve(workload, sync=sync)
        memory = memory_per_rank(layout, model, work, parts, dtype=dtype,
                                 reduce_dtype=reduce_dtype, mode=mode, tp=tp, shard=shard)
        collectives, _ = communication(layout, model, work, parts, dtype=dtype,
                                       reduce_dtype=reduce_dtype, mode=mode, tp=tp,
                                       shard=shard)
        scatters = [c for c in collectives
                    if c.kind == "reduce_scatter" and roles.get(c.dim) is Role.SHARD]
        reduces = [c for c in collectives
                   if c.kind == "all_reduce" and roles.get(c.dim) is Role.REPLICATE]
        out.append(SyncCost(
            sync, memory.grads,
            unsharded=shard > 1 and sync == "last" and workload.grad_accum > 1,
            reduce_scatter_calls=sum(c.calls for c in scatters),
            reduce_scatter_bytes=sum(c.payload for c in scatters),
            all_reduce_calls=sum(c.calls for c in reduces),
            all_reduce_bytes=sum(c.payload for c in reduces)))
    return tuple(out)


__all__ = ["SyncCost", "sync_costs"]
