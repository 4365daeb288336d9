"""What a model's forward returned, as a loss reads it.

``plan.training_step`` gives ``loss_fn`` the model's own output (the one loss contract,
see :mod:`composer_par.training`): a tensor for a plain module, a Hugging Face
``ModelOutput`` (``CausalLMOutputWithPast``: ``.logits``) for a transformers model, a tuple
for a model returning several values. A loss helper takes any of them through
:func:`logits_of`, so the same helper runs on every kind of model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def logits_of(outputs: Any) -> torch.Tensor:
    """The logits in ``outputs``: a tensor as it is; a Hugging Face model's output's
    ``logits``; a mapping's ``"logits"``; a tuple's or list's first element. Anything else
    is a TypeError naming what was given."""
    import torch

    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, Mapping):
        logits = outputs.get("logits")
    if logits is None and isinstance(outputs, (tuple, list)) and outputs:
        logits = outputs[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"the model returned a {type(outputs).__name__} holding no logits: a "
                        "loss takes a tensor, an output with .logits (a Hugging Face model's), "
                        "or a tuple whose first element is the logits")
    return logits


__all__ = ["logits_of"]
