"""The estimate of a plan whose data-parallel plugin shards over the dims it folds in, with
its own dim of size 1 (``dp_shard = 1`` beside ``cp`` or ``ep``), against a real dry run's
per-rank parameter counts: FSDP2 shards over ``dp_shard x cp`` and ``dp_shard x ep``
whatever ``dp_shard``'s size, so each rank holds its share, not the whole model."""

from __future__ import annotations

from typing import Any

import pytest

from composer_par import ParallelPlan, Registry
from composer_par.estimate import ModelShape, Workload, estimate_plan
from composer_par.tools.dryrun import dry_run

INSTALLED = set(Registry().names())
WORLD = 8


def _plan(mesh: str, *plugins: str) -> str:
    return (f"[mesh]\n{mesh}\n" + "".join(f'[[plugins]]\nname = "{p}"\n' for p in plugins)
            + '[[plugins]]\nname = "meta_init"\nseed = 1\n')


def _shape(factory: str) -> ModelShape:
    import torch

    from composer_par.tools.dryrun import resolve_factory

    with torch.device("meta"):
        return ModelShape.from_module(resolve_factory(factory)())


def _held(text: str, factory: str) -> list[int]:
    """Each rank's parameter elements after a real apply (torch's fake process group)."""
    result = dry_run(ParallelPlan.from_toml(text), factory, world_size=WORLD,
                     ranks=range(WORLD))
    assert all(r.failure is None for r in result.ranks), [r.failure for r in result.ranks]
    return [r.local_numel for r in result.ranks]


def _estimate(text: str, factory: str) -> Any:
    return estimate_plan(ParallelPlan.from_toml(text), _shape(factory), Workload(seq=16),
                         world_size=WORLD)


@pytest.mark.skipif("cp" not in INSTALLED, reason="the cp plugin is not installed")
def test_fsdp2_at_dp_shard_1_shards_over_cp_as_the_dry_run_holds() -> None:
    """FSDP2 over dp_shard(1) x cp(8): a rank holds an eighth of the model (the estimate
    once counted it whole, with no FSDP2 collective), and gathers and reduce-scatters
    over the eight cp ranks."""
    factory = "tests.dryrun_models:small_llama"
    text = _plan("dp_shard = 1\ncp = 8", "fsdp2", "cp")
    held = _held(text, factory)
    est = _estimate(text, factory)
    assert held == [est.memory.local_params] * WORLD
    assert est.memory.local_params * 7 < est.model.params  # not the whole model
    dp = next(t for t in est.traffic if t.dim.name == "dp_shard")
    assert {c.group_size for c in dp.collectives} == {WORLD}
    assert {c.kind for c in dp.collectives} == {"all_gather", "reduce_scatter"}


@pytest.mark.skipif("ep" not in INSTALLED, reason="the ep plugin is not installed")
def test_fsdp2_at_dp_shard_1_shards_the_dense_parameters_over_ep_as_the_dry_run_holds(
) -> None:
    """FSDP2 over dp_shard(1) x ep(8) with 8 experts a block (Mixtral's count): each rank
    holds one expert of each block whole and an eighth of the dense parameters (the
    estimate once counted the dense parameters whole)."""
    factory = "tests.dryrun_models:small_moe"
    text = _plan("dp_shard = 1\nep = 8", "fsdp2", "ep")
    held = _held(text, factory)
    est = _estimate(text, factory)
    assert held == [est.memory.local_params] * WORLD
    experts = est.section("experts")
    assert (experts.experts_per_rank, experts.experts_shard) == (1, 1)
    shape = est.model
    dense = shape.params - shape.experts_params
    assert experts.dense_params == pytest.approx(dense / WORLD, rel=0.02)  # FSDP2 pads rows
    # the dense groups' all-gathers run over the eight ep ranks; the experts' over none
    dp = next(t for t in est.traffic if t.dim.name == "dp_shard")
    assert {c.group_size for c in dp.collectives} == {WORLD}
    assert not any(c.why.startswith("experts:") for c in dp.collectives)
