"""What ``composer-par suggest`` may try of EP, for a mixture-of-experts model: its dim at
the sizes that divide the expert count and the world (inside a node or across nodes: the
step-time model prices where its all-to-alls go). No torch."""

from __future__ import annotations

from typing import Any

from composer_par.plugin import Role, SuggestAxis, SuggestChoice, SuggestContext

#: Where EP's dim goes in a suggested mesh: inside the data-parallel and context dims,
#: outside tp, so that its all-to-alls stay inside a node when they can.
ORDER = 40


def suggest_axes(ep: Any, model: Any, topology: Any) -> list[SuggestAxis]:
    moe = model.moe
    if moe is None:
        return []
    world = topology.world_size
    sizes = tuple(e for e in range(1, world + 1) if world % e == 0 and moe.num_experts % e == 0)
    own = ep.options()

    def choices(ctx: SuggestContext) -> list[SuggestChoice]:
        size = ctx.size(ep.dim)
        return [SuggestChoice(f"EP {size}", own)] if size > 1 else [SuggestChoice()]

    return [SuggestAxis(ep.name, ep.dim, ORDER, sizes, choices, role=Role.MODEL_PARALLEL,
                        samples=True, folded=True, marked=True)]


__all__ = ["ORDER", "suggest_axes"]
