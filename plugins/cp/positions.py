"""Refuse a forward of a CP model that is not given its tokens' positions.

A rank holds two chunks of every sequence, from its head and its tail. Without
positions, the project's Llama and a Hugging Face decoder number the rank's tokens
``0..local_len-1`` and rotate their queries and keys by those places, while CP's
attention masks by the global ones: the step runs and trains a different model, with no
error anywhere. So the model's forward must be given the positions
(``cp.positions(seq_len)``): a pre-hook on the model CP applied to raises where the
argument that carries them is missing. It checks their presence only: positions that
restart inside a sequence (packed documents) are the caller's to give.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.nn as nn

# The argument of a model's forward that carries its tokens' positions: Hugging Face's,
# then the project's Llama's.
NAMES = ("position_ids", "positions")


def require_positions(model: nn.Module) -> str | None:
    """Install the pre-hook on ``model``; returns the argument it requires, or None where
    the forward takes none of :data:`NAMES` (nothing to check)."""
    signature = inspect.signature(model.forward)
    name = next((n for n in NAMES if n in signature.parameters), None)
    if name is None:
        return None
    example = ("position_ids=cp.positions(seq_len).expand(batch, -1)" if name == NAMES[0]
               else "positions=cp.positions(seq_len)")

    def check(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            given = signature.bind_partial(*args, **kwargs).arguments.get(name)
        except TypeError:  # arguments the forward does not take: it says so itself
            return
        if given is None:
            raise ValueError(
                f"{type(module).__name__} under context parallelism was called without "
                f"{name}: each rank holds chunks from the head and the tail of every "
                "sequence, and without their global positions the rotary embedding "
                "numbers them from 0 on every rank (wrong training, no other error); "
                f"pass {example}, cp = context_of(model) (docs/cp.md)")

    model.register_forward_pre_hook(check, with_kwargs=True)
    return name


__all__ = ["NAMES", "require_positions"]
