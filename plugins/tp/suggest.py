"""What ``composer-par suggest`` may try of TP: its dim at the sizes that divide the devices
of a node (its collectives stay on the node's links) and the head and K/V-head counts,
with sequence parallelism. No torch."""

from __future__ import annotations

from typing import Any

from composer_par.plugin import Role, SuggestAxis, SuggestChoice, SuggestContext

#: Where TP's dim goes in a suggested mesh: innermost (consecutive ranks, one node).
ORDER = 50


def suggest_axes(tp: Any, model: Any, topology: Any) -> list[SuggestAxis]:
    options = {"sequence_parallel": True, **tp.options()}
    sizes = tuple(t for t in range(1, topology.devices_per_node + 1)
                  if topology.devices_per_node % t == 0
                  and not any(h and h % t for h in (model.heads, model.kv_heads)))

    def choices(ctx: SuggestContext) -> list[SuggestChoice]:
        size = ctx.size(tp.dim)
        return [SuggestChoice(f"TP {size}", options)] if size > 1 else [SuggestChoice()]

    return [SuggestAxis(tp.name, tp.dim, ORDER, sizes, choices, role=Role.MODEL_PARALLEL)]


__all__ = ["ORDER", "suggest_axes"]
