"""The load-balanced ("head-tail") split of a sequence over the cp ranks, and its inverse.

Under causal attention a token attends to every token before it, so the last part of a
sequence costs the most. Cut the sequence into ``2 * cp`` equal chunks and give rank
``r`` chunks ``r`` and ``2 * cp - 1 - r``: every rank then holds one cheap and one
expensive chunk and does the same attention work (torchtitan's and Megatron's layout).
Inputs, labels and positions are cut the same way, so a rank's tokens line up with its
labels and its positions are the global positions of its tokens.

Only torch tensor indexing here; no collectives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def chunks_of_rank(rank: int, size: int) -> tuple[int, int]:
    """The two chunk indices (of ``2 * size``) rank ``rank`` holds, head first."""
    if not 0 <= rank < size:
        raise ValueError(f"cp rank {rank} is outside 0..{size - 1}")
    return rank, 2 * size - 1 - rank


def check_divisible(seq_len: int, size: int) -> None:
    """Raise ValueError unless ``2 * size`` divides ``seq_len``."""
    if size < 1 or seq_len % (2 * size):
        raise ValueError(
            f"a sequence of {seq_len} tokens cannot be cut into 2 * cp = {2 * size} equal "
            f"chunks: use a sequence length that {2 * size} divides (rule CP821)")


def rank_positions(seq_len: int, size: int, rank: int, device: torch.device | str | None = None
                   ) -> torch.Tensor:
    """The global positions (int64, ascending) of the tokens rank ``rank`` holds."""
    import torch

    check_divisible(seq_len, size)
    chunk = seq_len // (2 * size)
    head, tail = chunks_of_rank(rank, size)
    return torch.cat([torch.arange(head * chunk, (head + 1) * chunk, device=device),
                      torch.arange(tail * chunk, (tail + 1) * chunk, device=device)])


def gathered_positions(seq_len: int, size: int, device: torch.device | str | None = None
                       ) -> torch.Tensor:
    """The global positions of the sequence gathered from every rank in rank order (rank
    0's tokens, then rank 1's, ...): what an all-gather over the cp ranks holds."""
    import torch

    return torch.cat([rank_positions(seq_len, size, r, device) for r in range(size)])


def shard_sequence(tensor: torch.Tensor, size: int, rank: int, seq_dim: int = 1
                   ) -> torch.Tensor:
    """Rank ``rank``'s part of ``tensor`` along tensor dim ``seq_dim`` (a copy)."""
    positions = rank_positions(tensor.shape[seq_dim], size, rank, tensor.device)
    return tensor.index_select(seq_dim, positions)


def unshard_sequence(parts: list[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part (``parts[r]`` is rank ``r``'s): the
    inverse of :func:`shard_sequence`."""
    import torch

    size = len(parts)
    gathered = torch.cat(parts, dim=seq_dim)
    order = gathered_positions(gathered.shape[seq_dim], size, gathered.device)
    return gathered.index_select(seq_dim, torch.argsort(order))


__all__ = [
    "check_divisible",
    "chunks_of_rank",
    "gathered_positions",
    "rank_positions",
    "shard_sequence",
    "unshard_sequence",
]
