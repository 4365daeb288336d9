"""Everything of torchao the float8 plugin reaches, through this one module.

torchao's float8 training has a small public API (``convert_to_float8_training``,
``Float8LinearConfig``, ``precompute_float8_dynamic_scale_for_fsdp`` and the float8
tensor-parallel styles), and a few things the plugin needs sit beside it: the class of a
converted layer (to tell converted layers apart), the weight wrapper of FSDP2's float8
all-gather, and the attribute where that wrapper keeps its precomputed scale (to clear a
scale whose weight changed). Each is named once in :data:`SYMBOLS`, with what the plugin
does with it; no other module of the plugin imports torchao (``tests/test_float8.py``
checks both, and that every symbol exists on the installed torchao).

Nothing here imports torchao at import time: validation runs without it.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

#: The oldest torchao whose float8 API this plugin was written against (the extra's floor).
MINIMUM = (0, 18)


@attrs.frozen
class TorchaoSymbol:
    """One torchao symbol: ``"module:attribute"`` for an import, ``"Class.attribute"`` for
    an attribute of objects torchao makes; ``public`` says whether torchao documents it."""

    symbol: str
    public: bool
    why: str


SYMBOLS: tuple[TorchaoSymbol, ...] = (
    TorchaoSymbol("torchao.float8:convert_to_float8_training", True,
                  "swaps the chosen nn.Linear modules for float8 ones (the convert stage)"),
    TorchaoSymbol("torchao.float8:Float8LinearConfig", True,
                  "the recipe (from_recipe_name), emulation and FSDP2 float8 all-gather"),
    TorchaoSymbol("torchao.float8:ScalingGranularity", True,
                  "whether a converted layer scales per tensor (torchao's float8 "
                  "tensor-parallel styles assume it)"),
    TorchaoSymbol("torchao.float8:ScalingType", True,
                  "whether a converted layer scales dynamically (the same)"),
    TorchaoSymbol("torchao.float8:precompute_float8_dynamic_scale_for_fsdp", True,
                  "every float8 weight's scale in one all-reduce of their amaxes, once per "
                  "optimizer step, instead of one all-reduce per weight and all-gather"),
    TorchaoSymbol("torchao.float8.float8_tensor_parallel:Float8ColwiseParallel", True,
                  "tensor parallelism of a float8 layer: its input cast to float8 before "
                  "the all-gather"),
    TorchaoSymbol("torchao.float8.float8_tensor_parallel:Float8RowwiseParallel", True,
                  "tensor parallelism of a float8 layer (row-wise split)"),
    TorchaoSymbol("torchao.float8.float8_linear:Float8Linear", False,
                  "the class of a converted layer: which layers were converted, and which "
                  "tensor-parallel styles they need"),
    TorchaoSymbol("torchao.float8.fsdp_utils:WeightWithDynamicFloat8CastTensor", False,
                  "the weight wrapper of FSDP2's float8 all-gather: which weights gather "
                  "in float8 and carry a precomputed scale"),
    TorchaoSymbol("WeightWithDynamicFloat8CastTensor._precomputed_scale", False,
                  "the scale the precompute left on a weight, used by every later "
                  "all-gather until replaced: cleared when the weight may have changed, "
                  "so that no all-gather casts with a stale scale"),
)


class TorchaoMissing(ImportError):
    """torchao is not installed, or lacks a symbol the plugin needs."""


def installed() -> bool:
    """Whether torchao can be imported (without importing it)."""
    return importlib.util.find_spec("torchao") is not None


def _reach(symbol: str) -> Any:
    module, _, attr = symbol.partition(":")
    try:
        found: Any = importlib.import_module(module)
    except ImportError as exc:
        raise TorchaoMissing(
            f"the float8 plugin needs torchao ({module} could not be imported: {exc}); "
            "install it with pip install 'composer-par[float8]'") from exc
    for part in attr.split("."):
        if not hasattr(found, part):
            raise TorchaoMissing(f"the installed torchao has no {symbol.replace(':', '.')}; "
                                 f"the float8 plugin needs torchao >= "
                                 f"{'.'.join(map(str, MINIMUM))}")
        found = getattr(found, part)
    return found


def linear_config(recipe: str, *, emulate: bool, float8_all_gather: bool) -> Any:
    """torchao's ``Float8LinearConfig`` of ``recipe`` with emulation and FSDP2's float8
    all-gather set."""
    import dataclasses

    config_class = _reach("torchao.float8:Float8LinearConfig")
    base = config_class.from_recipe_name(recipe)
    return dataclasses.replace(base, emulate=emulate,
                               enable_fsdp_float8_all_gather=float8_all_gather)


def convert(model: nn.Module, config: Any, keep: Any) -> nn.Module:
    """``convert_to_float8_training`` over the layers ``keep(module, path)`` accepts."""
    function = _reach("torchao.float8:convert_to_float8_training")
    return function(model, module_filter_fn=keep, config=config)  # type: ignore[no-any-return]


def float8_linear_class() -> type:
    return _reach("torchao.float8.float8_linear:Float8Linear")  # type: ignore[no-any-return]


def is_float8_linear(module: Any) -> bool:
    """Whether ``module`` is one of torchao's float8 training layers."""
    if not installed():
        return False
    return isinstance(module, float8_linear_class())


def recipe_is_tensorwise(module: Any) -> bool:
    """Whether a float8 layer scales its weight and input per tensor, dynamically: what
    torchao's float8 tensor-parallel styles assume."""
    granularity = _reach("torchao.float8:ScalingGranularity")
    scaling = _reach("torchao.float8:ScalingType")
    config = module.config
    return bool(config.cast_config_weight.scaling_granularity is granularity.TENSORWISE
                and config.cast_config_input.scaling_granularity is granularity.TENSORWISE
                and module.scaling_type_input is scaling.DYNAMIC
                and module.scaling_type_grad_output is scaling.DYNAMIC)


def gathers_in_float8(weight: Any) -> bool:
    """Whether a parameter (a DTensor or not) is FSDP2's float8 all-gather weight."""
    wrapper = _reach("torchao.float8.fsdp_utils:WeightWithDynamicFloat8CastTensor")
    from composer_par.plugin import torch_private

    local = _local(weight, torch_private)
    return isinstance(local, wrapper)


def _local(weight: Any, torch_private: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return torch_private.local_tensor(weight) if isinstance(weight, DTensor) else weight


def precompute_scales(model: nn.Module) -> None:
    """Every float8 all-gather weight's scale from one all-reduce of their amaxes."""
    _reach("torchao.float8:precompute_float8_dynamic_scale_for_fsdp")(model)


def clear_scale(weight: Any) -> None:
    """Forget the precomputed scale of a float8 all-gather weight: its next all-gather
    computes the scale from the weight as it is then."""
    from composer_par.plugin import torch_private

    local = _local(weight, torch_private)
    if hasattr(local, "_precomputed_scale"):
        local._precomputed_scale = None


def precomputed_scale(weight: Any) -> torch.Tensor | None:
    """The scale the precompute left on a float8 all-gather weight, if any."""
    from composer_par.plugin import torch_private

    return getattr(_local(weight, torch_private), "_precomputed_scale", None)


def tp_style(kind: str, style: Any) -> Any:
    """torchao's float8 ``ColwiseParallel`` / ``RowwiseParallel`` with ``style``'s layouts."""
    name = {"colwise": "Float8ColwiseParallel", "rowwise": "Float8RowwiseParallel"}[kind]
    cls = _reach(f"torchao.float8.float8_tensor_parallel:{name}")
    return cls(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
               use_local_output=style.use_local_output)


__all__ = ["MINIMUM", "SYMBOLS", "TorchaoMissing", "TorchaoSymbol", "clear_scale", "convert",
           "float8_linear_class", "gathers_in_float8", "installed", "is_float8_linear",
           "linear_config", "precompute_scales", "precomputed_scale", "recipe_is_tensorwise",
           "tp_style"]
