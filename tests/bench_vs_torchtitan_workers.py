"""Rank-side function of tests/test_bench_vs_torchtitan.py: torchtitan's Llama3 trained a
few steps by torchtitan's parallelize_llama and by a ParallelPlan, with the benchmark's own
builders (benchmarks/bench_vs_torchtitan.py, loaded by path: benchmarks/ is no package)."""

from __future__ import annotations

from typing import Any

from tests.benchmark_modules import benchmark


def bench() -> Any:
    return benchmark("bench_vs_torchtitan")


def fsdp_side_by_side(layers: int, seq: int, batch: int, steps: int) -> dict[str, Any]:
    """FSDP over every rank, no checkpointing: each side's losses, and per parameter
    whether the two sides' full values (gathered) are bitwise equal, with the largest
    difference."""
    import structlog
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    b = bench()
    b._standins()
    world = dist.get_world_size()
    cfg = b._config(layers, seq, 1, False)
    weights = b._reference(cfg)
    tt_model, tt_shard = b.by_torchtitan(cfg, world, (1, world, 1), "none", False, weights)
    cp_model, cp_shard = b.by_plan(cfg, {"dp_shard": world}, "none", False, weights)
    summed = b.sum_gradients()
    sides = {"torchtitan": b._Side(tt_model, tt_shard, True),
             "composer_par": b._Side(cp_model, cp_shard, summed)}
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, b.VOCAB, (batch, seq + 1), generator=gen)
        for side in sides.values():
            side.step(tokens)

    def full(param: Any) -> Any:
        return param.full_tensor() if isinstance(param, DTensor) else param.detach()

    theirs = {b._clean(n): p for n, p in tt_model.named_parameters()}
    params: dict[str, tuple[bool, float]] = {}
    with torch.no_grad():
        for name, param in cp_model.named_parameters():
            mine, other = full(param), full(theirs[b._clean(name)])
            params[name] = (bool(torch.equal(mine, other)),
                            float((mine - other).abs().max()))
    changed = max(float((full(p) - weights[n]).abs().max())
                  for n, p in cp_model.named_parameters())
    return {"losses": {n: s.losses for n, s in sides.items()}, "params": params,
            "names": sorted(theirs), "shards": (tuple(tt_shard), tuple(cp_shard)),
            "summed": summed, "changed": changed}
