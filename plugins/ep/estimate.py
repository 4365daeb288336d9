"""What EP's token all-to-all moves per step, for ``composer-par estimate`` and
``suggest``: the same logical payload bytes
:class:`~composer_par.testing.comm_count.CommCounter` counts (an all-to-all's input).
Pure arithmetic: no torch.

Per MoE block and micro-batch a rank with ``T`` tokens routes ``T x top_k`` (token,
slot) pairs. The dispatch all-to-all's input is this rank's pairs (``S``), the combine's
the pairs it received for its experts (``R``); backward runs their transposes, the
combine's with input ``S`` and the dispatch's with input ``R``. Routing decides ``R``;
summed over the ep ranks it equals the sum of ``S``, and under uniform routing each
rank receives ``S`` on average: the estimate counts ``R = S``. Before each dispatch the
counts per expert are exchanged (one int64 per expert).

With expert tensor parallelism each tp rank computes its part of every pair's output,
so per MoE block and micro-batch the tp ranks all-reduce the ``S`` pairs' partial outputs
(forward, and again where the block is recomputed) and the ``T`` tokens' input gradient
(backward), and the gradient of an output-projection bias kept whole on every tp rank
(this rank's experts' rows)."""

from __future__ import annotations

from composer_par.plugin import Collective

#: Bytes of one exchanged count (``torch.bincount``'s int64).
COUNT_BYTES = 8


def pair_bytes(hidden: int, dtype_bytes: int) -> int:
    """Bytes one routed (token, slot) pair moves in one all-to-all."""
    return hidden * dtype_bytes


def all_to_all_collectives(
    dim: str, *, size: int, moe_layers: int, tokens: int, top_k: int, hidden: int,
    num_experts: int, dtype_bytes: int, passes: int = 1, recomputed: int = 0,
    received: int | None = None,
) -> tuple[Collective, ...]:
    """One step's all-to-alls over ``dim`` on one rank: ``passes`` micro-batches of
    ``tokens`` tokens each through ``moe_layers`` MoE blocks, of which ``recomputed``
    run their forward again in backward (activation checkpointing). ``received``: the
    pairs this rank's experts receive per MoE block and micro-batch (default: the
    uniform routing's, its own ``tokens x top_k``)."""
    if size < 2 or moe_layers < 1:
        return ()
    sent = tokens * top_k
    got = sent if received is None else received
    row = pair_bytes(hidden, dtype_bytes)
    runs = moe_layers * passes
    again = recomputed * passes
    out = [
        Collective(dim, "all_to_all", runs * sent * row, runs,
                   "dispatch, forward: this rank's routed pairs to their experts' ranks"),
        Collective(dim, "all_to_all", runs * got * row, runs,
                   "combine, forward: the received pairs' outputs back"),
        Collective(dim, "all_to_all", runs * sent * row, runs,
                   "combine, backward: the outputs' gradients to the experts' ranks"),
        Collective(dim, "all_to_all", runs * got * row, runs,
                   "dispatch, backward: the inputs' gradients back"),
        Collective(dim, "all_to_all", runs * num_experts * COUNT_BYTES, runs,
                   "routing counts per expert, before each dispatch"),
    ]
    if again:
        out.append(Collective(
            dim, "all_to_all", again * ((sent + got) * row + num_experts * COUNT_BYTES),
            3 * again, "recomputation in backward: counts, dispatch and combine again"))
    return tuple(out)


def expert_tp_collectives(
    dim: str, *, size: int, moe_layers: int, tokens: int, top_k: int, hidden: int,
    dtype_bytes: int, passes: int = 1, recomputed: int = 0, whole_bias: tuple[int, ...] = (),
) -> tuple[Collective, ...]:
    """One step's all-reduces over ``dim`` (expert tensor parallelism over ``size``
    ranks) on one rank; ``whole_bias``: the elements this rank holds of each output
    projection bias kept whole over ``dim``, one entry per MoE block."""
    if size < 2 or moe_layers < 1:
        return ()
    row = pair_bytes(hidden, dtype_bytes)
    forwards = (moe_layers + recomputed) * passes
    out = [
        Collective(dim, "all_reduce", forwards * tokens * top_k * row, forwards,
                   "experts split over tp, forward: each routed pair's partial outputs "
                   "summed" + (" (recomputation included)" if recomputed else "")),
        Collective(dim, "all_reduce", moe_layers * passes * tokens * row,
                   moe_layers * passes,
                   "experts split over tp, backward: the tokens' input gradients summed"),
    ]
    if whole_bias:
        out.append(Collective(dim, "all_reduce", sum(whole_bias) * dtype_bytes * passes,
                              len(whole_bias) * passes,
                              "experts split over tp, backward: the gradient of the output "
                              "projection's bias, kept whole on every tp rank"))
    return tuple(out)


__all__ = ["COUNT_BYTES", "all_to_all_collectives", "expert_tp_collectives", "pair_bytes"]
