"""Attention across the cp ranks: each rank holds a load-balanced part of the sequence
(:mod:`.layout`) and computes the attention of its own queries over the whole sequence.

Three modes, each calling ``scaled_dot_product_attention``, the math a single process runs:

* ``allgather``: each rank gathers every rank's keys and values and attends with each of
  its two chunks of queries to the keys up to the chunk's end (:mod:`.blockwise`, on
  CPU; elsewhere, and with a sliding window, with a mask of the global positions of its
  queries and of the gathered keys). Exact for any head count; holds the whole
  sequence's K/V per layer.
* ``alltoall`` (Ulysses): an all-to-all trades heads for sequence, so that each rank holds
  ``heads / cp`` heads of the whole sequence, put back in global order; plain causal
  attention on them; the inverse all-to-all. Needs the head and K/V-head counts divisible
  by cp.
* ``ring`` (CUDA): torch's own ring attention (:mod:`.ring`), K/V passed around the cp
  ranks inside the fused SDPA kernels.

``window`` (sliding-window layers: Mistral, Gemma 3's local layers) keeps the keys at most
``window - 1`` places before the query, as Hugging Face's sliding-window mask does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .blockwise import chunk_attention, supported
from .comm import gather_sequence, heads_to_sequence, sequence_to_heads
from .layout import chunks_of_rank, gathered_positions, rank_positions

MODES = ("allgather", "alltoall", "ring")


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """The boolean mask (queries x keys) of the keys each query may attend to."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Any,
                      mode: str, window: int | None = None, scale: float | None = None,
                      mesh: Any = None) -> torch.Tensor:
    """Causal attention of this rank's queries ``(batch, heads, local_seq, head_dim)`` over
    the whole sequence; ``k``/``v`` may have fewer (grouped) heads. Returns this rank's
    output, shaped as ``q``. ``mesh`` (the 1-D cp mesh of ``group``) is ``ring``'s."""
    if mode == "ring":
        if window is not None:
            raise ValueError("mode = \"ring\" cannot mask a sliding window (rule CP823): "
                             "use mode = \"allgather\" for this model")
        from .ring import ring_attention

        return ring_attention(q, k, v, mesh=mesh, scale=scale)
    size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    seq_len = q.shape[2] * size
    gqa = k.shape[1] != q.shape[1]
    if mode == "allgather":
        keys, values = gather_sequence(k, group, 2), gather_sequence(v, group, 2)
        if window is None and supported(q):
            return _chunked(q, keys, values, size, rank, scale)
        mask = visible(rank_positions(seq_len, size, rank, q.device),
                       gathered_positions(seq_len, size, q.device), window)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)
    if mode != "alltoall":
        raise ValueError(f"unknown cp mode {mode!r}: use one of {MODES}")
    placed = gathered_positions(seq_len, size, q.device)
    order = torch.argsort(placed)  # rank order -> global order
    q, k, v = (heads_to_sequence(t, group).index_select(2, order) for t in (q, k, v))
    if window is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                             enable_gqa=gqa)
    else:
        positions = torch.arange(seq_len, device=q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible(
            positions, positions, window), scale=scale, enable_gqa=gqa)
    return sequence_to_heads(out.index_select(2, placed), group)


def _chunked(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, size: int, rank: int,
             scale: float | None) -> torch.Tensor:
    """``allgather``'s attention without a mask tensor (:mod:`.blockwise`): each of this
    rank's two chunks over the keys up to its end, the gathered keys in global order."""
    order = torch.argsort(gathered_positions(q.shape[2] * size, size, q.device))
    keys, values = keys.index_select(2, order), values.index_select(2, order)
    if keys.shape[1] != q.shape[1]:
        repeat = q.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(repeat, dim=1)
        values = values.repeat_interleave(repeat, dim=1)
    length = q.shape[2] // 2
    outs = []
    for index, chunk in enumerate(chunks_of_rank(rank, size)):
        end = (chunk + 1) * length
        outs.append(chunk_attention(q[:, :, index * length:(index + 1) * length],
                                    keys[:, :, :end], values[:, :, :end], chunk * length,
                                    scale))
    return torch.cat(outs, dim=2)


class ContextAttention(nn.Module):
    """Stands in for a model's causal attention module (``forward(q, k, v)`` on
    ``(batch, heads, seq, head_dim)``), running it across the cp ranks."""

    def __init__(self, group: Any, mode: str, window: int | None = None,
                 mesh: Any = None) -> None:
        super().__init__()
        self.group, self.mode, self.window, self.mesh = group, mode, window, mesh

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return context_attention(q, k, v, group=self.group, mode=self.mode, window=self.window,
                                 mesh=self.mesh)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}" + (f", window={self.window}" if self.window else "")


__all__ = ["MODES", "ContextAttention", "context_attention", "visible"]
