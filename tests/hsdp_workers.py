"""Rank-side functions of tests/test_hsdp.py (imported by name in the rank processes)."""

from __future__ import annotations

from typing import Any


def _linear(seed: int = 0) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 2, bias=False))


def _grads(model: Any) -> list[Any]:
    from torch.distributed.tensor import DTensor

    return [
        (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for p in model.parameters()
    ]


def _local_grads_sum(seed: int, world: int) -> list[Any]:
    """The gradients of every rank's micro-batch, summed."""
    import torch

    model = _linear(seed)
    for rank in range(world):
        torch.manual_seed(100 + rank)
        model(torch.randn(3, 4)).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def divide_factor_paths() -> dict[str, Any]:
    """What FSDP2 does with a gradient divide factor on gloo, path by path (2 ranks).

    Returns, per case, either ``"ok"`` with the max error against the expected gradient
    (the sum of all ranks' gradients divided by the factor) or the error text. The factor
    is 4.0: neither the shard size (which FSDP2 would turn into AVG) nor 1 (which hides a
    double division).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from composer_par.plugin.fsdp_state import set_gradient_divide_factor

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    factor = 4.0
    expected = [g / factor for g in _local_grads_sum(0, world)]
    out: dict[str, Any] = {}
    cases = {
        "fully_shard, torch setter only": (fully_shard, "torch"),
        "fully_shard, set_gradient_divide_factor(sum_only)": (fully_shard, "ours"),
        "replicate, torch setter only": (replicate, "torch"),
        "replicate, set_gradient_divide_factor(sum_only)": (replicate, "ours"),
        "replicate, forced SUM": (replicate, "forced"),
    }
    for name, (apply, how) in cases.items():
        model = _linear(0)
        apply(model[0], mesh=mesh)
        apply(model, mesh=mesh)
        modules = [model[0], model]
        if how == "torch":
            for module in modules:
                module.set_gradient_divide_factor(factor)
        elif how == "ours":
            set_gradient_divide_factor(modules, factor, sum_only=True)
        else:
            for module in modules:
                module.set_gradient_divide_factor(factor)
                module.set_force_sum_reduction_for_comms(True)
        torch.manual_seed(100 + rank)
        try:
            model(torch.randn(3, 4)).sum().backward()
            got = _grads(model)
            diffs = [float((g - e).abs().max()) for g, e in zip(got, expected, strict=True)]
            out[name] = ("ok", max(diffs))
        except Exception as exc:  # the outcome being measured
            out[name] = ("error", f"{type(exc).__name__}: {exc}")
        dist.barrier()
    return out


def setters_are_per_module() -> dict[str, Any]:
    """FSDP2's divide-factor setter on the root does not reach the blocks' groups."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    model = _linear(0)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_gradient_divide_factor(3.0)

    def factors(module: Any) -> list[Any]:
        return [g.gradient_divide_factor for g in module._get_fsdp_state()._fsdp_param_groups]

    return {"root": factors(model), "block": factors(model[0])}


def cpu_offload_pinned() -> str:
    """What CPUOffloadPolicy(pin_memory=True) does on a machine without an accelerator."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    model = _linear(0)
    try:
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=True))
        model(torch.randn(3, 4)).sum().backward()
    except Exception as exc:  # the outcome being measured
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _layout(plan: Any) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor

    from composer_par.testing.tasks import llama

    with torch.device("meta"):
        model = llama.build()
    names = [n for n, _ in model.named_parameters()]
    model = plan.apply(model)
    params = dict(model.named_parameters())
    paths = {id(m): n or "<root>" for n, m in model.named_modules()}
    modules = plan.data_parallel_modules
    groups = [g for m in modules for g in m._get_fsdp_state()._fsdp_param_groups]
    # One training step, so the gradient reductions really run.
    task_batch = llama.batch(0)
    index, count = plan.data_shard()
    llama.loss(model, task_batch.chunk(count)[index]).backward()
    return {
        "names_unchanged": list(params) == names,
        "placements": {str(tuple(p.placements)) for p in params.values()
                       if isinstance(p, DTensor)} | ({"plain"} if any(
                           not isinstance(p, DTensor) for p in params.values()) else set()),
        "mesh_dims": {tuple(p.device_mesh.mesh_dim_names) for p in params.values()},
        "fsdp_modules": [paths[id(m)] for m in modules],
        "module_kind": {type(m).__mro__[1].__name__ for m in modules},
        "divide_factors": {g.gradient_divide_factor for g in groups},
        "force_sum": {g.force_sum_reduction_for_comms for g in groups},
    }


def layouts() -> dict[str, Any]:
    """What HSDP x FSDP2 (2 x 2) and HSDP alone (4) build on 4 ranks."""
    from composer_par import FSDP2, HSDP, ActivationCheckpoint, MeshSpec, MetaInit, ParallelPlan

    two_d = (ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2))
             .use(HSDP(gradient_divide_factor=4)).use(FSDP2())
             .use(ActivationCheckpoint()).use(MetaInit(seed=1)))
    alone = (ParallelPlan(MeshSpec(dp_replicate=4))
             .use(HSDP(gradient_divide_factor=4)).use(MetaInit(seed=1)))
    return {"hsdp_fsdp2": _layout(two_d), "hsdp_alone": _layout(alone)}
