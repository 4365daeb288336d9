"""Which modules of a model are experts modules, and how many experts each holds.

An experts module holds all of a block's experts fused: its own parameters are tensors
whose leading tensor dim is the expert (``[num_experts, ...]``, at least one of them
3-D), and its forward takes ``(hidden_states, top_k_index, top_k_weights)``. That is
transformers 5.x's layout (Mixtral, Qwen2/3-MoE, DeepSeek-V3, OLMoE ...: the modules
their ``_ep_plan`` names ``ep_dispatch_experts``) and that of
``composer_par.models.moe_llama``. torch is not imported here: validation runs on it.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.plugin import clean_name

if TYPE_CHECKING:
    import torch.nn as nn


@attrs.frozen
class ExpertsSite:
    """One experts module: its clean path, the module, the global expert count and the
    names of its parameters split per expert."""

    path: str
    module: Any = attrs.field(eq=False, repr=False)
    num_experts: int
    names: tuple[str, ...]
    # The width of the hidden states it takes (the last tensor dim of its first weight,
    # [num_experts, out, hidden], or its second if stored transposed) and the bytes of
    # one element: what a token moves.
    hidden: int = 0
    element_bytes: int = 4


def _takes_routing(module: nn.Module) -> bool:
    """The forward takes hidden states, expert indices and weights (three positional)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3


def experts_site(path: str, module: nn.Module) -> ExpertsSite | None:
    """``module`` as an experts module, or None if it is not one."""
    params = list(module.named_parameters(recurse=False))
    if not params or not any(p.dim() == 3 for _, p in params):
        return None
    leading = {p.shape[0] for _, p in params if p.dim() >= 2}
    if len(leading) != 1 or not _takes_routing(module):
        return None
    count = leading.pop()
    names = tuple(n for n, p in params if p.dim() >= 2 and p.shape[0] == count)
    if len(names) != len(params) or count < 2:
        return None
    first = params[0][1]
    # transformers marks experts stored [num_experts, in, out] (gpt-oss) as transposed.
    hidden = first.shape[1] if getattr(module, "is_transposed", False) is True else first.shape[-1]
    return ExpertsSite(clean_name(path), module, count, names, hidden=int(hidden),
                       element_bytes=first.element_size())


def find_experts(model: nn.Module) -> list[ExpertsSite]:
    """Every experts module of ``model``, in module order."""
    found = []
    for path, module in model.named_modules():
        site = experts_site(path, module)
        if site is not None:
            found.append(site)
    return found


