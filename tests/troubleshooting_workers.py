"""Rank-side functions for tests/test_troubleshooting.py."""

from __future__ import annotations

import os
from typing import Any


def sharded_then_materialized(seed: int) -> dict[str, Any]:
    """FSDP2 + MetaInit on this rank: what each parameter holds locally and globally."""
    import torch
    import torch.distributed as dist

    from composer_par import FSDP2, MeshSpec, MetaInit, ParallelPlan
    from composer_par.testing.parity import full_parameters
    from composer_par.testing.tasks import llama

    with torch.device("meta"):
        model = llama.build()
    model = ParallelPlan(MeshSpec(dp_shard=dist.get_world_size())).use(FSDP2()).use(
        MetaInit(seed=seed)).apply(model)
    shapes = {n: (tuple(p.shape), tuple(p.to_local().shape)) for n, p in model.named_parameters()}
    full = full_parameters(model)
    return {"shapes": shapes, "full": full if dist.get_rank() == 0 else None,
            "on_meta": [n for n, p in model.named_parameters() if p.to_local().is_meta]}


def load_counting_bytes(path: str) -> int:
    """LoadSafetensors into a 2-rank FSDP2 model; returns the bytes this rank read."""
    import torch

    from composer_par import FSDP2, LoadSafetensors, MeshSpec, ParallelPlan
    from composer_par.testing.tasks import llama

    read = 0
    real_preadv = os.preadv

    def counting_preadv(fd: int, buffers: Any, offset: int) -> int:
        nonlocal read
        got = real_preadv(fd, buffers, offset)
        read += got
        return got

    os.preadv = counting_preadv
    try:
        with torch.device("meta"):
            model = llama.build()
        ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(LoadSafetensors(path)).apply(model)
    finally:
        os.preadv = real_preadv
    return read
