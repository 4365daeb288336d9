"""What ``composer-par suggest`` may try of FSDP2: its shard dim at every size that divides
the world, with the plan's mixed precision; at size 1, when data parallelism folds other
dims in, both without it and sharding over those dims alone. No torch."""

from __future__ import annotations

from typing import Any

from composer_par.plugin import Role, SuggestAxis, SuggestChoice, SuggestContext

#: Where FSDP2's dim goes in a suggested mesh (outermost first): inside the replicate
#: dim, outside the model-parallel dims.
ORDER = 20

_MIXED = {"bfloat16": "bf16", "float16": "fp16"}


def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def suggest_axes(fsdp2: Any, topology: Any, workload: Any) -> list[SuggestAxis]:
    own = fsdp2.options()
    mixed = _MIXED.get(workload.dtype or "")
    options = {**({"mixed_precision": mixed} if mixed else {}), **own}

    def choices(ctx: SuggestContext) -> list[SuggestChoice]:
        size = ctx.size(fsdp2.dim)
        if size > 1:
            return [SuggestChoice(f"FSDP {size}", options)]
        if ctx.folded_size() > 1:
            over = " x ".join(d for d in ctx.folded if ctx.size(d) > 1)
            return [SuggestChoice(), SuggestChoice(f"FSDP over {over}", options)]
        return [SuggestChoice()]

    return [SuggestAxis(fsdp2.name, fsdp2.dim, ORDER, divisors(topology.world_size), choices,
                        role=Role.SHARD, samples=True)]


__all__ = ["ORDER", "divisors", "suggest_axes"]
