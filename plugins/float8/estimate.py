"""float8's terms of ``composer-par estimate`` and ``suggest``: the weights whose
all-gathers move one byte an element (marked in the model shape for FSDP2's terms) and
the amax all-reduce of the scale precompute. Pure arithmetic over the model shape: no
torch.

The weights float8 converts are the blocks' matrices (tensors of two tensor dims, not
experts: those stay in high precision) whose dims are multiples of 16. Under FSDP2 with
the tensorwise recipe each gathers one byte per element (the plugin marks them so in the
model shape, ``TensorShape.gather_bytes``, and FSDP2's terms count them so); its scale
is computed before the all-gather from the amax of every shard (the precompute: one fp32
amax per weight, all of them in one all-reduce per step), so no scale is gathered."""

from __future__ import annotations

from typing import Any

from composer_par.plugin import Collective, dtype_bytes

from .selection import MULTIPLE

#: Bytes of one amax in the precompute's all-reduce (the master weights' fp32).
AMAX_BYTES = 4


def _converts(tensor: Any) -> bool:
    return (len(tensor.shape) == 2 and not tensor.experts
            and all(d % MULTIPLE == 0 for d in tensor.shape))


def gathered_in_float8(model: Any) -> Any:
    """``model`` with the weights float8 converts marked as gathering one byte per
    element (``TensorShape.gather_bytes``), so FSDP2's terms count them so: its
    all-gathers and the unsharded blocks it holds."""
    import attrs

    groups = tuple(
        attrs.evolve(g, tensors=tuple(attrs.evolve(t, gather_bytes=1) if _converts(t) else t
                                      for t in g.tensors)) if g.block else g
        for g in model.groups)
    return attrs.evolve(model, groups=groups)


def converted(model: Any) -> list[tuple[int, int, int]]:
    """``(elements, matrices, count)`` per block group: the elements and the number of
    the matrices float8 converts in one block of the group (multiples of 16), and how
    many identical blocks the group stands for."""
    out = []
    for group in model.groups:
        if not group.block:
            continue
        mine = [t for t in group.tensors if _converts(t)]
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
        f"less per step at most ({gathers} passes; fewer where FSDP2 keeps a block gathered "
        "for backward), as FSDP2's terms count them (and their unsharded "
        "copies, one byte each); scales are computed on every rank from the precomputed "
        "amaxes, none is gathered")
    collectives = (Collective(dim, "all_reduce", count * AMAX_BYTES, 1,
                              "float8 scale precompute: every converted weight's amax, "
                              "once per optimizer step"),)
    return collectives, {}, tuple(notes)


__all__ = ["AMAX_BYTES", "converted", "float8_terms", "gathered_in_float8"]
