"""Rank-side functions of tests/test_activation_checkpoint.py and tests/test_compile.py."""

from __future__ import annotations

from typing import Any


def fsdp_groups(checkpoint_mode: str | None, compile_backend: str | None = None) -> dict[str, Any]:
    """Which modules FSDP2 groups, and which parameters each group holds, after the
    earlier stages (activation checkpointing, compile) ran."""
    import torch

    from composer_par import FSDP2, ActivationCheckpoint, Compile, MeshSpec, MetaInit, ParallelPlan
    from composer_par.testing.tasks import llama

    plan = ParallelPlan(MeshSpec(dp_shard=torch.distributed.get_world_size())).use(FSDP2())
    if checkpoint_mode:
        plan.use(ActivationCheckpoint(mode=checkpoint_mode))
    if compile_backend:
        plan.use(Compile(backend=compile_backend))
    plan.use(MetaInit(seed=3))
    with torch.device("meta"):
        model = llama.build()
    layers = list(model.layers)
    model = plan.apply(model)
    path = {id(m): n or "<root>" for n, m in model.named_modules()}
    groups = {}
    for module in plan.data_parallel_modules:
        names = []
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                info = fsdp_param._module_info
                owner = path[id(info.module)]
                names.append(f"{owner}.{info.param_name}".removeprefix("<root>."))
        groups[path[id(module)]] = sorted(names)
    index, count = plan.data_shard()
    loss = llama.loss(model, llama.batch(0).chunk(count)[index])
    loss.backward()
    return {
        "groups": groups,
        "expected_groups": _expected_groups(),
        "same_block_objects": all(a is b for a, b in zip(layers, model.layers, strict=True)),
        "checkpointed": [type(b).__mro__[0].__name__ for b in model.layers
                         if "_composer_par_checkpoint" in b.__dict__],
        "names": [n for n, _ in model.named_parameters()],
        "state_dict": list(model.state_dict()),
        "loss": float(loss.detach()),
    }


def _expected_groups() -> dict[str, list[str]]:
    """FSDP2's grouping by construction: each block's parameters, the rest at the root."""
    import torch

    from composer_par.testing.tasks import llama

    with torch.device("meta"):
        model = llama.build()
    groups: dict[str, list[str]] = {f"layers.{i}": [] for i in range(len(model.layers))}
    groups["<root>"] = []
    for name, _ in model.named_parameters():
        owner = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "<root>"
        groups[owner].append(name)
    return {k: sorted(v) for k, v in groups.items()}
