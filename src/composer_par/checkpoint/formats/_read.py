"""What the format modules share: a reader that gives a tensor as stored when no dtype
is asked for."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from composer_par.checkpoint.convert import TensorSpec


def as_stored(specs: Mapping[str, TensorSpec], read: Callable[[str, Any], torch.Tensor]
              ) -> Callable[[str, torch.dtype | None], torch.Tensor]:
    """``read(name, dtype)`` that takes ``dtype=None`` as the stored dtype."""
    def reader(name: str, dtype: torch.dtype | None) -> torch.Tensor:
        import torch

        if name not in specs:
            raise KeyError(name)
        return read(name, dtype if dtype is not None else getattr(torch, specs[name].dtype))
    return reader
