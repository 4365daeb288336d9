"""Rank-side functions for tests/test_meta_init.py (importable by rank processes)."""

from __future__ import annotations

from typing import Any


def materialize(world_shape: dict[str, int], seed: int, default_dtype: str | None = None
                ) -> dict[str, Any]:
    """The task's Llama materialized by FSDP2 + MetaInit; ``default_dtype``: a default
    dtype set after the model is built (its scratch tensors must still take each
    parameter's own dtype)."""
    import torch
    import torch.distributed as dist

    from composer_par import FSDP2, MeshSpec, MetaInit, ParallelPlan
    from composer_par.testing.parity import full_parameters
    from composer_par.testing.tasks import llama

    with torch.device("meta"):
        model = llama.build()
    plan = ParallelPlan(MeshSpec(**world_shape)).use(FSDP2()).use(MetaInit(seed=seed))
    before = torch.get_default_dtype()
    if default_dtype is not None:
        torch.set_default_dtype(getattr(torch, default_dtype))
    try:
        model = plan.apply(model)
    finally:
        torch.set_default_dtype(before)
    # Every rank's own view (a replicated tensor is each rank's copy), not rank 0's alone.
    params = full_parameters(model)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return {"rank": dist.get_rank(), "params": params, "buffers": buffers,
            "peak": plan.notes["meta_init_peak_full_bytes"]}
