"""What offloading the optimizer state to files saves on the device, for ``composer-par
estimate``: between steps no unit's state is in memory, and the step holds one unit's
at a time (the largest). No torch."""

from __future__ import annotations

from typing import Any

from composer_par.plugin import EstimatePart, MemoryTerm, held_elements, optimizer_bytes

ACCOUNTING = (
    "offload: the optimizer states live in files between steps; the step reads, updates "
    "and writes one unit's at a time (an FSDP2 unit, else about unit_bytes of parameters), "
    "so the device holds the largest unit's",
)


def estimate_part(unit_bytes: int, layout: Any, model: Any, workload: Any,
                  stage: Any) -> EstimatePart | None:
    mixed = workload.dtype in ("bfloat16", "float16")
    per_param = optimizer_bytes(workload.optimizer, mixed)
    if not per_param:
        return None
    tp, shard = layout.tensor_parallel_size(), layout.shard_size()
    held = held_elements(layout, model, tp, shard)
    if shard > 1:
        largest = max((g.local_numel(tp, shard if not g.apart else layout.shard_size(g.apart))
                       for g in model.groups), default=0)
    else:
        parameter_bytes = 2 if mixed else 4
        largest = min(held, max(1, unit_bytes // parameter_bytes))
    return EstimatePart(terms=(
        MemoryTerm("optimizer", -held * per_param, "optimizer states in files between steps"),
        MemoryTerm("optimizer", largest * per_param,
                   "the one unit's optimizer states the step holds", transient=True)),
        accounting=ACCOUNTING)


__all__ = ["ACCOUNTING", "estimate_part"]
