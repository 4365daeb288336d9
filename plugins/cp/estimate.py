"""What CP's attention moves per step, for ``composer-par estimate`` and the benchmark:
the same logical payload bytes :class:`~composer_par.testing.comm_count.CommCounter`
counts (an all-gather's gathered output, an all-to-all's input), and the K/V buffers
each mode holds. The ranks wait for them (no overlap). Pure arithmetic: no torch."""

from __future__ import annotations

from typing import Any

from composer_par.plugin import Collective, EstimatePart, dtype_bytes, runs_of

ACCOUNTING = (
    "cp: each rank holds seq/cp tokens of every sequence; per layer and pass allgather "
    "gathers K and V of the whole sequence (forward) and sends their gradients back by "
    "all-to-all (backward), alltoall trades Q, K, V heads for sequence and the output "
    "back (forward and backward), ring gathers K and V in forward and backward and "
    "passes the fp32 K/V gradients cp times; full checkpointing issues the forward's "
    "again (selective saves their outputs); the ranks wait for them (no overlap); "
    "buffers: the other ranks' K and V (or the traded heads) per layer kept for backward",
)


def attention_collectives(dim: str, mode: str, *, size: int, layers: int, batch: int,
                          seq: int, heads: int, kv_heads: int, head_dim: int,
                          dtype_bytes: int, passes: int = 1,
                          recomputed: int = 0) -> tuple[Collective, ...]:
    """One step's attention collectives over ``dim`` (forward and backward of ``passes``
    micro-batches of ``batch`` sequences of ``seq`` tokens; ``kv_heads`` as they reach
    the attention math), and the forward's again for the ``recomputed`` layers whose
    checkpointed recomputation in backward issues them."""
    if size < 2:
        return ()
    runs = layers * passes
    again = recomputed * passes
    local = batch * seq // size * head_dim * dtype_bytes  # one head of this rank's tokens
    out: tuple[Collective, ...]
    if mode == "allgather":
        whole_kv = 2 * kv_heads * local * size  # K and V of the whole sequence
        out = (
            Collective(dim, "all_gather", runs * whole_kv, 2 * runs,
                       "each layer's K and V gathered from every cp rank (forward)"),
            Collective(dim, "all_to_all", runs * whole_kv, 2 * runs,
                       "the gathered K/V's gradients back to their ranks (backward)"),
        )
    elif mode == "ring":
        # torch's ring with its all-gather rotation: K and V (repeated to the query
        # heads) gathered once in forward and again in backward, and in backward the K/V
        # gradients passed one rank on cp times, in fp32.
        whole_kv = 2 * heads * local * size
        grad_kv = 2 * heads * batch * seq // size * head_dim * 4
        out = (
            Collective(dim, "all_gather", 2 * runs * whole_kv, 2 * runs,
                       "each layer's K and V gathered from every cp rank (forward, and "
                       "again in backward)"),
            Collective(dim, "all_to_all", runs * size * grad_kv, runs * size,
                       "the K/V gradients passed around the ring in fp32 (backward)"),
        )
    else:  # alltoall
        exchanged = (2 * heads + 2 * kv_heads) * local  # Q, K, V in; the output back
        out = (Collective(dim, "all_to_all", 2 * runs * exchanged, 8 * runs,
                          "Q, K, V traded heads for sequence and the output back, forward "
                          "and backward"),)
        if again:
            out += (Collective(dim, "all_to_all", again * exchanged, 4 * again,
                               "recomputation in backward: Q, K, V and the output traded "
                               "again"),)
        return out
    if again:
        out += (Collective(dim, "all_gather", again * whole_kv, 2 * again,
                           "recomputation in backward: K and V gathered again"),)
    return out


def kv_buffer_bytes(mode: str, *, size: int, batch: int, seq: int, heads: int,
                    kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """The bytes one layer's cross-rank attention holds beyond a rank's own tokens: the
    other ranks' K and V (allgather; ring, repeated to the query heads), or the whole
    sequence of heads / cp heads of Q, K,
    V and the output (alltoall)."""
    if size < 2:
        return 0
    token = batch * head_dim * dtype_bytes
    if mode in ("allgather", "ring"):
        gathered = heads if mode == "ring" else kv_heads
        return 2 * gathered * token * seq * (size - 1) // size
    return (2 * heads + 2 * kv_heads) * token * seq // size


def estimate_part(dim: str, mode: str, layout: Any, model: Any, workload: Any,
                  stage: Any) -> EstimatePart | None:
    """CP's terms over ``dim`` in ``mode``: its attention collectives and K/V buffers."""
    size = layout.mesh.size(dim) if dim in layout.mesh else 1
    if size < 2 or not model.heads:
        return None
    # Tensor parallelism splits the heads: a rank's attention, and what CP moves for it,
    # runs on its share of them (q, k and v are column-parallel).
    tp = layout.tensor_parallel_size()
    kv_heads = model.kv_heads or model.heads
    shape = {"size": size, "batch": workload.micro_batch, "seq": workload.seq,
             "heads": max(1, model.heads // tp), "kv_heads": max(1, kv_heads // tp),
             "head_dim": model.hidden // model.heads,
             "dtype_bytes": dtype_bytes(workload.dtype)}
    # A checkpointed layer's recomputation in backward issues the forward's collectives
    # again, unless the checkpointing saves the functional collectives' outputs
    # (selective's default), CP's among them.
    recomputed = layout.reissued_blocks(workload.activation_checkpoint or "none",
                                        model.layers)
    collectives = attention_collectives(dim, mode, layers=model.layers,
                                        passes=runs_of(workload, stage),
                                        recomputed=recomputed, **shape)
    # A layer's buffers stay saved for its backward, unless full checkpointing drops
    # them (then one recomputed layer holds them at a time).
    held = model.layers
    if workload.activation_checkpoint == "full":
        held -= model.layers // layout.checkpoint_every - 1
    buffers = held * kv_buffer_bytes(mode, **shape)
    notes = () if stage is not None else (
        f"{dim}({size}): each rank holds {workload.seq // size} of every sequence's "
        f"{workload.seq} tokens (its activations), and in {mode} per layer the buffers "
        "above",)
    return EstimatePart(collectives=collectives, memory={f"cp {mode} buffers": buffers},
                        accounting=ACCOUNTING, notes=notes)


__all__ = ["ACCOUNTING", "attention_collectives", "estimate_part", "kv_buffer_bytes"]
