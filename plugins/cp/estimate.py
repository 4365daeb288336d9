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
    exchanged = (2 * heads + 2 * kv_heads) * local  # Q, K, V in; the output back
    return (Collective(dim, "all_to_all", 2 * runs * exchanged, 8 * runs,
                       "Q, K, V traded heads for sequence and the output back, forward "
                       "and backward"),)


def kv_buffer_bytes(mode: str, *, size: int, batch: int, seq: int, heads: int,
                    kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """The bytes one layer's cross-rank attention holds beyond a rank's own tokens: the
    other ranks' K and V (allgather), or the whole sequence of heads / cp heads of Q, K,
    V and the output (alltoall)."""
    if size < 2:
        return 0
    token = batch * head_dim * dtype_bytes
    if mode == "allgather":
        return 2 * kv_heads * token * seq * (size - 1) // size
    return (2 * heads + 2 * kv_heads) * token * seq // size


__all__ = ["attention_collectives", "kv_buffer_bytes"]
