"""What ``composer-par suggest`` may try of CP: its dim at the sizes that divide the world
and cut the sequence into ``2 x cp`` equal chunks of at least :data:`MIN_TOKENS` tokens
per rank, in allgather mode, and in alltoall mode where the cp size divides the head and
K/V-head counts each tensor-parallel rank holds (the mode the plan names, when it names
one). No torch."""

from __future__ import annotations

from typing import Any

from composer_par.plugin import Role, SuggestAxis, SuggestChoice, SuggestContext

#: Where CP's dim goes in a suggested mesh: inside the data-parallel dims, outside tp
#: (torchtitan's order), its groups inside a node when cp x tp fits one.
ORDER = 30

#: The fewest tokens per rank suggest cuts a sequence to: below it a rank's share of
#: attention is too short for the keys and values it gathers to pay their way.
MIN_TOKENS = 2048


def suggest_axes(cp: Any, model: Any, topology: Any, workload: Any,
                 mode_given: bool) -> list[SuggestAxis]:
    seq, world = workload.seq, topology.world_size
    if not model.heads:
        return []
    sizes = tuple(c for c in range(1, world + 1) if world % c == 0 and seq % (2 * c) == 0
                  and seq // c >= MIN_TOKENS)

    def choices(ctx: SuggestContext) -> list[SuggestChoice]:
        size = ctx.size(cp.dim)
        if size == 1:
            return [SuggestChoice()]
        tp = ctx.tensor_parallel()
        modes = [cp.mode] if mode_given else ["allgather"]
        if not mode_given and all(h and h % tp == 0 and (h // tp) % size == 0
                                  for h in (model.heads, model.kv_heads or model.heads)):
            modes.append("alltoall")
        own = {k: v for k, v in cp.options().items() if k not in ("mode", "seq_len")}
        return [SuggestChoice(f"CP {size}" + ("" if m == "allgather" else f" {m}"),
                              {"mode": m, "seq_len": seq, **own}) for m in modes]

    return [SuggestAxis(cp.name, cp.dim, ORDER, sizes, choices, role=Role.MODEL_PARALLEL,
                        folded=True)]


__all__ = ["MIN_TOKENS", "ORDER", "suggest_axes"]
