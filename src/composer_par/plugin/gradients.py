"""Gradients averaged over a model-parallel dim when no data-parallel plugin does it.

Context and expert parallelism fold their dim into data parallelism: parameters (the
dense ones, for expert parallelism) are equal on every rank of the dim, but each rank's
backward sees only its own tokens, so the gradient of the whole is the mean over the
dim's ranks. With FSDP2 or HSDP in the plan, they average over the folded dims with
their own collectives; alone, the model-parallel plugin hooks each parameter and
all-reduces its gradient as soon as it is accumulated. torch is imported inside the
function: this module is part of the torch-free author package.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.nn as nn


def average_gradients(params: Iterable[nn.Parameter], group: Any) -> int:
    """After each backward, average each trainable parameter's accumulated gradient over
    the process group ``group`` (the ranks of one mesh dim); returns how many parameters
    were hooked."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    size = dist.get_world_size(group)

    def hook(param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        if isinstance(grad, DTensor) and isinstance(param, DTensor) \
                and grad.placements != param.placements:
            # torch's backward of a vocabulary-split embedding (TP's rowwise) gives a
            # replicated gradient of the whole table: this rank's rows are all it needs,
            # and a slice of a replicated tensor moves nothing.
            grad = grad.redistribute(param.device_mesh, param.placements)
            param.grad = grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        dist.all_reduce(local, group=group)  # SUM: gloo has no AVG
        local.div_(size)

    count = 0
    for param in params:
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(hook)
            count += 1
    return count


__all__ = ["average_gradients"]
