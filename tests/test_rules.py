"""Validation: one test (at least) for every rule code a static or model-aware rule emits.

Plans are built with the real FSDP2 and MetaInit plugins plus tiny test plugins defined
here (an HSDP-like replicate plugin, a TP-like model-parallel plugin, ...): the rules
must work for any plugin that claims mesh dims, not only the built-ins. Plan-file input
errors (CP5xx) are tested in tests/test_planfile.py.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import attrs
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from composer_par import FSDP2, MetaInit, rules
from composer_par.blocks import BlockSpec
from composer_par.findings import RULES, Finding, PlanError, Report, Severity
from composer_par.mesh import MeshSpec
from composer_par.plan import ParallelPlan
from composer_par.plugin import Claim, Plugin, Role, hookimpl
from composer_par.topology import Topology

# -- test plugins ----------------------------------------------------------------------------


@attrs.frozen
class Toy(Plugin):
    """A plugin that claims at most one mesh dim and may order itself."""

    name: ClassVar[str] = "toy"

    dim: str | None = None
    role: Role = Role.OTHER
    after: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    before: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    def claims(self) -> tuple[Claim, ...]:
        return (Claim(self.dim, self.role),) if self.dim else ()


@attrs.frozen
class HSDPLike(Toy):
    """Replicates over its dim and tells data-parallel plugins about it."""

    name: ClassVar[str] = "hsdp"
    provides: ClassVar[frozenset[str]] = frozenset({"data_parallel"})

    dim: str | None = "dp_replicate"
    role: Role = Role.REPLICATE

    @hookimpl
    def composer_par_replicate_dims(self) -> list[str]:
        return [self.dim] if self.dim else []


@attrs.frozen
class TPLike(Toy):
    name: ClassVar[str] = "tp"

    dim: str | None = "tp"
    role: Role = Role.MODEL_PARALLEL


class Alpha(Toy):
    name: ClassVar[str] = "alpha"


class Beta(Toy):
    name: ClassVar[str] = "beta"


class Gamma(Toy):
    name: ClassVar[str] = "gamma"


class CommHook(Toy):
    """A gradient comm hook: useless without a data-parallel plugin."""

    name: ClassVar[str] = "comm_hook"
    requires: ClassVar[frozenset[str]] = frozenset({"data_parallel"})


class Evaluator(Toy):
    """Needs materialized weights (from MetaInit or a loader)."""

    name: ClassVar[str] = "evaluator"
    requires: ClassVar[frozenset[str]] = frozenset({"materialize", "telemetry"})


class Loader(Toy):
    """A second materializer (loads weights instead of initializing them)."""

    name: ClassVar[str] = "load_weights"
    provides: ClassVar[frozenset[str]] = frozenset({"materialize"})

    @hookimpl
    def composer_par_materialize(self, ctx: Any) -> str:
        raise AssertionError("never applied in these tests")


class BlockTeller(Toy):
    """Tells the block finder where the blocks are, like activation checkpointing may."""

    name: ClassVar[str] = "checkpointing"

    @hookimpl
    def composer_par_block_spec(self) -> BlockSpec:
        return BlockSpec(classes=("Block",))


@attrs.frozen
class Checkpointing(Toy):
    """Checks an option against the plan; a bad value is CP210."""

    name: ClassVar[str] = "checkpointing"

    mode: str = "full"

    @hookimpl
    def composer_par_validate_plan(self, mesh: MeshSpec) -> list[Finding]:
        if self.mode in ("full", "selective"):
            return []
        return [Finding("CP210", f"mode={self.mode!r} is not a checkpointing mode",
                        fix="use mode = 'full' or 'selective'")]


class Misspelled(Toy):
    name: ClassVar[str] = "misspelled"

    @hookimpl
    def composer_par_materialise(self, ctx: Any) -> None:  # British spelling: no such hook
        pass


class WrongArgument(Toy):
    name: ClassVar[str] = "wrong_argument"

    @hookimpl
    def composer_par_validate_plan(self, meshes: Any) -> None:  # the spec's argument: `mesh`
        pass


@attrs.frozen
class ModelChecker(Toy):
    """A third-party plugin with its own code, checking the model."""

    name: ClassVar[str] = "model_checker"

    limit: int = 2

    @hookimpl
    def composer_par_validate_model(self, model: nn.Module, blocks: list[Any]) -> list[Finding]:
        if len(blocks) <= self.limit:
            return []
        return [Finding("ACME101", f"{len(blocks)} blocks, more than {self.limit}",
                        fix="use a smaller model")]


# -- models ----------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x)


class Net(nn.Module):
    def __init__(self, blocks: int = 3, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Scale(nn.Module):
    """Owns a parameter and has no reset_parameters: MetaInit cannot initialize it."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))


# -- helpers ---------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _outside_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests say their own topology; a surrounding torchrun must not leak in."""
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def plan_of(mesh: MeshSpec, *plugins: Plugin, topology: Topology | None = None) -> ParallelPlan:
    plan = ParallelPlan(mesh, topology=topology)
    for plugin in plugins:
        plan.use(plugin)
    return plan


def only(report: Report, code: str) -> Finding:
    """The one finding with ``code``; fails listing the whole report otherwise."""
    found = [f for f in report.findings if f.code == code]
    assert len(found) == 1, f"expected one {code}, got:\n{report.format()}"
    return found[0]


def test_the_catalog_codes_are_well_formed() -> None:
    import re

    from composer_par.rules import catalogs

    for code, rule in RULES.items():
        assert rule.code == code
        assert re.fullmatch(r"[A-Z]+\d{3}", code), code
        assert isinstance(rule.severity, Severity)
        assert rule.title and rule.fix and rule.example, code
    for source, rule in catalogs():
        if source == "core" or source.endswith("(composer-par)"):
            # the core's and the built-ins' codes: CP and three digits
            assert re.fullmatch(r"CP\d{3}", rule.code), (source, rule.code)


# -- CP1xx: mesh and world size ----------------------------------------------------------------


def test_cp101_world_size_equation() -> None:
    plan = plan_of(MeshSpec(dp_replicate=4, dp_shard=8, tp=2), HSDPLike(), FSDP2(), TPLike())
    report = plan.validate(world_size=32)
    finding = only(report, "CP101")
    assert finding.severity is Severity.ERROR
    assert "dp_replicate(4) * dp_shard(8) * tp(2) = 64 != world_size(32)" in finding.message
    assert "-1" in finding.fix
    assert not report.ok


def test_cp101_world_size_comes_from_the_topology() -> None:
    plan = plan_of(MeshSpec(dp_shard=8), FSDP2(), topology=Topology(nodes=2, devices_per_node=8))
    finding = only(plan.validate(), "CP101")
    assert "dp_shard(8) = 8 != world_size(16)" in finding.message


def test_cp101_inferred_size_that_does_not_divide() -> None:
    plan = plan_of(MeshSpec(dp_replicate=-1, dp_shard=8), HSDPLike(), FSDP2())
    finding = only(plan.validate(world_size=12), "CP101")
    assert "12 is not divisible by 8" in finding.message


def test_cp101_not_raised_when_the_mesh_fits() -> None:
    plan = plan_of(MeshSpec(dp_replicate=-1, dp_shard=8), HSDPLike(), FSDP2())
    assert plan.validate(world_size=32).findings == ()


def test_cp102_topology_does_not_match_world_size() -> None:
    plan = plan_of(MeshSpec(dp_shard=8), FSDP2(), topology=Topology(nodes=2, devices_per_node=8))
    report = plan.validate(world_size=8)
    finding = only(report, "CP102")
    assert "2 node(s) x 8 device(s) = 16 ranks" in finding.message
    assert "world size is 8" in finding.message
    assert "nodes * devices_per_node" in finding.fix
    assert "CP101" not in report.codes()  # the mesh itself fits the 8 ranks


# -- CP2xx: plugins ----------------------------------------------------------------------------


def test_cp201_unowned_dim() -> None:
    report = plan_of(MeshSpec(dp_shard=4, tp=2), FSDP2()).validate(world_size=8)
    finding = only(report, "CP201")
    assert "'tp' (size 2) is owned by no plugin" in finding.message
    assert "TP for tp" in finding.fix and "tp = 1" in finding.fix


def test_cp201_unowned_inferred_dim() -> None:
    finding = only(plan_of(MeshSpec(dp_replicate=-1, dp_shard=4), FSDP2()).validate(), "CP201")
    assert "'dp_replicate' (inferred size)" in finding.message


def test_cp201_size_one_dims_need_no_owner() -> None:
    report = plan_of(MeshSpec(dp_replicate=1, dp_shard=4, tp=1), FSDP2()).validate(world_size=4)
    assert report.findings == ()
    # ... and a -1 that resolves to 1 is fine too.
    report = plan_of(MeshSpec(dp_replicate=-1, dp_shard=4), FSDP2()).validate(world_size=4)
    assert report.findings == ()


def test_cp202_two_owners() -> None:
    plan = plan_of(MeshSpec(dp_shard=4), FSDP2(), HSDPLike(dim="dp_shard"))
    finding = only(plan.validate(world_size=4), "CP202")
    assert "'dp_shard' is claimed by fsdp2 and hsdp" in finding.message
    assert finding.plugin == "hsdp"
    assert "dim" in finding.fix


def test_cp203_unknown_dim_with_did_you_mean() -> None:
    report = plan_of(MeshSpec(dp_shard=4), FSDP2(dim="dp_shrad")).validate(world_size=4)
    finding = only(report, "CP203")
    assert finding.plugin == "fsdp2"
    assert "'dp_shrad'" in finding.message
    assert "did you mean 'dp_shard'" in finding.message
    assert "['dp_shard']" in finding.fix
    # The dim it should have claimed is now unowned: both are reported.
    assert "CP201" in report.codes()


def test_cp203_non_string_dim_is_reported_not_crashed() -> None:
    # A plan file can say `dim = 8`; the did-you-mean must not choke on it.
    report = plan_of(MeshSpec(dp_shard=1), Toy(dim=8)).validate()  # type: ignore[arg-type]
    assert "claims mesh dim 8, which the mesh does not have;" in only(report, "CP203").message


def test_cp204_same_plugin_twice() -> None:
    plan = plan_of(MeshSpec(dp_shard=4), FSDP2(), FSDP2(reshard_after_forward=True))
    finding = only(plan.validate(world_size=4), "CP204")
    assert finding.plugin == "fsdp2"
    assert "'fsdp2' is used 2 times" in finding.message
    assert "use each plugin once" in finding.fix


@pytest.mark.parametrize("same_object", [False, True])
def test_cp204_equal_instances(same_object: bool) -> None:
    first = FSDP2()
    second = first if same_object else FSDP2()
    report = plan_of(MeshSpec(dp_shard=4), first, second).validate(world_size=4)
    finding = only(report, "CP204")
    assert "'fsdp2' is used 2 times" in finding.message


def test_cp205_ordering_cycle() -> None:
    plan = plan_of(MeshSpec(), Alpha(after=("beta",)), Beta(after=("gamma",)),
                   Gamma(before=("beta",), after=("alpha",)))
    finding = only(plan.validate(), "CP205")
    assert "alpha -> gamma -> beta -> alpha" in finding.message
    assert finding.plugin == "alpha"
    assert "remove one of the after/before" in finding.fix


def test_cp205_self_cycle_and_no_false_positive() -> None:
    assert "CP205" in plan_of(MeshSpec(), Alpha(after=("alpha",))).validate().codes()
    ordered = plan_of(MeshSpec(), Alpha(before=("beta",)), Beta(after=("alpha",)))
    assert ordered.validate().findings == ()


def test_cp206_missing_requirement() -> None:
    finding = only(plan_of(MeshSpec(), CommHook()).validate(), "CP206")
    assert finding.plugin == "comm_hook"
    assert "requires a 'data_parallel' plugin" in finding.message
    assert "FSDP2 or HSDP" in finding.fix
    # HSDP alone (DDP-like) provides data parallelism too.
    met = plan_of(MeshSpec(dp_replicate=2), HSDPLike(), CommHook()).validate(world_size=2)
    assert met.findings == ()


def test_cp206_each_missing_requirement_with_its_providers() -> None:
    report = plan_of(MeshSpec(), Evaluator()).validate()
    by_need = {f.message.split("'")[1]: f for f in report.findings if f.code == "CP206"}
    assert set(by_need) == {"materialize", "telemetry"}
    assert "MetaInit or a loader" in by_need["materialize"].fix
    assert "FSDP2" not in by_need["materialize"].fix
    assert by_need["telemetry"].fix == "add a plugin that provides 'telemetry'"
    assert plan_of(MeshSpec(), Evaluator(), MetaInit()).validate().codes() == ["CP206"]


def test_cp207_two_materializers() -> None:
    finding = only(plan_of(MeshSpec(), MetaInit(), Loader()).validate(), "CP207")
    assert "meta_init and load_weights both materialize" in finding.message
    assert finding.plugin == "load_weights"
    assert "keep one" in finding.fix


def test_cp208_plugins_disagree_on_blocks() -> None:
    plan = plan_of(MeshSpec(dp_shard=2), FSDP2(blocks="layers"), BlockTeller())
    finding = only(plan.validate(world_size=2), "CP208")
    assert "fsdp2: path 'layers'" in finding.message
    assert "checkpointing: classes ['Block']" in finding.message
    assert "same value" in finding.fix
    agreeing = plan_of(MeshSpec(dp_shard=2), FSDP2(blocks=["Block"]), BlockTeller())
    assert agreeing.validate(world_size=2).findings == ()


def test_cp209_ordering_against_a_missing_plugin_is_a_warning() -> None:
    report = plan_of(MeshSpec(dp_shard=2), FSDP2(), Alpha(after=("fsdp",))).validate(world_size=2)
    finding = only(report, "CP209")
    assert finding.severity is Severity.WARNING
    assert finding.plugin == "alpha"
    assert "'fsdp'" in finding.message and "did you mean 'fsdp2'" in finding.message
    assert report.ok  # a warning does not stop apply


def test_cp210_invalid_option_value_reported_by_the_plugin() -> None:
    report = plan_of(MeshSpec(), Checkpointing(mode="everything")).validate()
    finding = only(report, "CP210")
    assert finding.severity is Severity.ERROR  # from the catalog: the plugin left it unset
    assert finding.plugin == "checkpointing"  # attributed to the plugin whose hook said it
    assert "'everything'" in finding.message and "selective" in finding.fix
    assert plan_of(MeshSpec(), Checkpointing(mode="selective")).validate().findings == ()


@pytest.mark.parametrize(
    ("plugin", "hook"),
    [(Misspelled(), "composer_par_materialise"), (WrongArgument(), "meshes")],
)
def test_cp211_hook_that_does_not_exist(plugin: Plugin, hook: str) -> None:
    report = plan_of(MeshSpec(dp_shard=2), FSDP2(), plugin).validate(world_size=2)
    finding = only(report, "CP211")
    assert hook in finding.message
    assert "composer_par.plugin.hookspecs" in finding.fix
    assert not report.ok
    with pytest.raises(PlanError) as err:
        plan_of(MeshSpec(), plugin).apply(Net())
    assert "CP211" in err.value.report.codes()


# -- CP3xx: topology ---------------------------------------------------------------------------


def test_cp301_reversed_hsdp_names_the_swapped_order() -> None:
    plan = plan_of(MeshSpec(dp_shard=8, dp_replicate=4), HSDPLike(), FSDP2(),
                   topology=Topology(nodes=4, devices_per_node=8))
    report = plan.validate()
    finding = only(report, "CP301")
    assert finding.severity is Severity.ERROR
    assert finding.plugin == "fsdp2"
    assert "dp_shard(8) crosses nodes" in finding.message
    assert "dp_replicate(4) stays inside a node" in finding.message
    assert "4 node(s) x 8 device(s)" in finding.message
    assert "dp_replicate=4, dp_shard=8" in finding.fix
    assert "dp_replicate = 4 then dp_shard = 8" in finding.fix
    assert "check that" not in finding.fix  # the swapped mesh is right as it stands
    assert "CP305" not in report.codes()


def test_cp301_fixed_order_is_clean() -> None:
    plan = plan_of(MeshSpec(dp_replicate=4, dp_shard=8), HSDPLike(), FSDP2(),
                   topology=Topology(nodes=4, devices_per_node=8))
    assert plan.validate().findings == ()


def test_cp301_with_tp_in_between_keeps_tp_in_place() -> None:
    plan = plan_of(MeshSpec(dp_shard=4, tp=2, dp_replicate=4), HSDPLike(), FSDP2(), TPLike(),
                   topology=Topology(nodes=4, devices_per_node=8))
    finding = only(plan.validate(), "CP301")
    assert "dp_replicate=4, tp=2, dp_shard=4" in finding.fix


def test_cp301_warns_when_the_swap_is_not_enough() -> None:
    # 4 nodes x 4: even swapped, dp_shard(8) is larger than a node.
    plan = plan_of(MeshSpec(dp_shard=8, dp_replicate=2), HSDPLike(), FSDP2(),
                   topology=Topology(nodes=4, devices_per_node=4))
    finding = only(plan.validate(), "CP301")
    assert "dp_replicate=2, dp_shard=8" in finding.fix
    assert "check that dp_shard's size fits in a node" in finding.fix


@st.composite
def hsdp_layouts(draw: st.DrawFn) -> tuple[MeshSpec, Topology]:
    """Two data-parallel dims, in either order, filling a random multi-node topology."""
    nodes = draw(st.integers(2, 4))
    per_node = draw(st.integers(1, 8))
    world = nodes * per_node
    shard = draw(st.sampled_from([d for d in range(2, world + 1) if world % d == 0]))
    pairs = [("dp_replicate", world // shard), ("dp_shard", shard)]
    if draw(st.booleans()):
        pairs.reverse()
    return MeshSpec.from_pairs(pairs), Topology(nodes, per_node)


@settings(max_examples=150, deadline=None)
@given(hsdp_layouts())
def test_cp301_property_the_named_fix_works(layout: tuple[MeshSpec, Topology]) -> None:
    mesh, topology = layout
    report = plan_of(mesh, HSDPLike(), FSDP2(), topology=topology).validate()
    shard_crosses = topology.crosses_nodes(mesh, "dp_shard")
    replicate = mesh.size("dp_replicate")
    reversed_mesh = (
        shard_crosses and replicate > 1 and not topology.crosses_nodes(mesh, "dp_replicate")
    )
    assert ("CP301" in report.codes()) == reversed_mesh, report.format()
    # A shard dim that crosses nodes is either reversed (CP301) or too big (CP305).
    assert ("CP305" in report.codes()) == (shard_crosses and not reversed_mesh)
    if not reversed_mesh:
        return
    fix = only(report, "CP301").fix
    spelled = re.search(r"MeshSpec\(([^)]*)\)", fix)
    assert spelled
    fixed = MeshSpec.from_pairs(
        (k, int(v)) for k, v in (kv.split("=") for kv in spelled.group(1).split(", "))
    )
    assert fixed.names == tuple(reversed(mesh.names))
    assert fixed.world_size == mesh.world_size
    again = plan_of(fixed, HSDPLike(), FSDP2(), topology=topology).validate()
    assert "CP301" not in again.codes()
    if "check that" not in fix:
        assert again.findings == (), again.format()
    else:  # the shard dim alone is bigger than a node: what is left is CP305's advice
        assert again.ok and set(again.codes()) <= {"CP305"}, again.format()


def test_cp302_tp_crossing_nodes() -> None:
    plan = plan_of(MeshSpec(tp=4, dp_shard=4), FSDP2(), TPLike(),
                   topology=Topology(nodes=2, devices_per_node=8))
    finding = only(plan.validate(), "CP302")
    assert finding.plugin == "tp"
    assert "tp(4) crosses nodes" in finding.message
    assert "innermost" in finding.fix and "devices_per_node (8)" in finding.fix


def test_cp302_tp_larger_than_a_node() -> None:
    plan = plan_of(MeshSpec(dp_shard=1, tp=16), FSDP2(), TPLike(),
                   topology=Topology(nodes=2, devices_per_node=8))
    assert "CP302" in plan.validate().codes()
    inside = plan_of(MeshSpec(dp_shard=2, tp=8), FSDP2(), TPLike(),
                     topology=Topology(nodes=2, devices_per_node=8))
    assert "CP302" not in inside.validate().codes()


@pytest.mark.parametrize("value", [3, 16])
def test_cp303_reshard_after_forward_not_dividing(value: int) -> None:
    report = plan_of(MeshSpec(dp_shard=8), FSDP2(reshard_after_forward=value)).validate(
        world_size=8
    )
    finding = only(report, "CP303")
    assert finding.plugin == "fsdp2"
    assert f"reshard_after_forward={value}" in finding.message
    assert "dp_shard(8)" in finding.message
    assert "divisor of 8" in finding.fix


@pytest.mark.parametrize("value", [True, False, None, 1, 2, 4, 8])
def test_cp303_cp304_valid_reshard_values(value: bool | int | None) -> None:
    plan = plan_of(MeshSpec(dp_shard=8), FSDP2(reshard_after_forward=value),
                   topology=Topology(nodes=1, devices_per_node=8))
    assert plan.validate().findings == ()


def test_cp304_reshard_after_forward_exceeds_a_node() -> None:
    plan = plan_of(MeshSpec(dp_replicate=2, dp_shard=8), HSDPLike(),
                   FSDP2(reshard_after_forward=8), topology=Topology(nodes=4, devices_per_node=4))
    report = plan.validate()
    finding = only(report, "CP304")
    assert finding.plugin == "fsdp2"
    assert "reshard_after_forward=8" in finding.message
    assert "[0, 1, 2, 3, 4, 5, 6, 7] spans nodes" in finding.message
    assert "at most 4 devices per node" in finding.fix
    assert "CP303" not in report.codes()  # 8 divides dp_shard(8)


def test_cp304_counts_the_stride_of_inner_mesh_dims() -> None:
    # reshard 4 <= 8 devices per node, but with tp(4) inside, dp_shard's runs of 4
    # members are ranks 0, 4, 8, 12: two nodes.
    plan = plan_of(MeshSpec(dp_shard=8, tp=4), FSDP2(reshard_after_forward=4), TPLike(),
                   topology=Topology(nodes=4, devices_per_node=8))
    finding = only(plan.validate(), "CP304")
    assert "[0, 4, 8, 12] spans nodes" in finding.message
    ok = plan_of(MeshSpec(dp_shard=8, tp=4), FSDP2(reshard_after_forward=2), TPLike(),
                 topology=Topology(nodes=4, devices_per_node=8))
    assert "CP304" not in ok.validate().codes()


def test_cp305_shard_spanning_nodes_suggests_hsdp_split() -> None:
    plan = plan_of(MeshSpec(dp_shard=32), FSDP2(), topology=Topology(nodes=4, devices_per_node=8))
    report = plan.validate()
    finding = only(report, "CP305")
    assert finding.severity is Severity.WARNING
    assert report.ok  # a warning, not an error
    assert finding.plugin == "fsdp2"
    assert "dp_shard(32) spans 4 nodes" in finding.message
    assert "HSDP" in finding.fix
    assert "dp_replicate=4, dp_shard=8" in finding.fix


def test_cp305_split_accounts_for_inner_dims_and_the_shard_dims_name() -> None:
    plan = plan_of(MeshSpec(fsdp=16, tp=2), FSDP2(dim="fsdp"), TPLike(),
                   topology=Topology(nodes=4, devices_per_node=8))
    finding = only(plan.validate(), "CP305")
    # tp(2) inside each node leaves 4 devices per node for the shard dim.
    assert "dp_replicate=4, fsdp=4" in finding.fix


def test_cp305_not_raised_on_one_node_or_with_a_replicate_dim() -> None:
    one_node = plan_of(MeshSpec(dp_shard=8), FSDP2(), topology=Topology(1, 8))
    assert one_node.validate().findings == ()
    hsdp = plan_of(MeshSpec(dp_replicate=4, dp_shard=8), HSDPLike(), FSDP2(),
                   topology=Topology(4, 8))
    assert hsdp.validate().findings == ()


def test_topology_rules_skip_a_mesh_that_does_not_fit() -> None:
    # The equation is the problem; crossing cannot be judged on a mesh that does not fit.
    plan = plan_of(MeshSpec(dp_shard=8, dp_replicate=8), HSDPLike(), FSDP2(),
                   topology=Topology(4, 8))
    assert plan.validate().codes() == ["CP101"]


# -- CP4xx: the model ------------------------------------------------------------------------


def test_cp401_no_blocks() -> None:
    plan = plan_of(MeshSpec(dp_shard=2), FSDP2())
    finding = only(plan.validate(nn.Linear(4, 4), world_size=2), "CP401")
    assert finding.plugin == "fsdp2"
    assert "no blocks found in Linear (none could be detected)" in finding.message
    assert "blocks=" in finding.fix
    assert "CP401" not in plan.validate(Net(), world_size=2).codes()


def test_cp401_explicit_path_matches_nothing() -> None:
    plan = plan_of(MeshSpec(dp_shard=2), FSDP2(blocks="layerz"))
    finding = only(plan.validate(Net(), world_size=2), "CP401")
    assert "no module matches path 'layerz'" in finding.message


def test_cp401_only_for_plugins_that_need_blocks() -> None:
    plan = plan_of(MeshSpec(), MetaInit())
    assert "CP401" not in plan.validate(nn.Linear(4, 4)).codes()


def test_cp402_parameters_already_dtensors(fake_world: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    fake_world(2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    model = Net()
    weight = model.layers[1].lin.weight
    sharded = DTensor.from_local(weight.detach()[:4], mesh, [Shard(0)], run_check=False)
    model.layers[1].lin.weight = nn.Parameter(sharded)
    report = plan_of(MeshSpec(dp_shard=2), FSDP2()).validate(model)
    finding = only(report, "CP402")
    assert "1 parameter(s) are already DTensors (first: layers.1.lin.weight)" in finding.message
    assert "freshly built model" in finding.fix


def test_cp403_large_materialized_model(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Net()
    size = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    plan = plan_of(MeshSpec(dp_shard=2), FSDP2())
    monkeypatch.setattr(rules, "LARGE_MATERIALIZED_BYTES", size + 1)
    assert "CP403" not in plan.validate(model, world_size=2).codes()
    monkeypatch.setattr(rules, "LARGE_MATERIALIZED_BYTES", size)
    report = plan.validate(model, world_size=2)
    finding = only(report, "CP403")
    assert finding.severity is Severity.WARNING
    assert report.ok
    assert "already holds" in finding.message and "full copy" in finding.message
    assert "torch.device('meta')" in finding.fix


def test_cp403_not_for_a_meta_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rules, "LARGE_MATERIALIZED_BYTES", 1)
    with torch.device("meta"):
        model = Net()
    report = plan_of(MeshSpec(dp_shard=2), FSDP2(), MetaInit()).validate(model, world_size=2)
    assert report.findings == ()


def test_cp404_module_metainit_cannot_initialize() -> None:
    with torch.device("meta"):
        model = Net()
        model.scale = Scale()
    report = plan_of(MeshSpec(), MetaInit()).validate(model)
    finding = only(report, "CP404")
    assert finding.plugin == "meta_init"
    assert "module scale (Scale) owns gain" in finding.message
    assert "reset_parameters()" in finding.fix and "init_fn" in finding.fix


def test_cp404_root_module_and_a_user_init_fn() -> None:
    with torch.device("meta"):
        model = Scale()
    finding = only(plan_of(MeshSpec(), MetaInit()).validate(model), "CP404")
    assert "module <root> (Scale)" in finding.message

    def init(module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            nn.init.ones_(p)

    assert plan_of(MeshSpec(), MetaInit(init_fn=init)).validate(model).findings == ()


def test_cp404_init_fn_that_cannot_be_imported() -> None:
    plan = plan_of(MeshSpec(), MetaInit(init_fn="no_such_module_xyz:init"))
    finding = only(plan.validate(nn.Linear(2, 2)), "CP404")
    assert "'no_such_module_xyz:init' cannot be imported" in finding.message


def test_cp405_meta_model_and_nothing_materializes() -> None:
    with torch.device("meta"):
        model = Net()
    report = plan_of(MeshSpec(dp_shard=2), FSDP2()).validate(model, world_size=2)
    finding = only(report, "CP405")
    assert "meta device" in finding.message
    assert "MetaInit" in finding.fix
    assert "CP405" not in plan_of(MeshSpec(dp_shard=2), FSDP2(), MetaInit()).validate(
        model, world_size=2
    ).codes()


# -- all findings at once; apply refuses and touches nothing ---------------------------------


def many_problems() -> ParallelPlan:
    return plan_of(
        MeshSpec(dp_replicate=2, dp_shard=4, tp=2, cp=2),
        FSDP2(reshard_after_forward=3),  # CP303
        FSDP2(),  # CP204 (not CP202: the same plugin twice)
        TPLike(dim="tpp"),  # CP203 (did you mean 'tp'), and tp is then unowned: CP201
        CommHook(after=("fsdp3",)),  # CP209
        Alpha(after=("beta",)),
        Beta(after=("alpha",)),  # CP205
        MetaInit(),
        Loader(),  # CP207
        topology=Topology(nodes=2, devices_per_node=8),  # 16 ranks, mesh 32: CP101
    )


def test_validation_collects_every_finding_at_once() -> None:
    report = many_problems().validate()
    codes = set(report.codes())
    expected = {"CP101", "CP201", "CP203", "CP204", "CP205", "CP207", "CP209"}
    assert expected <= codes, report.format()
    # FSDP2 used twice claims dp_shard twice: CP204 says so; a CP202 would repeat it.
    assert "CP202" not in codes
    # dp_replicate, tp and cp are all unowned: each is its own finding.
    unowned = [f.message for f in report.findings if f.code == "CP201"]
    assert len(unowned) == 3
    # Errors come first, then warnings; the formatted report lists every one.
    severities = [f.severity for f in report.findings]
    assert severities == sorted(severities, key=[Severity.ERROR, Severity.WARNING].index)
    text = report.format()
    for code in expected:
        assert code in text
    assert f"{len(report.errors)} error(s), 1 warning(s)" in text


def test_validation_collects_static_and_model_findings_together() -> None:
    plan = plan_of(MeshSpec(dp_shard=8), FSDP2(reshard_after_forward=6), CommHook(),
                   Gamma(before=("delta",)), topology=Topology(nodes=2, devices_per_node=4))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale(4))
    report = plan.validate(model)
    assert set(report.codes()) == {"CP209", "CP303", "CP304", "CP305", "CP401", "CP405"}, (
        report.format()
    )


def _snapshot(model: nn.Module) -> list[tuple[str, type, str, Any]]:
    return [
        (name, type(t), str(t.device), t if t.is_meta else t.detach().clone())
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    ]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_apply_raises_plan_error_and_leaves_the_model_untouched(device: str) -> None:
    with torch.device(device):
        model = Net()
    classes = [type(m) for m in model.modules()]
    tensors = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]}
    before = _snapshot(model)
    plan = many_problems()
    with pytest.raises(PlanError) as err:
        plan.apply(model)
    report = err.value.report
    assert isinstance(report, Report) and not report.ok
    assert report == plan.validate(model)  # the very findings validate() gives
    assert "nothing was applied" in str(err.value)
    assert "CP101" in str(err.value) and "CP207" in str(err.value)
    # Untouched: same module classes (fully_shard would swap them), the same tensor objects
    # with the same values and devices, no process group started.
    assert [type(m) for m in model.modules()] == classes
    after = dict(model.named_parameters()) | dict(model.named_buffers())
    assert after.keys() == tensors.keys()
    assert all(after[n] is tensors[n] for n in tensors)
    for (name, cls, dev, value), (name2, cls2, dev2, now) in zip(
        before, _snapshot(model), strict=True
    ):
        assert (name, cls, dev) == (name2, cls2, dev2)
        if device == "cpu":
            assert torch.equal(value, now), name
    assert plan.applied == []
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_apply_refuses_on_a_model_aware_error_alone() -> None:
    model = nn.Linear(4, 4)
    weight = model.weight
    with pytest.raises(PlanError) as err:
        plan_of(MeshSpec(dp_shard=1), FSDP2()).apply(model)
    assert err.value.report.codes() == ["CP401"]
    assert model.weight is weight and type(model) is nn.Linear


def test_plugin_model_findings_are_collected_with_the_core_ones() -> None:
    """The validate_model hook: a plugin's own codes join the report, attributed to it."""
    with torch.device("meta"):
        model = Net(blocks=3)
    plan = plan_of(MeshSpec(dp_shard=2), FSDP2(), ModelChecker())
    report = plan.validate(model, world_size=2)
    assert report.codes() == ["ACME101", "CP405"]
    finding = only(report, "ACME101")
    assert finding.plugin == "model_checker"
    assert finding.severity is Severity.ERROR  # not in the catalog: an error
    assert "3 blocks" in finding.message  # it saw the shared blocks
    with pytest.raises(PlanError):
        plan.apply(model)
    assert plan_of(MeshSpec(), ModelChecker(limit=3)).validate(model).codes() == ["CP405"]


def test_stand_in_hsdp_composes_like_hsdp() -> None:
    """The replicate_dims hook: the test HSDP gives FSDP2 its replicate dim, so what the
    topology rules judge is the mesh FSDP2 will really build."""
    plan = plan_of(MeshSpec(dp_replicate=2, dp_shard=4), HSDPLike(), FSDP2())
    assert plan.replicate_dims() == ["dp_replicate"]
    assert "over mesh (dp_replicate, dp_shard)" in plan.explain(world_size=8).format()


# -- Finding and Report ----------------------------------------------------------------------


def test_finding_takes_its_severity_from_the_catalog() -> None:
    assert Finding("CP305", "m").severity is Severity.WARNING
    assert Finding("CP101", "m").severity is Severity.ERROR
    assert Finding("XYZ001", "third-party code").severity is Severity.ERROR
    assert Finding("CP101", "m", severity="info").severity is Severity.INFO  # type: ignore[arg-type]


def test_report_format_json_and_exit_codes() -> None:
    warning = Finding("CP209", "orders itself against 'x'", fix="remove it", plugin="alpha")
    error = Finding("CP101", "a(2) = 2 != world_size(4)", fix="change sizes")
    report = Report.of([warning, error])
    assert report.codes() == ["CP101", "CP209"]
    assert report.exit_code() == 1
    assert Report.of([warning]).exit_code() == 0
    assert Report.of([error, Finding("CP502", "bad TOML")]).exit_code() == 2
    assert Report().format() == "plan is valid: no findings"
    assert "WARNING CP209 [alpha]: orders itself against 'x'\n    fix: remove it" in report.format()
    data = report.to_dict()
    assert data["ok"] is False
    assert data["findings"][0] == {
        "severity": "error", "code": "CP101", "plugin": None,
        "message": "a(2) = 2 != world_size(4)", "fix": "change sizes",
    }
    assert (Report.of([warning]) + Report.of([error])).codes() == ["CP101", "CP209"]
