"""HSDP: with FSDP2 (one 2-D mesh, replicate outer) and alone (DDP-style replication).

Parity runs train 10 steps on real gloo ranks against a single-process reference (same
MetaInit weights, same global batch) at fp32 tolerance; the static tests check HSDP's
rule (CP216), its composition hook, and what ``plan.data_shard()`` tells a
``DistributedSampler``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest

from composer_par import (
    FSDP2,
    HSDP,
    ActivationCheckpoint,
    MeshSpec,
    MetaInit,
    ParallelPlan,
    PlanFileError,
    Topology,
)
from composer_par.findings import Severity
from composer_par.plugin import Claim, Plugin, Role
from composer_par.testing.distributed import run_ranks
from composer_par.testing.parity import ParityCase, assert_every_rank, check_parity

LLAMA = "composer_par.testing.tasks:llama"
ENCODER = "composer_par.testing.tasks:encoder"
MLP = "composer_par.testing.tasks:mlp"


def plan_toml(mesh: str, *plugins: str) -> str:
    tables = "\n".join(f"[[plugins]]\n{p.strip()}\n" for p in plugins)
    return f"[mesh]\n{mesh}\n\n{tables}\n[[plugins]]\nname = \"meta_init\"\nseed = 11\n"


HSDP_2X2 = "dp_replicate = 2\ndp_shard = 2"


# -- parity: HSDP x FSDP2 (2 x 2) ----------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_hsdp_fsdp2_2x2_llama_full_checkpointing() -> None:
    # reshard_after_forward=false is allowed under HSDP (warning CP216, tested below).
    plan = plan_toml(HSDP_2X2, 'name = "hsdp"',
                     'name = "fsdp2"\nreshard_after_forward = false',
                     'name = "activation_checkpoint"\nmode = "full"')
    result = check_parity(ParityCase(task=LLAMA, plan=plan, world_size=4, lr=1.0))
    result.assert_close()
    assert result.losses[-1] < result.losses[0] - 0.05, result.losses


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_hsdp_fsdp2_2x2_encoder_selective_checkpointing() -> None:
    plan = plan_toml(HSDP_2X2, 'name = "hsdp"', 'name = "fsdp2"',
                     'name = "activation_checkpoint"\nmode = "selective"')
    # SGD, not AdamW: the key bias of attention has an exactly-zero gradient in exact
    # arithmetic (softmax ignores a shift of every key), so its fp32 gradient is pure
    # summation-order noise (~1e-9), which AdamW normalizes into +-lr updates of random
    # sign: measured 5e-3 differences in in_proj_bias[32:64], nowhere else.
    case = ParityCase(task=ENCODER, plan=plan, world_size=4, lr=0.05)
    result = check_parity(case)
    result.assert_close()
    assert result.losses[-1] < result.losses[0], result.losses


# -- parity: HSDP alone (4) ----------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_hsdp_alone_on_4_ranks_mlp_adamw() -> None:
    plan = plan_toml("dp_replicate = 4", 'name = "hsdp"')
    case = ParityCase(task=MLP, plan=plan, world_size=4, optimizer="adamw", lr=0.01,
                      reference="accumulate")
    result = check_parity(case)
    result.assert_close()
    assert result.losses[-1] < result.losses[0], result.losses


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_hsdp_alone_on_4_ranks_llama_selective_checkpointing() -> None:
    plan = plan_toml("dp_replicate = 4", 'name = "hsdp"',
                     'name = "activation_checkpoint"\nmode = "selective"')
    result = check_parity(ParityCase(task=LLAMA, plan=plan, world_size=4, lr=1.0))
    result.assert_close()
    assert result.losses[-1] < result.losses[0] - 0.05, result.losses


# -- parity: HSDP alone x TP (2 x 2) --------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_hsdp_alone_x_tp_2x2_llama_selective_checkpointing() -> None:
    """Replicate-only with tensor parallelism: TP's DTensors become 2-D (dp_replicate, tp)
    DTensors under torch's replicate, and every gradient is reduced over dp_replicate."""
    plan = plan_toml(
        "dp_replicate = 2\ntp = 2",
        'name = "hsdp"',
        'name = "tp"',
        'name = "activation_checkpoint"\nmode = "selective"',
    )
    result = check_parity(ParityCase(task=LLAMA, plan=plan, world_size=4, lr=1.0))
    result.assert_close()
    assert result.losses[-1] < result.losses[0] - 0.05, result.losses


# -- the layout each builds ------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_layouts_names_fsdp_modules_and_per_module_setters() -> None:
    facts = run_ranks("tests.hsdp_workers:layouts", 4, timeout=150)[0]
    two_d, alone = facts["hsdp_fsdp2"], facts["hsdp_alone"]
    # One 2-D fully_shard mesh, replicate outer; the model's own names.
    assert two_d["placements"] == {"(Replicate(), Shard(dim=0))"}
    assert two_d["mesh_dims"] == {("dp_replicate", "dp_shard")}
    assert two_d["names_unchanged"] and alone["names_unchanged"]
    # Every block and the root are FSDP modules, recorded for finalize-stage plugins.
    assert two_d["fsdp_modules"] == ["layers.0", "layers.1", "<root>"]
    # Replicate-only: torch's FSDP2-based replicate, parameters replicated DTensors.
    assert alone["placements"] == {"(Replicate(),)"}
    assert alone["mesh_dims"] == {("dp_replicate",)}
    assert alone["fsdp_modules"] == ["layers.0", "layers.1", "<root>"]
    assert alone["module_kind"] == {"ReplicateModule"}
    # Trap: FSDP2's setters act on the module they are called on, not its FSDP submodules.
    per_module = run_ranks("tests.hsdp_workers:setters_are_per_module", 2, timeout=90)[0]
    assert per_module == {"root": [3.0], "block": [None]}
    # So HSDP(gradient_divide_factor=4) calls them on every FSDP module of both plans, and
    # asks for SUM-only reductions on gloo exactly where a reduce-scatter runs.
    assert two_d["divide_factors"] == {4.0} and two_d["force_sum"] == {True}
    assert alone["divide_factors"] == {4.0} and alone["force_sum"] == {False}


# -- traps: gradient divide factor on gloo, per-module setters, CPU offload ----------------


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_trap_premul_sum_on_gloo_and_how_each_path_avoids_it() -> None:
    """Measured: FSDP2 turns a divide factor into PREMUL_SUM, which gloo refuses; our
    helper switches reduce-scattering modules to SUM (+ division) and leaves replicate-only
    ones alone, where forcing SUM would divide twice."""
    def each_path(paths: dict[str, Any]) -> None:
        status, detail = paths["fully_shard, torch setter only"]
        assert status == "error" and "PREMUL_SUM" in detail and "Gloo" in detail
        for case in ("fully_shard, set_gradient_divide_factor(sum_only)",
                     "replicate, torch setter only",
                     "replicate, set_gradient_divide_factor(sum_only)"):
            assert paths[case][0] == "ok" and paths[case][1] < 1e-6, (case, paths[case])
        # The reason the helper does not force SUM on replicate-only modules:
        assert paths["replicate, forced SUM"][0] == "ok"
        assert paths["replicate, forced SUM"][1] > 1e-2

    # Every rank's gradients: under replicate each rank's is its own copy.
    assert_every_rank(run_ranks("tests.hsdp_workers:divide_factor_paths", 2, timeout=90),
                      each_path)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_trap_gradient_divide_factor_trains_at_parity_on_gloo() -> None:
    # 4.0 is the number of data-parallel ranks: the same update as torch's default mean,
    # reached through SUM reductions and one division instead of PREMUL_SUM.
    plan = plan_toml(HSDP_2X2, 'name = "hsdp"\ngradient_divide_factor = 4.0', 'name = "fsdp2"')
    result = check_parity(ParityCase(task=MLP, plan=plan, world_size=4, lr=0.5))
    result.assert_close()
    assert result.losses[-1] < result.losses[0], result.losses


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_trap_cpu_offload_trains_without_an_accelerator() -> None:
    # Measured: CPUOffloadPolicy(pin_memory=True) fails on a machine without an
    # accelerator (CPU builds of torch: "Cannot access accelerator device when none is
    # available"; CUDA builds: "Found no NVIDIA driver on your system"); FSDP2 pins only
    # when CUDA is there, so offload trains on gloo.
    pinned = run_ranks("tests.hsdp_workers:cpu_offload_pinned", 2, timeout=90)[0]
    assert "accelerator" in pinned or "no NVIDIA driver" in pinned, pinned
    plan = plan_toml(HSDP_2X2, 'name = "hsdp"', 'name = "fsdp2"\noffload = "cpu"')
    result = check_parity(ParityCase(task=MLP, plan=plan, world_size=4, lr=0.5))
    result.assert_close()


# -- static: composition, rules, data shards -----------------------------------------------


@attrs.frozen
class TinyTP(Plugin):
    """Claims a model-parallel mesh dim (stands in for TP in static tests)."""

    name: ClassVar[str] = "tiny_tp"
    dim: str = "tp"

    def claims(self) -> tuple[Claim, ...]:
        return (Claim(self.dim, Role.MODEL_PARALLEL),)


def codes(plan: ParallelPlan) -> list[str]:
    return plan.validate().codes()


def test_hsdp_contributes_its_dim_to_fsdp2() -> None:
    plan = ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2)).use(FSDP2()).use(HSDP())
    assert plan.replicate_dims() == ["dp_replicate"]
    assert plan.validate().findings == ()
    text = str(plan.explain())
    assert "over mesh (dp_replicate, dp_shard)" in text
    assert "contribute dp_replicate to fsdp2's mesh" in text


def test_hsdp_alone_explains_replication() -> None:
    plan = ParallelPlan(MeshSpec(dp_replicate=4)).use(HSDP()).use(MetaInit())
    assert plan.validate().findings == ()
    assert "replicate each block, then the root, over dp_replicate" in str(plan.explain())


def test_replicate_crossing_nodes_is_the_intended_layout() -> None:
    topology = Topology(nodes=2, devices_per_node=2)
    good = ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2), topology=topology)
    assert good.use(HSDP()).use(FSDP2()).validate().findings == ()
    reversed_ = ParallelPlan(MeshSpec(dp_shard=2, dp_replicate=2), topology=topology)
    assert "CP301" in codes(reversed_.use(HSDP()).use(FSDP2()))


def test_hsdp_alone_with_a_model_parallel_dim_is_a_valid_plan() -> None:
    plan = ParallelPlan(MeshSpec(dp_replicate=2, tp=2)).use(HSDP()).use(TinyTP())
    assert plan.validate().findings == ()
    assert plan.data_parallel_dims() == ["dp_replicate"]


def test_cp216_no_reshard_under_hsdp_is_a_memory_warning() -> None:
    plan = ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2))
    report = plan.use(HSDP()).use(FSDP2(reshard_after_forward=False)).validate()
    assert report.ok
    (finding,) = report.findings
    assert finding.code == "CP216" and finding.severity is Severity.WARNING
    assert finding.plugin == "fsdp2" and "dp_shard" in finding.message
    for value in (True, None, 2):
        again = ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2))
        assert "CP216" not in codes(again.use(HSDP()).use(FSDP2(reshard_after_forward=value)))


@pytest.mark.parametrize("bad", [0, -1.0, True, "2", float("nan")])
def test_gradient_divide_factor_is_validated(bad: Any) -> None:
    with pytest.raises(ValueError, match="gradient_divide_factor must be a number > 0"):
        HSDP(gradient_divide_factor=bad)


def test_an_infinite_gradient_divide_factor_is_refused() -> None:
    # Dividing by inf would zero every gradient, silently.
    with pytest.raises(ValueError, match="gradient_divide_factor must be finite"):
        HSDP(gradient_divide_factor=float("inf"))
    assert HSDP(gradient_divide_factor=4).gradient_divide_factor == 4.0


def test_plan_file_round_trip_and_bad_option() -> None:
    text = plan_toml(HSDP_2X2, 'name = "hsdp"\ngradient_divide_factor = 2', 'name = "fsdp2"')
    plan = ParallelPlan.from_toml(text)
    assert plan.plugin("hsdp") == HSDP(gradient_divide_factor=2.0)
    assert ParallelPlan.from_toml(plan.to_toml()).plugins == plan.plugins
    with pytest.raises(PlanFileError) as info:
        ParallelPlan.from_toml(plan_toml("dp_replicate = 2", 'name = "hsdp"\ndim = 3'))
    assert "dim must be a mesh dim name" in str(info.value)


def test_data_shard_ignores_model_parallel_dims() -> None:
    """Ranks that differ only in the tp coordinate read the same samples."""
    mesh = MeshSpec(dp_replicate=2, dp_shard=2, tp=2)
    plan = ParallelPlan(mesh).use(HSDP()).use(FSDP2()).use(TinyTP())
    assert plan.data_parallel_dims() == ["dp_replicate", "dp_shard"]
    shards = [plan.data_shard(rank, 8) for rank in range(8)]
    assert shards == [(0, 4), (0, 4), (1, 4), (1, 4), (2, 4), (2, 4), (3, 4), (3, 4)]
    for group in mesh.rank_groups("tp"):
        assert len({shards[r] for r in group}) == 1
    # HSDP alone: the replicate dim alone sets the shards.
    alone = ParallelPlan(MeshSpec(dp_replicate=4)).use(HSDP())
    assert [alone.data_shard(r, 4) for r in range(4)] == [(r, 4) for r in range(4)]


def test_hsdp_with_fsdp2_plans_checkpointing_on_the_same_blocks() -> None:
    plan = (ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2))
            .use(HSDP()).use(FSDP2(blocks="layers")).use(ActivationCheckpoint()))
    assert plan.block_spec() is not None and plan.block_spec().path == "layers"
    assert plan.validate().ok
