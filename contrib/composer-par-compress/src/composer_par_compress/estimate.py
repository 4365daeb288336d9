"""What the compressed all-reduce sends in place of the replicate dim's fp32 all-reduce,
for ``composer-par estimate`` (the ``composer_par_estimate_comm_hook`` hook). No torch.

* ``bf16`` / ``fp16`` (:mod:`.lowp`): per bucket of ``n`` elements over ``R`` ranks, an
  all-to-all of the 16-bit gradient padded to ``R * ceil(n / R)`` elements and an
  all-gather of the 16-bit sums, as large: half the fp32 all-reduce's bytes each.
* ``powersgd`` (:mod:`.powersgd`): per bucket, the matrices a rank-``r`` factorization
  shrinks at least 2x send ``r`` numbers per row and per column (two all-reduces, ``P``
  and ``Q``, in fp32), the rest whole (one all-reduce); each tensor's shard is the
  parameter's rows divided by the shard group, as the data-parallel plugin holds it.
"""

from __future__ import annotations

from typing import Any

from composer_par.plugin import Collective


def compressible(shape: tuple[int, ...], rank: int, min_numel: int) -> bool:
    """Whether a tensor of ``shape`` is sent as a rank-``rank`` factorization: a matrix
    (two or more dims) of at least ``min_numel`` elements that the factorization shrinks
    at least 2x."""
    if len(shape) < 2:
        return False
    rows = shape[0]
    cols = 1
    for size in shape[1:]:
        cols *= size
    numel = rows * cols
    return numel > 0 and numel >= min_numel and 2 * (rows + cols) * rank <= numel


def low_precision(c: Collective, group: int, reduce_bytes: int, method: str
                  ) -> tuple[Collective, ...]:
    """The all-to-all and all-gather of ``method`` in place of the all-reduce ``c``."""
    elements = c.payload // reduce_bytes
    # each call's buffer padded to a multiple of the group: at most group - 1 more
    padded = elements + (group - 1) * c.calls if group > 1 else elements
    sent = padded * 2
    return (
        Collective(c.dim, "all_to_all", sent, c.calls,
                   f"{method}: gradients sent in 16 bits to the rank summing each chunk "
                   f"(in place of: {c.why})", c.group_size, c.nodes, c.overlap),
        Collective(c.dim, "all_gather", sent, c.calls,
                   f"{method}: the 16-bit sums gathered", c.group_size, c.nodes, c.overlap),
    )


def powersgd(c: Collective, model: Any, tp: int, shard: int, rank: int, min_numel: int
             ) -> tuple[Collective, ...]:
    """PowerSGD's all-reduces in place of the all-reduce ``c``: the share of ``c``'s
    elements its factorization sends, from the shapes of the tensors ``model`` holds."""
    whole = compressed = plain = 0
    for g in model.groups:
        for t in g.tensors:
            if not t.shape:
                continue
            rows = -(-t.shape[0] // tp) if t.tp and tp > 1 else t.shape[0]
            rows = -(-rows // shard)  # the shard the data-parallel plugin holds
            cols = t.numel // t.shape[0]
            local = rows * cols
            whole += local * g.count
            if compressible((rows, cols), rank, min_numel):
                compressed += (rows + cols) * rank * g.count
            else:
                plain += local * g.count
    if not whole:
        return (c,)
    out = []
    if compressed:
        out.append(Collective(c.dim, "all_reduce", round(c.payload * compressed / whole),
                              2 * c.calls, f"PowerSGD: P and Q of the matrices (in place of: "
                              f"{c.why})", c.group_size, c.nodes, c.overlap))
    if plain:
        out.append(Collective(c.dim, "all_reduce", round(c.payload * plain / whole), c.calls,
                              "PowerSGD: the tensors it leaves whole", c.group_size, c.nodes,
                              c.overlap))
    return tuple(out)


__all__ = ["compressible", "low_precision", "powersgd"]
