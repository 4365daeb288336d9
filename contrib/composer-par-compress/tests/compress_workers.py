"""Tasks and plans the compression tests train on their ranks (imported by name there).

Plans are plan-file TOML: the rank processes find ``compress`` through its entry point,
exactly as a user's would.
"""

from __future__ import annotations

from composer_par.testing.tasks import MLPTask

# Matrices of 256 x 256 (the byte measurements): two hidden blocks and a 256 -> 1 head.
wide = MLPTask(width=256, depth=2, global_batch=16)
# The 200-step quality runs: 64 x 64 matrices, two blocks (three FSDP modules).
small = MLPTask(width=64, depth=2, global_batch=16)

WIDE = "compress_workers:wide"
SMALL = "compress_workers:small"


def plan(mesh: str, *plugins: str, seed: int = 3) -> str:
    """Plan-file TOML: ``mesh`` lines, then each plugin table, then MetaInit."""
    tables = "\n".join(f"[[plugins]]\n{p.strip()}\n" for p in plugins)
    return f"[mesh]\n{mesh}\n\n{tables}\n[[plugins]]\nname = \"meta_init\"\nseed = {seed}\n"


HSDP_2X2 = "dp_replicate = 2\ndp_shard = 2"
REPLICATE_2 = "dp_replicate = 2"
REPLICATE_4 = "dp_replicate = 4"


def hsdp(*extra: str, mesh: str = HSDP_2X2) -> str:
    return plan(mesh, 'name = "hsdp"', 'name = "fsdp2"', *extra)


def replicate_only(*extra: str, mesh: str = REPLICATE_2) -> str:
    return plan(mesh, 'name = "hsdp"', *extra)


def compress(method: str, **options: object) -> str:
    lines = ['name = "compress"', f'method = "{method}"']
    for key, value in options.items():
        lines.append(f"{key} = {str(value).lower() if isinstance(value, bool) else value}")
    return "\n".join(lines)


# -- rank functions of the reducer tests ---------------------------------------------------


def _bucket(buffer, params=None, divisor=None):  # type: ignore[no-untyped-def]
    import torch.distributed as dist
    from composer_par.plugin import GradBucket

    group = dist.group.WORLD
    size = float(dist.get_world_size()) if divisor is None else divisor
    return GradBucket("block", buffer, params, group, size)


def low_precision_sums(dtype_name: str) -> dict[str, object]:
    """Each rank holds a different vector; the reducer's result, and what it should be."""
    import torch
    import torch.distributed as dist

    from composer_par_compress.lowp import LowPrecisionAllReduce

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(rank)
    values = torch.randn(1001, generator=gen)  # not a multiple of the world size
    # Where 16-bit accumulation and fp32 accumulation differ: 1 + three times 2^-8.
    values[:4] = torch.tensor([1.0, 2.0**-8, 2.0**-8, 2.0**-8]).roll(rank) * world
    exact = values.clone()
    dist.all_reduce(exact)
    exact /= world
    bucket = _bucket(values.clone())
    LowPrecisionAllReduce(dtype)(bucket)
    sixteen = values.to(dtype)
    dist.all_reduce(sixteen)  # the collective's own (16-bit) sum, for contrast
    return {"result": bucket.buffer, "exact": exact, "sixteen_bit_sum": sixteen.float() / world}


def powersgd_steps(rank_: int, steps: int) -> dict[str, object]:
    """PowerSGD on a 24 x 40 matrix and a bias; returns per step what it produced."""
    import torch
    import torch.distributed as dist

    from composer_par_compress.powersgd import PowerSGD

    rank = dist.get_rank()
    reducer = PowerSGD(rank=rank_, min_compress_numel=0)
    out: dict[str, list[object]] = {"applied": [], "mean": [], "error": []}
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        buffer = torch.randn(24 * 40 + 24, generator=gen)
        mean = buffer.clone()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        weight, bias = buffer[: 24 * 40].view(24, 40), buffer[24 * 40:]
        bucket = _bucket(buffer, (("w", weight), ("b", bias)))
        reducer(bucket)
        out["applied"].append(buffer.clone())
        out["mean"].append(mean)
        out["error"].append(reducer.errors[("block", "w")].clone())
    return out


def powersgd_rank_one_is_exact() -> dict[str, object]:
    """When every rank's gradient matrix has rank 1, PowerSGD at rank 1 is exact."""
    import torch
    import torch.distributed as dist

    from composer_par_compress.powersgd import PowerSGD

    rank = dist.get_rank()
    u = torch.arange(1.0, 17.0)
    v = torch.linspace(-1.0, 1.0, 32)
    weight = torch.outer(u, v) * (rank + 1)  # the same direction, different scales
    buffer = weight.reshape(-1).clone()
    reducer = PowerSGD(rank=1, min_compress_numel=0)
    reducer(_bucket(buffer, (("w", buffer.view(16, 32)),)))
    world = dist.get_world_size()
    mean = torch.outer(u, v) * sum(r + 1 for r in range(world)) / world
    return {"max_error": float((buffer.view(16, 32) - mean).abs().max()),
            "scale": float(mean.abs().max())}
