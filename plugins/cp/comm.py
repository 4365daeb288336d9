"""Autograd-aware collectives over the cp ranks, each a ``torch.autograd.Function``.

Written here rather than taken from ``torch.distributed.nn.functional``: its all-gather's
backward uses the list form of all-to-all off NCCL, which gloo lacks. Both functions below
move data with ``all_gather`` and ``all_to_all_single`` only, which gloo, NCCL and the
other backends all have, so a CP plan runs (and is tested) on CPU as it runs on GPUs.
Their forwards issue the functional collectives (out of place): selective checkpointing
saves their outputs, so a checkpointed block's recomputation in backward gathers and
exchanges nothing again (c10d's write into their arguments, which it cannot keep).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from composer_par.plugin import torch_private


class _GatherSequence(torch.autograd.Function):
    """Forward: every rank's tensor, concatenated in rank order along ``seq_dim``.
    Backward: each rank gets the sum over ranks of the gradient of its own part, which
    is where its K/V went (an all-to-all, then a sum in rank order)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any, seq_dim: int) -> torch.Tensor:
        size = dist.get_world_size(group)
        ctx.group, ctx.seq_dim, ctx.size = group, seq_dim, size
        gathered = torch_private.functional_all_gather(tensor.contiguous(), group)
        return torch.cat(gathered.chunk(size, dim=0), dim=seq_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        pieces = torch.stack(grad.chunk(ctx.size, dim=ctx.seq_dim)).contiguous()
        received = torch.empty_like(pieces)
        dist.all_to_all_single(received, pieces, group=ctx.group)
        return received.sum(dim=0), None, None


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` on tensor dim 0 (one slice per rank); its backward is the
    same exchange of the gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        # Contiguous first: the collective reads its input as if it were.
        return torch_private.functional_all_to_all(tensor.contiguous(), None, None, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def gather_sequence(tensor: torch.Tensor, group: Any, seq_dim: int) -> torch.Tensor:
    """Every cp rank's ``tensor`` concatenated in rank order along ``seq_dim``; gradients
    flow back to the rank each part came from."""
    out: torch.Tensor = _GatherSequence.apply(tensor, group, seq_dim)
    return out


def heads_to_sequence(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Ulysses' first exchange: ``(batch, heads, local_seq, head_dim)`` with every head and
    this rank's tokens becomes ``(batch, heads / cp, cp * local_seq, head_dim)`` with this
    rank's share of the heads and every rank's tokens, in rank order."""
    size = dist.get_world_size(group)
    batch, heads, seq, dim = tensor.shape
    split = tensor.reshape(batch, size, heads // size, seq, dim).transpose(0, 1)
    received = _AllToAll.apply(split, group)  # (cp: source rank, batch, heads/cp, seq, dim)
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * seq, dim)


def sequence_to_heads(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """The inverse of :func:`heads_to_sequence`."""
    size = dist.get_world_size(group)
    batch, heads, seq, dim = tensor.shape
    split = tensor.reshape(batch, heads, size, seq // size, dim).permute(2, 0, 1, 3, 4)
    received = _AllToAll.apply(split, group)  # (cp: source rank's heads, batch, h, s, d)
    return received.transpose(0, 1).reshape(batch, size * heads, seq // size, dim)


__all__ = ["gather_sequence", "heads_to_sequence", "sequence_to_heads"]
