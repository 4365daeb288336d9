"""Refuse a forward of a CP model that is not given its tokens' positions, or whose
first positions cannot be a rank's part of the sequence.

A rank holds two chunks of every sequence, from its head and its tail. Without
positions, the project's Llama and a Hugging Face decoder number the rank's tokens
``0..local_len-1`` and rotate their queries and keys by those places, while CP's
attention masks by the global ones: the step runs and trains a different model, with no
error anywhere. So the model's forward must be given the positions
(``cp.positions(seq_len)``): a pre-hook on the model CP applied to raises where the
argument that carries them is missing.

Positions given but not cut by ``cp.shard`` train as wrongly: the whole sequence on every
rank with ``arange(seq_len)``, this rank's tokens numbered ``0..local_len-1``, or a
contiguous split numbered ``r * local_len..``. The first forward that has positions also
checks them against the layout (:func:`misplaced`). Positions that restart inside a
sequence (packed documents) are the caller's to give and pass: a token's position is
then at most its global index, never more, and no packing numbers every cp rank's tokens
from 0. The check is one all-reduce of two integers over the cp ranks, so every rank
raises together (none is left waiting in attention's collective), and it runs until one
forward passes it.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from composer_par.plugin import torch_private

from .layout import rank_positions

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from .runtime import ContextShard

# The argument of a model's forward that carries its tokens' positions: Hugging Face's,
# then the project's Llama's.
NAMES = ("position_ids", "positions")


def misplaced(positions: torch.Tensor, shard: ContextShard) -> str | None:
    """Why ``positions`` (this rank's, ``(..., local_len)``) cannot be what
    ``cp.positions`` or ``cp.shard`` of whole-sequence positions gives, or None where
    they can. Collective over the cp ranks: every rank calls it with its own."""
    import torch
    import torch.distributed as dist

    local = positions.shape[-1]
    rows = positions.reshape(-1, local)
    placed = rank_positions(local * shard.size, shard.size, shard.rank, positions.device)
    from_zero = torch.arange(local, device=positions.device)
    flags = torch.stack([(rows > placed).any(), (rows == from_zero).all()]).to(torch.int64)
    dist.all_reduce(flags, group=shard.group)
    ahead, counted_from_zero = flags.tolist()
    if counted_from_zero == shard.size:
        return (f"every cp rank numbered its {local} tokens from 0: the whole sequence on "
                "every rank, or each rank's part numbered on its own")
    if ahead:
        return (f"{ahead} cp rank(s) gave a token a position past its place in the "
                "load-balanced layout (rank r holds chunks r and 2*cp-1-r, not a "
                "contiguous slice)")
    return None


def require_positions(model: nn.Module, shard: ContextShard) -> str | None:
    """Install the pre-hook on ``model``; returns the argument it requires, or None where
    the forward takes none of :data:`NAMES` (nothing to check)."""
    signature = inspect.signature(model.forward)
    name = next((n for n in NAMES if n in signature.parameters), None)
    if name is None:
        return None
    example = ("position_ids=cp.positions(seq_len).expand(batch, -1)" if name == NAMES[0]
               else "positions=cp.positions(seq_len)")
    fix = (f"pass the rank's part, tokens = cp.shard(tokens) and {example}, "
           "cp = context_of(model) (docs/cp.md)")
    checked = False

    def check(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        nonlocal checked
        try:
            given = signature.bind_partial(*args, **kwargs).arguments.get(name)
        except TypeError:  # arguments the forward does not take: it says so itself
            return
        if given is None:
            raise ValueError(
                f"{type(module).__name__} under context parallelism was called without "
                f"{name}: each rank holds chunks from the head and the tail of every "
                "sequence, and without their global positions the rotary embedding "
                f"numbers them from 0 on every rank (wrong training, no other error); {fix}")
        if checked or not torch_private.has_values(given):  # a dry run's positions have no values
            return
        why = misplaced(given, shard)
        if why is not None:
            raise ValueError(
                f"{type(module).__name__} under context parallelism was given {name} that "
                f"are not this rank's part of the sequence: {why}. CP's attention would "
                f"mask by other positions than the rotary embedding's (wrong training, no "
                f"other error); {fix}")
        checked = True

    model.register_forward_pre_hook(check, with_kwargs=True)
    return name


__all__ = ["NAMES", "misplaced", "require_positions"]
