"""Gradient averaging over the cp ranks when no data-parallel plugin folds cp in.

Every parameter is equal on every cp rank, but each rank's backward sees only its part of
the sequence: the gradient of the whole is the mean over the cp ranks (the loss is made
so, see :meth:`.runtime.ContextShard.token_mean`). With FSDP2 or HSDP in the plan, they
average over cp with their own collectives; alone, CP all-reduces each gradient as soon
as it is accumulated.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn


def average_over(model: nn.Module, group: Any) -> int:
    """Hook every trainable parameter of ``model`` so that its accumulated gradient is
    averaged over ``group``; returns how many were hooked."""
    size = dist.get_world_size(group)

    def average(param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        dist.all_reduce(local, group=group)
        local.div_(size)

    hooked = 0
    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(average)
            hooked += 1
    return hooked


__all__ = ["average_over"]
