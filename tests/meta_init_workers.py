"""Rank-side functions for tests/test_meta_init.py (importable by rank processes)."""

from __future__ import annotations

from typing import Any


def materialize(world_shape: dict[str, int], seed: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from composer_par import FSDP2, MeshSpec, MetaInit, ParallelPlan
    from composer_par.testing.parity import full_parameters
    from composer_par.testing.tasks import llama

    with torch.device("meta"):
        model = llama.build()
    plan = ParallelPlan(MeshSpec(**world_shape)).use(FSDP2()).use(MetaInit(seed=seed))
    model = plan.apply(model)
    # Every rank's own view (a replicated tensor is each rank's copy), not rank 0's alone.
    params = full_parameters(model)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return {"rank": dist.get_rank(), "params": params, "buffers": buffers,
            "peak": plan.notes["meta_init_peak_full_bytes"]}
