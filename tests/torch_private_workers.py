"""Rank-side functions for tests/test_torch_private.py (importable by rank processes)."""

from __future__ import annotations

from typing import Any


def live_attributes() -> dict[str, bool]:
    """For each attribute symbol of the catalog, whether the object torch makes for it has
    it: FSDP2 and replicate modules, a DTensor, meshes, a gloo group, a multi-stage
    schedule, an operator, a module and a tensor, all real, on 2 gloo ranks."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from composer_par.plugin import torch_private

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    sharded = fully_shard(nn.Linear(4, 4), mesh=mesh)
    state = sharded._get_fsdp_state()
    group = state._fsdp_param_groups[0]
    replicated = torch_private.replicate()(nn.Linear(4, 4), mesh=mesh)
    replicate_group = replicated._get_fsdp_state()._fsdp_param_groups[0]
    tensor = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    square = init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b"))

    class Stand:  # what a multi-stage schedule reads of a stage when it is built
        def __init__(self, index: int) -> None:
            self.stage_index, self.num_stages = index, 4
            self.group_size, self.group_rank = 2, 0
            self.is_first, self.is_last = index == 0, index == 3
            self.submod = nn.Identity()

    schedule = get_schedule_class("Interleaved1F1B")([Stand(0), Stand(2)], 4)
    action = next(a for a in schedule.pipeline_order[0] if a is not None)
    compiled = torch.compile(nn.Linear(2, 2), backend="eager")
    in_place = nn.Linear(2, 2)
    in_place.compile(backend="eager")
    objects: dict[str, Any] = {
        "FSDPModule": sharded, "FSDPState": state, "FSDPParamGroup": group,
        "FSDPParam": group.fsdp_params[0], "DDPMeshInfo": replicate_group.mesh_info,
        "DTensor": tensor, "DeviceMesh": square,
        "ProcessGroup": dist.distributed_c10d._get_default_group(),
        "Backend.Options": dist.distributed_c10d._get_default_group()._get_backend(
            torch.device("cpu")).options,
        "PipelineScheduleMulti": schedule, "_PipelineScheduleRuntime": schedule,
        "_Action": action,
        "Module": in_place, "OptimizedModule": compiled,
        "CheckpointWrapper": checkpoint_wrapper(nn.Linear(2, 2)),
        "OpOverload": torch.ops.aten.add.Tensor, "Tensor": torch.ones(2),
    }
    found = {}
    for symbol in torch_private.SYMBOLS:
        if symbol.importable:
            continue
        owner, _, name = symbol.symbol.rpartition(".")
        found[symbol.symbol] = hasattr(objects[owner], name)
    assert isinstance(tensor, DTensor)
    return found


def accessors() -> dict[str, Any]:
    """What the accessors of composer_par.plugin.torch_private return on real objects."""
    from datetime import timedelta

    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from composer_par.plugin import torch_private

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    sharded = fully_shard(nn.Linear(4, 3), mesh=mesh)
    sharded(torch.ones(1, 4)).sum().backward()  # the lazy init names the parameters
    groups = torch_private.fsdp_param_groups(sharded)
    replicated = torch_private.replicate()(nn.Linear(4, 4), mesh=mesh)
    tensor = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    square = init_device_mesh("cpu", (2, 1), mesh_dim_names=("a", "b"))
    flat = torch_private.flatten_mesh(square["a", "b"], "a_b")
    joined = torch_private.concatenate_meshes([square["b"], flat])
    # As composer_par's MeshSpec builds a dim with the plan's timeout.
    waiting = init_device_mesh("cpu", (2,), mesh_dim_names=("w",), backend_override={
        "w": torch_private.gloo_options(timedelta(seconds=7))})
    timeout = torch_private.group_timeout(waiting.get_group("w"), "cpu")
    return {
        "layout": [(fqn, numel, tuple(size), tuple(stride))
                   for fqn, numel, size, stride in torch_private.reduce_output_layout(groups[0])],
        "reduce_scatters": torch_private.reduce_scatters(groups[0]),
        "divide_factor": torch_private.divide_factor(groups[0]),
        "replicated": torch_private.is_replicated(replicated),
        "sharded_replicated": torch_private.is_replicated(sharded),
        "local": torch_private.local_tensor(tensor).tolist(),
        "offset": torch_private.local_shape_and_offset(tensor.shape, mesh, tensor.placements),
        "flat": (flat.mesh_dim_names, flat.size()),
        "joined": joined.mesh_dim_names,
        "timeout": timeout.total_seconds() if timeout else None,
        "default_store": torch_private.default_store() is not None,
    }
