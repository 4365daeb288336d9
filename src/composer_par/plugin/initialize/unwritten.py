"""The unwritten-parameter check: a NaN planted in each parameter's first element before
its initializer runs, looked at after. An initializer that writes the tensor overwrites
it; one that skips the module (transformers' ``_init_weights`` on a class it does not
know, a ``reset_parameters()`` that forgets a bias) leaves it, and the parameter is
reported instead of training from whatever memory ``to_empty`` left."""

from __future__ import annotations

import torch


def plant_sentinel(tensor: torch.Tensor) -> torch.Tensor | None:
    """Write a NaN into ``tensor``'s first element and return that element as a view, to
    tell with :func:`sentinel_intact` whether anything wrote it since. None where there
    is nothing to watch: an empty tensor, one not of a floating-point dtype, or one of a
    dtype that has no NaN (float4: such a parameter goes unwatched)."""
    if not tensor.dtype.is_floating_point or tensor.numel() == 0:
        return None
    # One element, not the whole tensor: an initializer writes every element or skips
    # the module, and the check must not cost a pass over the data.
    first = tensor.detach().view(-1)[:1]
    try:
        first.fill_(float("nan"))
    except RuntimeError:  # NotImplementedError too: a dtype without a NaN
        return None
    return first


def sentinel_intact(first: torch.Tensor) -> bool:
    """Whether the element :func:`plant_sentinel` wrote still holds its NaN."""
    return bool(torch.isnan(first).item())


class UninitializedError(RuntimeError):
    """Parameters their module's initializer did not write (they would train from
    whatever memory ``to_empty`` left)."""

    def __init__(self, names: list[str], by_type: dict[str, str]) -> None:
        self.names = names
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        how = "; ".join(f"{cls} by {init}" for cls, init in by_type.items())
        super().__init__(
            f"{len(names)} parameter(s) were left uninitialized: {shown} (initialized by "
            f"{how}, which did not write them: they would train from whatever memory "
            "to_empty left). Fix: make their initializer write them (the module's "
            "reset_parameters(), or MetaInit(init_fn=...), which is called on every module "
            "that owns tensors in place of the model's _init_weights), or load them from a "
            "checkpoint (LoadSafetensors / LoadCheckpoint)")
