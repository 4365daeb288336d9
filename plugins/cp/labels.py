"""Refuse ``labels`` handed to a CP model that would shift them within a rank's part.

A Hugging Face causal LM given ``labels`` shifts them by one place itself, within the
tensor it is given. Under CP that tensor is a rank's two chunks, from the head and the
tail of the sequence: the head chunk's last token is trained to predict the tail chunk's
first, a token far away, and every rank's last token loses its label. The step runs and
trains on wrong targets with no error. Labels made on the whole sequence and cut like the
tokens (``cp.shard(next_token_labels(tokens))``) are right: given as ``shift_labels``
the model uses them unshifted, and ``cp.cross_entropy`` on the logits takes them as
they are. So a forward given ``labels`` without ``shift_labels`` is refused by a
pre-hook on the model CP applied to.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.nn as nn


def refuse_local_shift(model: nn.Module) -> bool:
    """Install the pre-hook on ``model`` where its forward takes ``labels``; returns
    whether it did."""
    signature = inspect.signature(model.forward)
    if "labels" not in signature.parameters:
        return False

    def check(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            labels = signature.bind_partial(*args, **kwargs).arguments.get("labels")
        except TypeError:  # arguments the forward does not take: it says so itself
            return
        if labels is not None and kwargs.get("shift_labels") is None:
            raise ValueError(
                f"{type(module).__name__} under context parallelism was given labels, "
                "which it would shift by one place within this rank's part of the "
                "sequence (two chunks, from its head and its tail): some tokens would be "
                "trained to predict tokens far from them (wrong training, no other "
                "error); make the labels on the whole sequence and cut them as the "
                "tokens, labels = cp.shard(next_token_labels(tokens)), and take the loss "
                "as cp.cross_entropy(model(...).logits, labels) (docs/cp.md)")

    model.register_forward_pre_hook(check, with_kwargs=True)
    return True


__all__ = ["refuse_local_shift"]
