"""plan.device_mesh(): one DeviceMesh per plan, built on first use and kept, so a trainer
that needs the mesh before apply and the plan's apply share one set of process groups.

One process, torch's fake process group (the ``fake_world`` fixture of composer_par's
pytest plugin): building a mesh needs no peers there.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

pytest.importorskip("torch")

from composer_par import FSDP2, MeshError, MeshSpec, ParallelPlan


def test_built_once_kept_and_checked(fake_world: Callable[..., None]) -> None:
    fake_world(4)
    # One dim over every rank: torch reuses the default group (the fake group takes no
    # per-group timeout, which a sub-dim would get).
    plan = ParallelPlan(MeshSpec(dp_shard=-1)).use(FSDP2())
    mesh = plan.device_mesh(4, "cpu")
    assert mesh.mesh_dim_names == ("dp_shard",) and tuple(mesh.shape) == (4,)
    assert plan.device_mesh() is mesh and plan.device_mesh(4) is mesh
    with pytest.raises(MeshError, match="has 4 ranks but 8 were asked for"):
        plan.device_mesh(8)


def test_a_plan_given_a_device_mesh_hands_it_back(fake_world: Callable[..., None]) -> None:
    fake_world(4)
    from torch.distributed.device_mesh import init_device_mesh

    live = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    assert ParallelPlan(live).device_mesh(4) is live


def test_apply_shards_over_the_kept_mesh(fake_world: Callable[..., None]) -> None:
    fake_world(4)
    import torch.nn as nn

    plan = ParallelPlan(MeshSpec(dp_shard=4)).use(FSDP2())
    mesh = plan.device_mesh()
    model = plan.apply(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    weight = model[0].weight
    assert weight.device_mesh is mesh  # type: ignore[attr-defined]
