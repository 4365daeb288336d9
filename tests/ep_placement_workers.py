"""Tasks for tests/test_ep_placement.py (importable by rank processes)."""

from __future__ import annotations

from tests.ep_workers import MoELlamaTask

# Two experts over ep(2): one per ep rank, fewer than the two dp_shard ranks FSDP2
# shards it over.
one_expert_per_rank = MoELlamaTask(num_experts=2, top_k=1)


def divide_factors(plan_toml: str) -> list[float]:
    """After apply on this rank: the gradient divide factor of every FSDP module."""
    from composer_par.plugin import torch_private
    from composer_par.testing.parity import apply_to_built, build_plan
    from tests.ep_workers import moe_llama

    model, _, _ = apply_to_built(moe_llama, build_plan(plan_toml))
    return sorted({torch_private.divide_factor(group) for module in model.modules()
                   if hasattr(module, "_get_fsdp_state")
                   for group in torch_private.fsdp_param_groups(module)})
