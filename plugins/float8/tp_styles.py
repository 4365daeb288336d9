"""torchao's float8 tensor-parallel styles for the layers float8 converted: the TP plugin
asks every plugin (``composer_par_parallel_style``) before it applies a style, and float8
answers for its own layers.

``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` cast a layer's input to float8
before it is redistributed (sequence parallelism's all-gather then moves float8) and its
output gradient in backward; they assume per-tensor dynamic scales, so layers of a
rowwise recipe keep torch's own styles (as torchtitan does)."""

from __future__ import annotations

from typing import Any

from . import torchao_api


def float8_style(module: Any, style: Any) -> Any:
    """The float8 style to use for ``module`` in place of ``style``, or None."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not torchao_api.is_float8_linear(module) or not torchao_api.recipe_is_tensorwise(module):
        return None
    if type(style) is ColwiseParallel:
        return torchao_api.tp_style("colwise", style)
    if type(style) is RowwiseParallel:
        return torchao_api.tp_style("rowwise", style)
    return None


__all__ = ["float8_style"]
