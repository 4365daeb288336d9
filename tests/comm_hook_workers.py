"""Rank-side code of tests/test_comm_hooks.py: test plugins, plans, and rank functions.

The plugins answer ``composer_par_comm_hooks`` with plain (uncompressed) comms that count
their calls, so a test can see that every FSDP module went through the hook and that
training still matches a single process.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from composer_par import FSDP2, HSDP, MeshSpec, MetaInit, ParallelPlan
from composer_par.plugin import Plugin, hookimpl
from composer_par.plugin.comm import CommHook, CommSetup, GradBucket, all_reduce_mean

# What the hooks saw on this rank (each rank is its own process).
SEEN: dict[str, list[Any]] = {"all_reduce": [], "all_gather": [], "reduce_scatter": []}


class _CountingReducer:
    def __init__(self, setup: CommSetup) -> None:
        self.size = setup.size

    def __call__(self, bucket: GradBucket) -> None:
        names = [n for n, _ in bucket.params] if bucket.params is not None else None
        SEEN["all_reduce"].append((bucket.key, bucket.divisor, names))
        all_reduce_mean(bucket)


@attrs.frozen
class PlainAllReduce(Plugin):
    """An all-reduce comm hook that does what torch would: SUM, then divide."""

    name: ClassVar[str] = "plain_all_reduce"
    dim: str = "dp_replicate"

    @hookimpl
    def composer_par_comm_hooks(self) -> list[CommHook]:
        return [CommHook(self.dim, all_reduce=_CountingReducer)]


def _shard_comms() -> tuple[Any, Any]:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )

    class CountingAllGather(DefaultAllGather):
        def __call__(self, output_tensor: Any, input_tensor: Any, group: Any,
                     async_op: bool = False) -> Any:
            SEEN["all_gather"].append(int(input_tensor.numel()))
            return super().__call__(output_tensor, input_tensor, group, async_op)

    class CountingReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            SEEN["reduce_scatter"].append(int(input_tensor.numel()))
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    return CountingAllGather, CountingReduceScatter


@attrs.frozen
class PlainShardComms(Plugin):
    """Custom all-gather and reduce-scatter classes on the shard dim (counting only)."""

    name: ClassVar[str] = "plain_shard_comms"
    dim: str = "dp_shard"

    @hookimpl
    def composer_par_comm_hooks(self) -> list[CommHook]:
        return [CommHook(self.dim, all_gather=lambda setup: _shard_comms()[0](),
                         reduce_scatter=lambda setup: _shard_comms()[1]())]


# -- plans (addressed as "tests.comm_hook_workers:<name>") ---------------------------------


def hsdp_fsdp2_hooked() -> ParallelPlan:
    return (ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2))
            .use(HSDP()).use(FSDP2()).use(PlainAllReduce()).use(MetaInit(seed=5)))


def hsdp_alone_hooked() -> ParallelPlan:
    return ParallelPlan(MeshSpec(dp_replicate=4)).use(HSDP()).use(PlainAllReduce()).use(
        MetaInit(seed=5))


def hsdp_alone_hooked_divide_factor() -> ParallelPlan:
    # The loss is a mean over each rank's micro-batch: a factor of the data-parallel size
    # gives the same gradients as no factor, through the SUM-only path of the hook.
    return ParallelPlan(MeshSpec(dp_replicate=4)).use(HSDP(gradient_divide_factor=4.0)).use(
        PlainAllReduce()).use(MetaInit(seed=5))


def hsdp_fsdp2_hooked_divide_factor() -> ParallelPlan:
    return (ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2))
            .use(HSDP(gradient_divide_factor=4.0)).use(FSDP2()).use(PlainAllReduce())
            .use(MetaInit(seed=5)))


def hsdp_fsdp2_all_hooked() -> ParallelPlan:
    return (ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2))
            .use(HSDP()).use(FSDP2()).use(PlainAllReduce()).use(PlainShardComms())
            .use(MetaInit(seed=5)))


# -- rank functions ------------------------------------------------------------------------


def hooked_layout(plan_name: str) -> dict[str, Any]:
    """Apply a plan, run one step under CommCounter; what the hooks and the layout were."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from composer_par.testing import tasks
    from composer_par.testing.comm_count import CommCounter

    plan = globals()[plan_name]()
    task = tasks.mlp
    with torch.device("meta"):
        model = task.build()
    model = plan.apply(model)
    index, count = plan.data_shard()
    for values in SEEN.values():
        values.clear()
    with CommCounter() as counter:
        loss = task.loss(model, task.batch(0).chunk(count)[index])
        loss.backward()
    mesh = plan.mesh.resolve(dist.get_world_size())
    return {
        "mesh_dims": sorted({p.device_mesh.mesh_dim_names for p in model.parameters()
                             if isinstance(p, DTensor)}),
        "placements": sorted({str(p.placements) for p in model.parameters()
                              if isinstance(p, DTensor)}),
        "fsdp_modules": len(plan.data_parallel_modules),
        "installed": [attrs.asdict(r) for r in plan.installed_comm_hooks],
        "seen": {k: list(v) for k, v in SEEN.items()},
        "summary": counter.summary(mesh, dist.get_rank()),
        "applied": [(s.stage, s.plugin, s.detail) for s in plan.applied],
    }


def hsdp_fsdp2_native() -> ParallelPlan:
    return (ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2))
            .use(HSDP()).use(FSDP2()).use(MetaInit(seed=5)))


def hsdp_alone_native() -> ParallelPlan:
    return ParallelPlan(MeshSpec(dp_replicate=4)).use(HSDP()).use(MetaInit(seed=5))


def replicate_hook_order() -> dict[str, Any]:
    """torch's replicate with ``set_all_reduce_hook`` (2 ranks): what the hook receives,
    and the bytes of a step with and without a hook that all-reduces again."""
    import torch
    import torch.distributed as dist
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh

    from composer_par.testing.comm_count import CommCounter

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    seen: list[Any] = []

    def run(hooked: bool) -> int:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8, bias=False)
        replicate(model, mesh=mesh)
        if hooked:
            def hook(output: Any) -> None:
                seen.append(output.clone())
                dist.all_reduce(output, group=mesh.get_group())
                output.div_(mesh.size())
            model.set_all_reduce_hook(hook)
        torch.manual_seed(10 + dist.get_rank())
        with CommCounter() as counter:
            model(torch.randn(4, 8)).sum().backward()
        return sum(c.payload_bytes for c in counter.calls if c.kind == "all_reduce")

    native = run(False)
    with_hook = run(True)
    # The local gradient differs between ranks; what the hook saw must not.
    gathered = [torch.empty_like(seen[0]) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, seen[0])
    return {"bytes_native": native, "bytes_with_hook": with_hook,
            "hook_saw_reduced": all(torch.equal(gathered[0], g) for g in gathered)}


def hsdp_alone_x_tp_hooked() -> ParallelPlan:
    from composer_par import TP

    return (ParallelPlan(MeshSpec(dp_replicate=2, tp=2)).use(HSDP()).use(TP())
            .use(PlainAllReduce()).use(MetaInit(seed=5)))
