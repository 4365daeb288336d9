"""A Hugging Face model's own expert-parallel plan, read once for every plugin.

transformers gives a mixture-of-experts model an expert-parallel plan (``_ep_plan``:
module path patterns to styles such as ``ep_dispatch_experts`` and ``grouped_gemm``).
Expert parallelism applies it; FSDP2 says when no plugin does (CP427); TP reads which
experts modules it names. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def expert_parallel_plan(model: Any) -> dict[str, Any]:
    """The model's expert-parallel plan (``_ep_plan``) as a new dict, or {} when it has
    none (or something that is not a mapping)."""
    plan = getattr(model, "_ep_plan", None)
    return dict(plan) if isinstance(plan, Mapping) else {}


__all__ = ["expert_parallel_plan"]
