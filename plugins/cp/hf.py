"""Hugging Face decoders: CP's attention function in transformers' attention interface.

A Hugging Face attention module computes its queries, keys and values (rotary applied
with the ``position_ids`` it is given) and hands them to the function its config's
``_attn_implementation`` names. CP registers :func:`cp_attention_forward` under
:data:`IMPLEMENTATION` and points the model at it: the attention math is
``scaled_dot_product_attention`` as under ``"sdpa"``, over the whole sequence, with the
sliding window the module passes (Mistral, Gemma 3's local layers). transformers builds no
mask for an implementation it does not know, so the mask is CP's own, from the global
positions; a padding mask handed to the model reaches the function and is refused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .attention import context_attention
from .runtime import ATTRIBUTE, ContextShard

IMPLEMENTATION = "composer_par_cp"


def cp_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None,
                         dropout: float = 0.0, scaling: float | None = None,
                         sliding_window: int | None = None, **kwargs: Any
                         ) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns ``(batch, seq, heads, dim)``."""
    shard = getattr(module, ATTRIBUTE, None)
    if not isinstance(shard, ContextShard):
        raise RuntimeError(f"{type(module).__name__} runs CP's attention but no CP plan was "
                           "applied to it")
    if attention_mask is not None:
        raise ValueError(
            "a padding (or custom) attention mask under context parallelism: each rank "
            "holds part of the sequence and CP masks by global positions only; pass "
            "attention_mask=None with sequences packed to full length (rule CP824)")
    if dropout:
        raise ValueError("attention dropout under context parallelism: set the model's "
                         "attention_dropout to 0")
    if kwargs.get("softcap") is not None:
        raise ValueError("attention logit soft-capping: scaled_dot_product_attention has "
                         "none, so CP cannot run this model (rule CP823)")
    out = context_attention(query, key, value, group=shard.group, mode=shard.mode,
                            window=sliding_window, scale=scaling, mesh=shard.mesh)
    return out.transpose(1, 2).contiguous(), None


def drive_hf_attention(model: nn.Module, shard: ContextShard) -> int:
    """Register CP's attention function and point ``model`` (and each attention module)
    at it; returns the number of attention modules."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, cp_attention_forward)
    model.set_attn_implementation(IMPLEMENTATION)  # type: ignore[operator]
    count = 0
    for module in model.modules():
        if type(module).__name__.endswith("Attention") and hasattr(module, "config"):
            setattr(module, ATTRIBUTE, shard)
            count += 1
    return count


__all__ = ["IMPLEMENTATION", "cp_attention_forward", "drive_hf_attention"]
