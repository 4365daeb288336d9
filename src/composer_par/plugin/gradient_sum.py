"""A tensor whose gradient is summed over one mesh dim: the identity forward, an
all-reduce of the gradient in backward.

This is what a tensor-parallel module needs where its input or parameter is the same on
every rank of the dim but each rank's backward gives only its part of the gradient: a
replicated activation entering column-split weights (Megatron's "f"), a norm's weight
applied to this rank's heads only (Qwen3's q/k norms). DTensor says the same with
``from_local(t, [Replicate()]).to_local(grad_placements=[Partial()])``, and pays for it on
every use: two subclass conversions forward, and in backward a redistribution from
``Partial`` through the functional collectives. Here the backward is one
``all_reduce`` on the dim's process group, the reduction transformers' own
``replicated_with_grad_allreduce`` does.

The reduction check (``composer_par.reduction_check``) types a result of
:func:`sum_gradient` as summed over the dim, as it types that DTensor pair: it watches
the calls through :func:`watching`.

Torch is imported inside functions only (the autograd function is built on first use).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

# (input, output, mesh) -> None, called after every sum_gradient while watched.
Watcher = Callable[[Any, Any, Any], None]

_watchers: list[Watcher] = []
_FUNCTION: Any = None


def sum_gradient(tensor: Any, mesh: Any) -> Any:
    """``tensor`` unchanged forward; its gradient summed over the ranks of ``mesh`` (a
    1-D DeviceMesh) in backward. A tensor that needs no gradient comes back as it is."""
    import torch

    if not (torch.is_grad_enabled() and tensor.requires_grad):
        return tensor
    out = _function().apply(tensor, mesh.get_group())
    for watcher in _watchers:
        watcher(tensor, out, mesh)
    return out


@contextlib.contextmanager
def watching(watcher: Watcher) -> Iterator[None]:
    """``watcher(input, output, mesh)`` called after each :func:`sum_gradient` inside."""
    _watchers.append(watcher)
    try:
        yield
    finally:
        _watchers.remove(watcher)


def _function() -> Any:
    global _FUNCTION
    if _FUNCTION is None:
        _FUNCTION = _make_function()
    return _FUNCTION


def _make_function() -> type:
    import torch
    import torch.distributed as dist

    class SumGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, tensor: Any, group: Any) -> Any:
            ctx.group = group
            return tensor.view_as(tensor)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            # Reduced into a copy: autograd may hand the same gradient tensor to other
            # inputs (an add's two operands), which an in-place sum would change too.
            summed = grad.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(summed, group=ctx.group)
            return summed, None

    return SumGradient


__all__ = ["sum_gradient", "watching"]
