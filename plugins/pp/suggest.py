"""What ``composer-par suggest`` may try of PP: its dim at the sizes that divide the world
and the node count, or that it divides (each stage on whole nodes, or each node holding
whole stages), with a block per stage or the embedding or the head alone (the split's
limit); its schedule (the plan's, 1F1B by default; the plan's overlap where no
model-parallel dim's collectives go unmarked) running the data shard's
micro-batches as its microbatches, and for a multi-stage schedule without
``stages_per_rank`` every power-of-two count of stages per rank that limit allows. No
torch for the single-stage schedules; the multi-stage ones import it when estimated
(their order is torch's)."""

from __future__ import annotations

from typing import Any

from composer_par.plugin import SPLIT_BACKWARD, Role, SuggestAxis, SuggestChoice, SuggestContext

from .estimate import stage_limit
from .schedules import microbatch_problem

#: Where PP's dim goes in a suggested mesh: outermost (its point-to-point sends are what
#: crosses nodes best).
ORDER = 0


def suggest_axes(pp: Any, model: Any, topology: Any) -> list[SuggestAxis]:
    info = pp.info
    if info is None:
        return []
    nodes, world = topology.nodes, topology.world_size
    most = sum(stage_limit(model))
    sizes = tuple(d for d in range(1, world + 1) if world % d == 0 and d <= most
                  and (nodes % d == 0 or d % nodes == 0))
    own = {k: v for k, v in pp.options().items() if k not in ("microbatches",)}

    def per_rank_counts(size: int) -> list[int]:
        if pp.stages_per_rank is not None or info.stages_per_rank is not None:
            return [pp.virtual_stages()]
        counts, v = [], 2
        while size * v <= most:
            counts.append(v)
            v *= 2
        return counts

    def choices(ctx: SuggestContext) -> list[SuggestChoice]:
        size = ctx.size(pp.dim)
        if size == 1:
            return [SuggestChoice()]
        out = []
        for per_rank in per_rank_counts(size) if info.multi else [1]:
            if (size * per_rank > most
                    or microbatch_problem(info, ctx.passes, size, per_rank) is not None):
                continue
            options = {**own, "schedule": info.name, "microbatches": ctx.passes}
            label = f"PP {size}" + ("" if info.name == "1F1B" else f" {info.name}")
            if pp.overlap:
                # two microbatches at once only beside collectives their plugins mark
                options["overlap"] = not any(
                    n > 1 and ctx.roles.get(d) is Role.MODEL_PARALLEL and d not in ctx.marked
                    for d, n in ctx.sizes.items())
                label += " overlap" if options["overlap"] else ""
            if info.multi and pp.stages_per_rank is None and info.stages_per_rank is None:
                options["stages_per_rank"] = per_rank
                label += f" x{per_rank}"
            # its weight pass recomputes a checkpointed block twice (CP606)
            tags = frozenset({SPLIT_BACKWARD}) if info.split_backward else frozenset()
            out.append(SuggestChoice(label, options, runs_passes=True, tags=tags))
        return out

    return [SuggestAxis(pp.name, pp.dim, ORDER, sizes, choices, role=Role.OTHER)]


__all__ = ["ORDER", "suggest_axes"]
