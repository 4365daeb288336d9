"""What HSDP costs a step, for ``composer-par estimate`` and ``suggest``: its gradient
all-reduces over the replicate dim (the logical payload bytes
:class:`~composer_par.testing.comm_count.CommCounter` counts) and, replicating alone, its
gradient buffer. Pure arithmetic: no torch.

Beside a sharding plugin, HSDP all-reduces each group's gradient shard (after the
reduce-scatter) over its dim; alone it all-reduces each group's whole gradient over its
dim and the dims data parallelism folds in (``dp_replicate x cp``), DDP-like, keeping one
group's gradients in a buffer. Groups set apart (expert parallelism's experts) reduce
over the group without the dims they differ along. Once per backward that reduces (the
training step's sync policy; a pipeline stage once per step), behind compute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from composer_par.plugin import (
    Collective,
    EstimatePart,
    MemoryTerm,
    ModelShape,
    Role,
    dtype_bytes,
)

if TYPE_CHECKING:
    from composer_par.plugin import EstimateStage

ACCOUNTING = (
    "hsdp: all-reduce each group's gradient shard over the replicate dim after the "
    "reduce-scatter (alone: each group's whole gradient, over the replicate dim and the "
    "folded dims, with one group's gradients buffered), behind compute",
)


def _all_reduce(dim: str, model: ModelShape, tp: int, shard: int, rs_bytes: int, times: int,
                group: int, nodes: int | None, why_prefix: str = "") -> list[Collective]:
    groups = [g for g in model.groups if g.numel]
    if not groups or group <= 1:
        return []
    payload = sum(g.local_numel(tp, shard) * g.count for g in groups) * rs_bytes
    calls = sum(g.count for g in groups)
    why = ("gradient shards after the reduce-scatter (HSDP)" if shard > 1
           else "gradients, per group (replicate alone, DDP-like)")
    wide = {} if nodes is None else {"group_size": group, "nodes": nodes}
    return [Collective(dim, "all_reduce", payload * times, calls * times, why_prefix + why,
                       overlap="compute", **wide)]


def estimate_part(hsdp: Any, layout: Any, model: ModelShape, workload: Any,
                  stage: EstimateStage | None) -> EstimatePart | None:
    """HSDP's terms for ``layout`` (its plugin object ``hsdp``: its dim)."""
    if hsdp.dim not in layout.mesh:
        return None
    dim = layout.dim(hsdp.dim)
    tp = layout.tensor_parallel_size()
    shard = layout.shard_size()
    rs_bytes = dtype_bytes(workload.reduce_dtype)
    times = (1 if stage.accumulates else stage.runs) if stage is not None \
        else workload.reductions()[1]
    together = attrs.evolve(model, groups=tuple(g for g in model.groups if not g.apart))
    apart = attrs.evolve(model, groups=tuple(g for g in model.groups if g.apart))
    collectives: list[Collective] = []
    if apart.groups:
        without = apart.groups[0].apart
        group, nodes = layout.data_parallel_group(dim, without)
        collectives += _all_reduce(dim.name, apart, tp, layout.shard_size(without), rs_bytes,
                                   times, group, nodes, "experts: ")
    group, nodes = layout.data_parallel_group(dim)
    collectives += _all_reduce(dim.name, together, tp, shard, rs_bytes, times, group, nodes)
    terms: tuple[MemoryTerm, ...] = ()
    if shard == 1 and layout.dims_with(Role.REPLICATE):
        blocks = [g for g in model.groups if g.block and g.numel]
        largest = max((g.padded_numel(tp, 1 if not g.apart else layout.shard_size(g.apart))
                        for g in blocks), default=0)
        terms = (MemoryTerm("buffers", largest * rs_bytes,
                            "one group's gradients, all-reduced whole", transient=True),)
    return EstimatePart(collectives=tuple(collectives), terms=terms, accounting=ACCOUNTING)


__all__ = ["ACCOUNTING", "estimate_part"]
