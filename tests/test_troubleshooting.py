"""The classic FSDP2 pitfalls, and what composer_par does about each (docs/troubleshooting.md).

Each test is named after the pitfall it demonstrates.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from composer_par import FSDP2, HSDP, MeshSpec, MetaInit, ParallelPlan, PlanError, Topology
from composer_par.testing.distributed import run_ranks
from composer_par.testing.tasks import llama
from tests.troubleshooting_workers import load_counting_bytes, sharded_then_materialized


def meta_llama() -> torch.nn.Module:
    with torch.device("meta"):
        return llama.build()


def test_forgot_to_empty() -> None:
    # A meta-built model with nothing to materialize it would fail at the first forward
    # ("Tensor on device meta is not on the expected device"); the plan refuses first.
    with pytest.raises(PlanError) as err:
        ParallelPlan(MeshSpec()).apply(meta_llama())
    assert err.value.report.codes() == ["CP405"]
    assert "MetaInit" in str(err.value)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_to_empty_before_fully_shard_and_uninitialized_weights_and_local_shapes() -> None:
    # to_empty before fully_shard allocates the full model on every rank; to_empty alone
    # leaves garbage. The plan shards first, then materializes and initializes.
    rank0, _ = run_ranks(sharded_then_materialized, 2, args=(5,), timeout=90)
    for name, (global_shape, local_shape) in rank0["shapes"].items():
        # param.shape is the global shape; param.to_local().shape what this rank holds.
        assert local_shape[0] == -(-global_shape[0] // 2), name
        assert local_shape[1:] == global_shape[1:], name
    assert rank0["on_meta"] == []
    reference = ParallelPlan(MeshSpec()).use(MetaInit(seed=5)).apply(meta_llama())
    for name, param in reference.named_parameters():
        assert torch.equal(rank0["full"][name], param.detach()), name


def test_reversed_hsdp_mesh() -> None:
    plan = ParallelPlan(MeshSpec(dp_shard=8, dp_replicate=4),
                        topology=Topology(nodes=4, devices_per_node=8))
    report = plan.use(HSDP()).use(FSDP2()).use(MetaInit()).validate()
    (finding,) = report.errors
    assert finding.code == "CP301"
    assert "MeshSpec(dp_replicate=4, dp_shard=8)" in finding.fix


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_full_torch_load_on_every_rank(tmp_path: Path) -> None:
    # Each rank reads only the bytes of its own shards, not the whole file.
    from safetensors.torch import save_file

    model = ParallelPlan(MeshSpec()).use(MetaInit(seed=0)).apply(meta_llama())
    weights = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    path = tmp_path / "model.safetensors"
    save_file(weights, str(path))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    read = run_ranks(load_counting_bytes, 2, args=(str(path),), timeout=90)
    for rank_bytes in read:
        assert 0 < rank_bytes <= total * 0.5 + 4096, (rank_bytes, total)
    assert sum(read) >= total  # together they read every byte


def test_changing_parameters_after_sharding() -> None:
    # Swapping or re-sharding parameters after a plan ran bypasses FSDP's bookkeeping.
    # Module swaps belong in the convert stage (before any sharding); applying a plan to
    # a model whose parameters are already DTensors is refused.
    from composer_par.testing.parity import full_parameters

    model = ParallelPlan(MeshSpec()).use(MetaInit(seed=0)).apply(meta_llama())
    assert full_parameters(model)  # a plain model: fine
    fake = _with_a_dtensor_parameter(model)
    report = ParallelPlan(MeshSpec()).validate(fake)
    assert "CP402" in report.codes()


def _with_a_dtensor_parameter(model: torch.nn.Module) -> torch.nn.Module:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = model.output.weight
        model.output.weight = torch.nn.Parameter(DTensor.from_local(weight.detach(), mesh))
    finally:
        dist.destroy_process_group()
    return model
