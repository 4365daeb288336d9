"""The core's hooks for plugins that span launches and decide steps, with a toy plugin:
``composer_par_launch_dims`` (the plan lays out one launch), ``composer_par_step_begin``
and ``composer_par_step_commit`` (``plan.training_step`` calls them)."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest
import torch
import torch.nn as nn

from composer_par import HSDP, MeshSpec, MetaInit, ParallelPlan, Topology
from composer_par.mesh import MeshError
from composer_par.plugin import LaunchDim, Plugin, hookimpl

CALLS: list[str] = []


@attrs.frozen
class Spans(Plugin):
    """Says dp_replicate spans launches (this one at ``index``), and counts the step
    hooks, discarding the steps listed in ``discard``."""

    name: ClassVar[str] = "spans"
    index: int | None = None
    discard: tuple[int, ...] = ()

    @hookimpl
    def composer_par_launch_dims(self) -> list[LaunchDim]:
        return [LaunchDim("dp_replicate", self.index)]

    @hookimpl
    def composer_par_step_begin(self, model: nn.Module) -> None:
        assert isinstance(model, nn.Module)
        CALLS.append("begin")

    @hookimpl
    def composer_par_step_commit(self, model: nn.Module, optimizer: Any) -> bool:
        assert isinstance(optimizer, torch.optim.Optimizer)
        CALLS.append("commit")
        return CALLS.count("commit") - 1 not in self.discard


def _plan(**options: Any) -> ParallelPlan:
    return (ParallelPlan(MeshSpec(dp_replicate=3, dp_shard=2))
            .use(HSDP()).use(Spans(**options)))


def test_one_launch_lays_out_its_mesh_with_the_dim_at_size_1() -> None:
    plan = _plan(index=2)
    assert [d.dim for d in plan.launch_dims()] == ["dp_replicate"]
    assert plan.launch_mesh() == MeshSpec(dp_replicate=1, dp_shard=2)
    assert plan.resolved_mesh(2) == MeshSpec(dp_replicate=3, dp_shard=2)
    # A launch of 2 ranks fits; 6 (the whole job) is CP101, naming the spanning dim.
    assert plan.validate(world_size=2).codes() == ["CP201"]  # dp_shard has no owner
    found = {f.code: f.message for f in plan.validate(world_size=6).findings}
    assert "CP101" in found and "dp_replicate spans separate launches" in found["CP101"]


def test_the_data_shards_count_the_launches() -> None:
    plan = _plan(index=2)
    # HSDP's dim spans 3 launches; dp_shard is no data-parallel dim here (no owner).
    assert [plan.data_shard(rank, 2) for rank in range(2)] == [(2, 3), (2, 3)]
    with pytest.raises(MeshError, match="spans launches"):
        _plan(index=None).data_shard(0, 2)


def test_the_whole_mesh_and_topology_of_the_job() -> None:
    plan = ParallelPlan(MeshSpec(dp_replicate=3, dp_shard=2),
                        topology=Topology(nodes=1, devices_per_node=2))
    plan.use(HSDP()).use(Spans(index=0))
    assert plan.job_topology(plan.resolved_mesh(2)) == Topology(nodes=3, devices_per_node=2)
    explained = plan.explain(world_size=2)
    assert explained.groups["dp_replicate"] == [(0, 2, 4), (1, 3, 5)]
    assert explained.crossing == {"dp_replicate": True, "dp_shard": False}
    with pytest.raises(MeshError, match="cannot be inferred"):
        ParallelPlan(MeshSpec(dp_replicate=-1, dp_shard=2)).use(Spans()).resolved_mesh(2)


def _training(plan: ParallelPlan) -> tuple[nn.Module, Any, torch.optim.Optimizer]:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model = plan.apply(model)
    step = plan.training_step(model, nn.functional.mse_loss)
    return model, step, torch.optim.SGD(model.parameters(), lr=0.1)


def test_training_step_calls_begin_once_per_step_and_commit_decides() -> None:
    CALLS.clear()
    plan = ParallelPlan(MeshSpec()).use(Spans(discard=(1,))).use(MetaInit(seed=0))
    model, step, optimizer = _training(plan)
    x, y = torch.ones(2, 4), torch.zeros(2, 1)
    before = [p.detach().clone() for p in model.parameters()]
    step.step(x, y)
    assert step.optimizer_step(optimizer) is True
    after_first = [p.detach().clone() for p in model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(before, after_first, strict=True))
    # begin() before the batch is chosen: step() does not begin again.
    step.begin()
    step.step(x, y)
    assert step.optimizer_step(optimizer) is False  # discarded: nothing moved
    assert all(torch.equal(a, p) for a, p in zip(after_first, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())  # zeroed as after a step
    assert CALLS == ["begin", "commit", "begin", "commit"]


def test_a_plan_without_such_plugins_always_applies() -> None:
    model, step, optimizer = _training(ParallelPlan(MeshSpec()).use(MetaInit(seed=0)))
    step.step(torch.ones(2, 4), torch.zeros(2, 1))
    assert step.optimizer_step(optimizer) is True
    assert all(p.grad is None for p in model.parameters())
