"""Comm hooks (``composer_par_comm_hooks``): a plugin customizes the collectives of one dim.

Static tests check the rules (CP218 no data-parallel owner, CP219 two hooks on one dim,
CP220 a collective the dim does not run) and what explain says. Distributed tests (gloo,
4 ranks, 10 steps) check that a plain hook trains at fp32 parity with a single process,
that every FSDP module goes through it, and that the replicate dim carries the same
bytes as without the hook (none wasted), for HSDP with FSDP2 and HSDP alone.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest

from composer_par import FSDP2, HSDP, TP, MeshSpec, MetaInit, ParallelPlan
from composer_par.plugin import Claim, Plugin, Role, hookimpl
from composer_par.plugin.comm import CommHook
from composer_par.testing.distributed import run_ranks
from composer_par.testing.parity import ParityCase
from tests.comm_hook_workers import PlainAllReduce, PlainShardComms

MLP = "composer_par.testing.tasks:mlp"
LLAMA = "composer_par.testing.tasks:llama"
WORKERS = "tests.comm_hook_workers"


def codes(plan: ParallelPlan, world_size: int | None = None) -> list[str]:
    return plan.validate(world_size=world_size).codes()


def hsdp_plan(*extra: Plugin, mesh: MeshSpec | None = None) -> ParallelPlan:
    plan = ParallelPlan(mesh or MeshSpec(dp_replicate=2, dp_shard=2)).use(HSDP()).use(FSDP2())
    for plugin in extra:
        plan.use(plugin)
    return plan


# -- validation ------------------------------------------------------------------------------


def test_a_hook_on_the_replicate_dim_is_valid_and_fsdp2_shards_over_its_own_dim_only() -> None:
    plan = hsdp_plan(PlainAllReduce())
    assert codes(plan, 4) == []
    hooks = plan.validate(world_size=4)
    assert hooks.ok
    text = plan.explain(world_size=4).format()
    assert "over mesh (dp_shard)" in text, text  # not (dp_replicate, dp_shard)
    # The same hook with FSDP2's own dim: custom all-gather / reduce-scatter classes.
    assert codes(hsdp_plan(PlainAllReduce(), PlainShardComms()), 4) == []


def test_cp218_hook_on_a_dim_the_mesh_lacks() -> None:
    report = hsdp_plan(PlainAllReduce(dim="dp_replicat")).validate(world_size=4)
    assert report.codes() == ["CP218"]
    (finding,) = report.errors
    assert "did you mean 'dp_replicate'" in finding.message
    assert finding.plugin == "plain_all_reduce"


def test_cp218_hook_on_a_dim_no_data_parallel_plugin_owns() -> None:
    # dp_replicate exists (size 1) but nothing replicates over it.
    plan = ParallelPlan(MeshSpec(dp_replicate=1, dp_shard=4)).use(FSDP2()).use(PlainAllReduce())
    report = plan.validate(world_size=4)
    assert report.codes() == ["CP218"]
    assert "no plugin claims it" in report.errors[0].message
    # A model-parallel dim: TP's activations move there, no gradient reduction runs.
    plan = (ParallelPlan(MeshSpec(dp_replicate=2, tp=2)).use(HSDP()).use(TP())
            .use(PlainAllReduce(dim="tp")))
    report = plan.validate(world_size=4)
    assert "CP218" in report.codes()
    assert "tp claims it for model_parallel" in report.errors[0].message


@attrs.frozen
class OtherAllReduce(PlainAllReduce):
    name: ClassVar[str] = "other_all_reduce"


def test_cp219_two_hooks_on_one_dim() -> None:
    report = hsdp_plan(PlainAllReduce(), OtherAllReduce()).validate(world_size=4)
    assert report.codes() == ["CP219"]
    (finding,) = report.errors
    assert "plain_all_reduce and other_all_reduce" in finding.message
    assert finding.plugin == "other_all_reduce"


@attrs.frozen
class EmptyHook(Plugin):
    name: ClassVar[str] = "empty_hook"

    @hookimpl
    def composer_par_comm_hooks(self) -> list[CommHook]:
        return [CommHook("dp_replicate")]


def test_cp220_a_collective_the_dim_does_not_run() -> None:
    # FSDP2 reduce-scatters over dp_shard: there is no all-reduce there to customize.
    report = hsdp_plan(PlainAllReduce(dim="dp_shard")).validate(world_size=4)
    assert report.codes() == ["CP220"]
    assert "all_reduce on mesh dim 'dp_shard', which fsdp2 shards over" in (
        report.errors[0].message)
    # HSDP's replicate dim runs no all-gather.
    report = hsdp_plan(PlainShardComms(dim="dp_replicate")).validate(world_size=4)
    assert report.codes() == ["CP220"]
    assert "all_gather, reduce_scatter" in report.errors[0].message
    # A hook that customizes nothing.
    assert hsdp_plan(EmptyHook()).validate(world_size=4).codes() == ["CP220"]


@attrs.frozen
class IgnoresHooks(Plugin):
    """A data-parallel plugin that owns dp_replicate and never consults comm hooks."""

    name: ClassVar[str] = "ignores_hooks"
    provides: ClassVar[frozenset[str]] = frozenset({"data_parallel"})

    def claims(self) -> tuple[Claim, ...]:
        return (Claim("dp_replicate", Role.REPLICATE),)

    @hookimpl
    def composer_par_data_parallel(self) -> str:
        return "nothing"


def test_apply_refuses_a_hook_no_owner_installed() -> None:
    import torch

    from composer_par.testing.tasks import mlp

    plan = (ParallelPlan(MeshSpec(dp_replicate=1)).use(IgnoresHooks()).use(PlainAllReduce())
            .use(MetaInit(seed=1)))
    with torch.device("meta"):
        model = mlp.build()
    with pytest.raises(RuntimeError, match="was not installed: the plugin that owns the dim"):
        plan.apply(model)


def test_hooks_facade_names_the_plugin_of_each_hook() -> None:

    plan = hsdp_plan(PlainAllReduce(), PlainShardComms())
    hooks = plan.hooks.comm_hooks()
    assert [(h.dim, h.plugin, h.collectives()) for h in hooks] == [
        ("dp_replicate", "plain_all_reduce", ("all_reduce",)),
        ("dp_shard", "plain_shard_comms", ("all_gather", "reduce_scatter")),
    ]


# -- on real ranks ---------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("plan", "task"), [
    ("hsdp_fsdp2_hooked", MLP),
    ("hsdp_fsdp2_hooked_divide_factor", MLP),
    ("hsdp_alone_hooked", MLP),
    ("hsdp_alone_hooked_divide_factor", MLP),
    ("hsdp_fsdp2_all_hooked", MLP),
    # Replicate-only x TP: TP's DTensors become 2-D (dp_replicate, tp) under replicate;
    # the hook reduces their local shards over dp_replicate.
    ("hsdp_alone_x_tp_hooked", LLAMA),
])
def test_plain_hooks_train_at_parity(plan: str, task: str, parity: Any) -> None:
    result = parity.check(ParityCase(task=task, plan=f"{WORKERS}:{plan}", world_size=4,
                                     lr=0.1 if task == MLP else 1.0))
    result.assert_close()
    assert result.losses[-1] < result.losses[0], result.losses


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_hooks_reach_every_fsdp_module_and_waste_no_bytes() -> None:
    def layout(name: str) -> dict[str, Any]:
        return run_ranks(f"{WORKERS}:hooked_layout", 4, args=(name,), timeout=150)[0]

    with_fsdp2, alone = layout("hsdp_fsdp2_all_hooked"), layout("hsdp_alone_hooked")
    native_fsdp2, native_alone = layout("hsdp_fsdp2_native"), layout("hsdp_alone_native")
    # HSDP x FSDP2: a 1-D fully_shard mesh over dp_shard; the hook reduces over dp_replicate.
    assert with_fsdp2["mesh_dims"] == [("dp_shard",)]
    assert native_fsdp2["mesh_dims"] == [("dp_replicate", "dp_shard")]
    # Every FSDP module (4 blocks + root) got every hook (FSDP2's setters are per module).
    assert with_fsdp2["fsdp_modules"] == 5
    assert {(r["dim"], r["collective"], r["modules"], r["owner"])
            for r in with_fsdp2["installed"]} == {
        ("dp_replicate", "all_reduce", 5, "fsdp2"),
        ("dp_shard", "all_gather", 5, "fsdp2"),
        ("dp_shard", "reduce_scatter", 5, "fsdp2"),
    }
    seen = with_fsdp2["seen"]
    assert sorted(k for k, _, _ in seen["all_reduce"]) == ["0", "1", "2", "3", "<root>"]
    assert {d for _, d, _ in seen["all_reduce"]} == {2.0}  # FSDP2 averaged over dp_shard
    assert ["0.0.weight", "0.0.bias"] in [n for _, _, n in seen["all_reduce"]]
    # The custom comm classes ran every all-gather and reduce-scatter FSDP2 issued.
    native = native_fsdp2["summary"]["dp_shard"]
    assert len(seen["all_gather"]) == native["all_gather"]["calls"]
    assert len(seen["reduce_scatter"]) == native["reduce_scatter"]["calls"]
    # The same bytes over dp_replicate as the native 2-D mesh: nothing is sent twice.
    assert with_fsdp2["summary"]["dp_replicate"] == native_fsdp2["summary"]["dp_replicate"]

    # HSDP alone: parameters keep torch's replicate layout; its own all-reduce moves
    # nothing (a 1-rank group: "self"), and dp_replicate carries exactly the native bytes.
    assert alone["mesh_dims"] == native_alone["mesh_dims"] == [("dp_replicate",)]
    assert alone["placements"] == ["(Replicate(),)"]
    assert [(r["dim"], r["modules"], r["owner"]) for r in alone["installed"]] == [
        ("dp_replicate", 5, "hsdp")]
    assert {d for _, d, _ in alone["seen"]["all_reduce"]} == {4.0}
    assert alone["summary"]["dp_replicate"] == native_alone["summary"]["dp_replicate"]
    assert set(alone["summary"]) == {"dp_replicate", "self"}
    assert "self" not in native_alone["summary"]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_trap_replicate_runs_its_all_reduce_hook_after_its_own_all_reduce() -> None:
    """Why replicate-only needs more than ``set_all_reduce_hook``: torch's replicate
    all-reduces first and hands the hook the reduced gradient, so a compressing hook would
    send its bytes on top of the full all-reduce (measured: twice the native bytes)."""
    facts = run_ranks(f"{WORKERS}:replicate_hook_order", 2, timeout=90)[0]
    assert facts["hook_saw_reduced"] is True
    assert facts["bytes_with_hook"] == 2 * facts["bytes_native"]
