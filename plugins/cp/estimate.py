"""What CP's attention moves per step, for ``composer-par estimate`` and the benchmark:
the same logical payload bytes :class:`~composer_par.testing.comm_count.CommCounter`
counts (an all-gather's gathered output, an all-to-all's input), and the K/V buffers
each mode holds. Pure arithmetic: no torch."""

from __future__ import annotations

from composer_par.plugin import Collective


def attention_collectives(dim: str, mode: str, *, size: int, layers: int, batch: int,
                          seq: int, heads: int, kv_heads: int, head_dim: int,
                          dtype_bytes: int, passes: int = 1) -> tuple[Collective, ...]:
    """One step's attention collectives over ``dim`` (forward and backward of ``passes``
    micro-batches of ``batch`` sequences of ``seq`` tokens; ``kv_heads`` as they reach
    the attention math)."""
    if size < 2:
        return ()
    runs = layers * passes
    local = batch * seq // size * head_dim * dtype_bytes  # one head of this rank's tokens
    if mode == "allgather":
        whole_kv = 2 * kv_heads * local * size  # K and V of the whole sequence
        return (
            Collective(dim, "all_gather", runs * whole_kv, 2 * runs,
                       "each layer's K and V gathered from every cp rank (forward)"),
            Collective(dim, "all_to_all", runs * whole_kv, 2 * runs,
                       "the gathered K/V's gradients back to their ranks (backward)"),
        )
    if mode == "ring":
        # torch's ring with its all-gather rotation: K and V (repeated to the query
        # heads) gathered once in forward and again in backward, and in backward the K/V
        # gradients passed one rank on cp times, in fp32.
        whole_kv = 2 * heads * local * size
        grad_kv = 2 * heads * batch * seq // size * head_dim * 4
        return (
            Collective(dim, "all_gather", 2 * runs * whole_kv, 2 * runs,
                       "each layer's K and V gathered from every cp rank (forward, and "
                       "again in backward)"),
            Collective(dim, "all_to_all", runs * size * grad_kv, runs * size,
                       "the K/V gradients passed around the ring in fp32 (backward)"),
        )
    exchanged = (2 * heads + 2 * kv_heads) * local  # Q, K, V in; the output back
    return (Collective(dim, "all_to_all", 2 * runs * exchanged, 8 * runs,
                       "Q, K, V traded heads for sequence and the output back, forward "
                       "and backward"),)


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


__all__ = ["attention_collectives", "kv_buffer_bytes"]
