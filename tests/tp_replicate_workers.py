"""Rank-side function of tests/test_tp_replicate_local.py."""

from __future__ import annotations

from typing import Any


def replicated_norms(sequence_parallel: bool) -> dict[str, Any]:
    """FSDP2 x TP (or TP alone) on the tasks' Llama: during one training step, what each
    norm the plan replicates over tp (``replicate_rest``) holds as its weight while its
    forward runs, what it holds after, and its gradient's placements over tp."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from composer_par import TP, MeshSpec, MetaInit, ParallelPlan
    from composer_par.testing.tasks import llama

    world = dist.get_world_size()
    plan = ParallelPlan(MeshSpec(tp=world)).use(TP(sequence_parallel=sequence_parallel)).use(
        MetaInit(seed=0))
    with torch.device("meta"):
        model = llama.build()
    model = plan.apply(model)
    seen: dict[str, str] = {}

    def during(name: str) -> Any:
        # a pre-hook registered after the style's runs after it, as the forward would
        def hook(module: Any, args: Any) -> None:
            seen[name] = type(module.weight).__name__
        return hook

    norms = {n: m for n, m in model.named_modules() if n.endswith("norm")}
    handles = [m.register_forward_pre_hook(during(n)) for n, m in norms.items()]
    loss = llama.loss(model, llama.batch(0))
    loss.backward()
    for handle in handles:
        handle.remove()
    return {"during": seen,
            "after": {n: type(m.weight).__name__ for n, m in norms.items()},
            "grads": {n: [type(p).__name__ for p in m.weight.grad.placements]
                      if isinstance(m.weight.grad, DTensor) else None
                      for n, m in norms.items()}}
