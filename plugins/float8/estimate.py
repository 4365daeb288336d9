"""float8's terms of ``composer-par estimate`` and ``suggest``: the bytes its weight
all-gathers move, the amax all-reduce of the scale precompute, and the memory of the
gathered float8 weights. Pure arithmetic over the model shape: no torch.

The weights float8 converts are the blocks' matrices (tensors of two tensor dims, not
experts: those stay in high precision) whose dims are multiples of 16. Under FSDP2 with
the tensorwise recipe each gathers one byte per element; its scale is computed before the
all-gather from the amax of every shard (the precompute: one fp32 amax per weight, all
of them in one all-reduce per step), so no scale is gathered."""

from __future__ import annotations

from typing import Any

from composer_par.plugin import Collective, dtype_bytes

from .selection import MULTIPLE

#: Bytes of one amax in the precompute's all-reduce (the master weights' fp32).
AMAX_BYTES = 4


def converted(model: Any) -> list[tuple[int, int, int]]:
    """``(elements, matrices, count)`` per block group: the elements and the number of
    the matrices float8 converts in one block of the group (multiples of 16), and how
    many identical blocks the group stands for."""
    out = []
    for group in model.groups:
        if not group.block:
            continue
        mine = [t for t in group.tensors if len(t.shape) == 2 and not t.experts
                and all(d % MULTIPLE == 0 for d in t.shape)]
        if not mine:
            continue
        # A shape from numbers stacks a block's matrices into one tensor: its count is
        # the model's, or a Llama block's seven (q, k, v, o, gate, up, down).
        stacked = len(mine) == 1 and mine[0].name.endswith("matrices")
        matrices = (model.matrices_per_block or 7) if stacked else len(mine)
        out.append((sum(t.numel for t in mine), matrices, group.count))
    return out


def float8_terms(model: Any, *, dim: str | None, shard: int, gathers: int, param_dtype: str,
                 recipe: str, float8_gather: bool) -> tuple[tuple[Collective, ...],
                                                           dict[str, int], tuple[str, ...]]:
    """``(collectives, memory, notes)`` of float8 on one rank: ``dim`` the shard dim (None
    without FSDP2), ``gathers`` the all-gathers of each block per step (forward, and
    backward when resharded), ``param_dtype`` what the weights gather in otherwise."""
    blocks = converted(model)
    elements = sum(n * c for n, _, c in blocks)
    count = sum(m * c for _, m, c in blocks)
    width = dtype_bytes(param_dtype)
    notes = [f"float8 ({recipe}): {count} block matrices ({elements} elements) compute in "
             "float8; routed experts and the model's first and last layers stay in high "
             "precision"]
    if dim is None or shard < 2 or not float8_gather:
        why = ("its weights gather in high precision (only per-tensor scales gather in "
               "float8)" if dim is not None and shard > 1 else "no FSDP2: nothing gathers")
        notes.append(f"float8 all-gather off: {why}")
        return (), {}, tuple(notes)
    saved = elements * (width - 1) * gathers
    notes.append(
        f"float8 all-gather over {dim}: the converted weights gather {elements} bytes per "
        f"pass over the blocks instead of {elements * width} ({param_dtype}), {saved} bytes "
        f"less per step ({gathers} passes) than the built-in FSDP2 estimate above counts "
        "for them; scales are computed on every rank from the precomputed amaxes, none is "
        "gathered")
    collectives = (Collective(dim, "all_reduce", count * AMAX_BYTES, 1,
                              "float8 scale precompute: every converted weight's amax, "
                              "once per optimizer step"),)
    # While a block runs, its converted weights are held unsharded in float8 (one byte
    # each) beside nothing else: FSDP2 gathers them in place of their high-precision copy.
    largest = max((n for n, _, _ in blocks), default=0)
    memory = {"float8 weights of the running block, unsharded": largest}
    return collectives, memory, tuple(notes)


__all__ = ["AMAX_BYTES", "converted", "float8_terms"]
