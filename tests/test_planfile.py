"""Plan files: round-trips, every CP5xx problem at once, and no crash on any input."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from composer_par import FSDP2, MeshSpec, MetaInit, ParallelPlan, Topology
from composer_par.planfile import (
    MAX_RANKS,
    PlanFileError,
    dump_plan,
    parts_from_data,
    toml_key,
    toml_string,
    toml_value,
)
from composer_par.plugin.registry import Registry

REGISTRY = Registry()  # one discovery for the whole module: the fuzz tests run it a lot
FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def assert_same_plan(a: ParallelPlan, b: ParallelPlan) -> None:
    assert b.mesh == a.mesh  # names, sizes and order
    assert b.topology == a.topology
    assert b.timeout == a.timeout
    assert [type(p) for p in b.plugins] == [type(p) for p in a.plugins]
    assert b.plugins == a.plugins
    # attrs equality says 1 == True; the text also tells an int from a bool.
    assert b.to_toml() == a.to_toml()


def codes_of(source: str) -> list[str]:
    with pytest.raises(PlanFileError) as info:
        ParallelPlan.from_toml(source)
    assert info.value.report.exit_code() == 2
    return info.value.report.codes()


# -- round trips ---------------------------------------------------------------------------


def test_design_example_reads_and_round_trips() -> None:
    text = """
[mesh]
dp_replicate = 4        # crosses nodes
dp_shard = 8            # inside a node

[topology]
nodes = 4
devices_per_node = 8

[[plugins]]
name = "fsdp2"
reshard_after_forward = true
"""
    plan = ParallelPlan.from_toml(text)
    assert plan.mesh == MeshSpec(dp_replicate=4, dp_shard=8)
    assert plan.topology == Topology(nodes=4, devices_per_node=8)
    assert plan.plugins == [FSDP2(reshard_after_forward=True)]
    assert_same_plan(plan, ParallelPlan.from_toml(plan.to_toml()))


def test_every_builtin_option_round_trips() -> None:
    plan = (
        ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=-1),
                     topology=Topology(2, 4, intra_node_gbps=900, inter_node_gbps=400.5))
        .use(FSDP2(dim="dp_shard", reshard_after_forward=2,
                   mixed_precision={"param_dtype": "bf16", "output_dtype": "torch.float32",
                                    "cast_forward_inputs": False},
                   offload="cpu", blocks=["Block", "Other"], after=["meta_init"]))
        .use(MetaInit(seed=2**63 - 1, device="cpu", init_fn="pkg.mod:init"))
    )
    assert_same_plan(plan, ParallelPlan.from_toml(plan.to_toml()))


def test_defaults_are_not_written_and_empty_mesh_round_trips() -> None:
    plan = ParallelPlan(MeshSpec()).use(FSDP2()).use(MetaInit())
    assert plan.to_toml() == (
        '[mesh]\n\n[[plugins]]\nname = "fsdp2"\n\n[[plugins]]\nname = "meta_init"\n'
    )
    assert_same_plan(plan, ParallelPlan.from_toml(plan.to_toml()))


def test_odd_strings_and_keys_round_trip() -> None:
    # JSON escapes would write the emoji as a surrogate pair and DEL raw: invalid TOML.
    odd = 'quote " back \\ tab \t nl \n del \x7f nul \x00 emoji \U0001f600 é'
    plan = ParallelPlan(MeshSpec(**{"é": 2, "_x1": 1})).use(FSDP2(dim="é", blocks=odd, after=[odd]))
    plan.use(MetaInit(device=odd, init_fn=f"{odd}:{odd}"))
    assert_same_plan(plan, ParallelPlan.from_toml(plan.to_toml()))


def test_the_timeout_is_written_only_when_not_the_default_and_reads_back() -> None:
    assert "[plan]" not in ParallelPlan(MeshSpec(a=1), timeout=300).to_toml()
    plan = ParallelPlan(MeshSpec(a=1), timeout=45)
    assert plan.to_toml() == "[mesh]\na = 1\n\n[plan]\ntimeout = 45\n"
    assert_same_plan(plan, ParallelPlan.from_toml(plan.to_toml()))
    read = ParallelPlan.from_toml("[plan]\ntimeout = 2.5\n[mesh]\na = 1")
    assert read.timeout.total_seconds() == 2.5


def test_a_bad_timeout_names_the_value() -> None:
    with pytest.raises(PlanFileError) as info:
        ParallelPlan.from_toml("[mesh]\na = 1\n[plan]\ntimeout = -5")
    [finding] = info.value.report.findings
    assert finding.message == "[plan]: timeout must be a finite number of seconds > 0; got -5"


def test_a_path_reads_like_text(tmp_path: Path) -> None:
    plan = ParallelPlan(MeshSpec(dp_shard=8)).use(FSDP2())
    path = tmp_path / "plan.toml"
    path.write_text(plan.to_toml(), encoding="utf-8")
    assert_same_plan(plan, ParallelPlan.from_toml(path))
    assert_same_plan(plan, ParallelPlan.from_toml(str(path)))
    other = tmp_path / "plan.txt"  # not .toml, but an existing file: still a path
    other.write_text(plan.to_toml(), encoding="utf-8")
    assert_same_plan(plan, ParallelPlan.from_toml(str(other)))


def test_what_toml_cannot_hold_is_refused_naming_the_option() -> None:
    with pytest.raises(ValueError, match="'meta_init' option 'init_fn'"):
        ParallelPlan(MeshSpec()).use(MetaInit(init_fn=lambda m: None)).to_toml()
    with pytest.raises(ValueError, match="64-bit"):
        ParallelPlan(MeshSpec()).use(FSDP2(reshard_after_forward=2**64)).to_toml()
    with pytest.raises(ValueError, match="surrogate"):
        toml_string("\ud800")
    with pytest.raises(ValueError, match="no null"):
        toml_value({"a": None})
    with pytest.raises(ValueError, match="keys are strings"):
        toml_key(1)


def test_special_floats_are_written_as_toml_spells_them() -> None:
    assert toml_value([math.inf, -math.inf, 1e300, 5e-324]) == "[inf, -inf, 1e+300, 5e-324]"
    assert math.isnan(tomllib.loads(f"x = {toml_value(math.nan)}")["x"])


# -- reading: every problem at once --------------------------------------------------------

EVERYTHING_WRONG = """
mesj = 1
[mesh]
dp_shard = 0
tp = "two"
"not an identifier" = 2
[topology]
nodes = 0
devices_per_node = 2.5
bandwidth = 1
[[plugins]]
name = "fsdp"
[[plugins]]
name = "fsdp2"
reshard_after_foward = true
offload = "gpu"
mixed_precision = { param_dtype = "int8" }
[[plugins]]
name = "meta_init"
seed = -1
[[plugins]]
nmae = "meta_init"
"""


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(PlanFileError) as info:
        ParallelPlan.from_toml(EVERYTHING_WRONG)
    report = info.value.report
    messages = "\n".join(f.message for f in report.findings)
    assert sorted(report.codes()) == sorted(
        ["CP503", "CP503", "CP504", "CP505"] + ["CP506"] * 9
    ), report.format()
    for expected in [
        "top-level key 'mesj' (did you mean 'mesh'?)",
        "[topology] key 'bandwidth'",
        "unknown plugin 'fsdp' (did you mean 'fsdp2'?)",
        "unknown option 'reshard_after_foward' (did you mean 'reshard_after_forward'?)",
        "'dp_shard': size must be >= 1",
        "'tp': size must be an int",
        "'not an identifier'",
        "nodes must be a positive int; got 0",
        "devices_per_node must be a positive int; got 2.5",
        "offload = 'gpu': 'offload' must be in ('none', 'cpu')",  # attrs' message, not its tuple
        "dtype must be one of",
        "seed must be an int",
        "'nmae' looks like name",
    ]:
        assert expected in messages
    assert all(f.fix for f in report.findings)
    assert str(info.value).startswith("<plan>: cannot read the plan")


@pytest.mark.parametrize(
    ("text", "codes"),
    [
        ("", ["CP506"]),  # no [mesh]
        ("mesh = 3", ["CP506"]),
        ("[mesh]\na = -1\nb = -1", ["CP506"]),
        ("[mesh]\na = 1\n[[plugins]]\nname = 3", ["CP506"]),
        ("plugins = 3\n[mesh]\na = 1", ["CP506"]),
        ("[mesh]\na = 1\n[plugins]\nname = 'fsdp2'", ["CP506"]),  # a table, not [[plugins]]
        ("plugins = [3]\n[mesh]\na = 1", ["CP506"]),
        ("[mesh]\na = 1\n[topology]\nnodes = 2", ["CP506"]),
        ("topology = 'big'\n[mesh]\na = 1", ["CP506"]),
        ("[mesh]\na = 1\n[topology]\nnodes = 1\ndevices_per_node = 1\ninter_node_gbps = nan",
         ["CP506"]),
        ("[mesh]\na = 1\n[[plugin]]\nname = 'fsdp2'", ["CP503"]),
        ("[mesh\n", ["CP502"]),
        ("[mesh]\na = " + "9" * 5000, ["CP502"]),  # past Python's int-digit limit
        ("x = " + "[" * 5000 + "]" * 5000, ["CP502"]),  # RecursionError inside tomllib
        (f"[mesh]\na = {MAX_RANKS + 1}", ["CP506"]),
        (f"[mesh]\na = {MAX_RANKS}\nb = 2", ["CP506"]),
        (f"[mesh]\na = {2**63 - 1}\nb = -1", ["CP506"]),
        (f"[mesh]\na = 1\n[topology]\nnodes = {MAX_RANKS}\ndevices_per_node = 2", ["CP506"]),
        ("plan = 3\n[mesh]\na = 1", ["CP506"]),
        ("[mesh]\na = 1\n[plan]\ntimeout = 0", ["CP506"]),
        ("[mesh]\na = 1\n[plan]\ntimeout = -5", ["CP506"]),
        ("[mesh]\na = 1\n[plan]\ntimeout = nan", ["CP506"]),
        ("[mesh]\na = 1\n[plan]\ntimeout = inf", ["CP506"]),
        ("[mesh]\na = 1\n[plan]\ntimeout = 1e300", ["CP506"]),
        ("[mesh]\na = 1\n[plan]\ntimeout = '300'", ["CP506"]),
        ("[mesh]\na = 1\n[plan]\ntimeout = true", ["CP506"]),
        ("[mesh]\na = 1\n[plan]\ntimeut = 30", ["CP503"]),
    ],
)
def test_bad_files_give_their_code(text: str, codes: list[str]) -> None:
    assert codes_of(text) == codes


def test_option_value_errors_of_a_plugin_are_all_reported() -> None:
    text = "[mesh]\na = 1\n[[plugins]]\nname = 'meta_init'\nseed = 'x'\ninit_fn = 3"
    assert codes_of(text) == ["CP506", "CP506"]


def test_fsdp2_option_types_are_checked_when_read() -> None:
    # These once loaded, then crashed validate()/explain().
    text = "[mesh]\na = 1\n[[plugins]]\nname = 'fsdp2'\ndim = 0\nblocks = 0\nbefore = [1]"
    assert codes_of(text) == ["CP506"] * 3
    plan = ParallelPlan.from_toml("[mesh]\n[[plugins]]\nname = 'fsdp2'\nafter = 'meta_init'")
    assert plan.plugins == [FSDP2(after=("meta_init",))]  # one name, not its letters


def test_an_equal_plugin_twice_is_cp204_not_a_crash() -> None:
    plan = ParallelPlan.from_toml("[mesh]\n[[plugins]]\nname = 'meta_init'\n"
                                  "[[plugins]]\nname = 'meta_init'")
    assert set(plan.validate().codes()) == {"CP204", "CP207"}
    assert len(plan.explain().steps) == 2


def test_files_that_cannot_be_read(tmp_path: Path) -> None:
    assert codes_of(str(tmp_path / "missing.toml")) == ["CP501"]
    assert codes_of(str(tmp_path / "plan.tml")) == ["CP501"]  # a path, not TOML text
    assert codes_of("# only a comment") == ["CP506"]  # TOML text: no [mesh]
    with pytest.raises(PlanFileError) as info:
        ParallelPlan.from_toml(tmp_path)  # a directory
    assert info.value.report.codes() == ["CP501"]
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00bad")
    assert codes_of(str(binary)) == ["CP501"]


def test_blocked_plugin_is_an_unknown_plugin_with_the_reason() -> None:
    registry = Registry(block=["fsdp2"])
    with pytest.raises(PlanFileError) as info:
        parts_from_data({"mesh": {}, "plugins": [{"name": "fsdp2"}]}, registry=registry)
    [finding] = info.value.report.findings
    assert finding.code == "CP504" and "blocked" in finding.message


# -- properties ------------------------------------------------------------------------------

identifiers = st.one_of(
    st.sampled_from(["dp_replicate", "dp_shard", "tp", "é", "ñame"]),
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True),
)
dtypes = st.sampled_from(["float32", "bfloat16", "float16", "float64", "bf16", "fp16",
                          "fp32", "half", "float", "double", "torch.bfloat16"])
mixed_precisions = st.one_of(
    st.none(),
    dtypes,
    st.fixed_dictionaries({}, optional={
        "param_dtype": dtypes, "reduce_dtype": dtypes, "output_dtype": dtypes,
        "cast_forward_inputs": st.booleans(),
    }),
)
names = st.lists(st.text(max_size=6), max_size=3)
fsdp2s = st.builds(
    FSDP2,
    dim=identifiers,
    reshard_after_forward=st.one_of(st.none(), st.booleans(), st.integers(1, 2**63 - 1)),
    mixed_precision=mixed_precisions,
    offload=st.sampled_from(["none", "cpu"]),
    blocks=st.one_of(st.none(), st.text(max_size=10), st.lists(st.text(max_size=6), min_size=1,
                                                               max_size=3)),
    after=names,
    before=names,
)
meta_inits = st.builds(
    MetaInit,
    seed=st.integers(0, 2**63 - 1),
    device=st.one_of(st.none(), st.sampled_from(["cpu", "cuda", "cuda:1"]), st.text(max_size=6)),
    init_fn=st.one_of(st.none(), st.builds(lambda a, b: f"{a}:{b}", st.text(max_size=8),
                                           st.text(max_size=8))),
)
positive_floats = st.floats(min_value=0, exclude_min=True, allow_infinity=False)
topologies = st.one_of(st.none(), st.builds(
    Topology, st.integers(1, 64), st.integers(1, 64),
    intra_node_gbps=st.one_of(st.none(), positive_floats, st.integers(1, 10**6)),
    inter_node_gbps=st.one_of(st.none(), positive_floats),
))


@st.composite
def meshes(draw: st.DrawFn) -> MeshSpec:
    dims = draw(st.dictionaries(identifiers, st.integers(1, 16), max_size=4))
    if dims and draw(st.booleans()):
        dims[draw(st.sampled_from(sorted(dims)))] = -1
    return MeshSpec.from_pairs(dims)


timeouts = st.one_of(st.none(), st.integers(1, 10**9), st.floats(1e-3, 1e9))


@st.composite
def plans(draw: st.DrawFn) -> ParallelPlan:
    plan = ParallelPlan(draw(meshes()), topology=draw(topologies), timeout=draw(timeouts))
    for plugin in draw(st.lists(st.one_of(fsdp2s, meta_inits), max_size=4)):
        plan.use(plugin)
    return plan


@FUZZ
@given(plans())
def test_plans_round_trip(plan: ParallelPlan) -> None:
    assert_same_plan(plan, ParallelPlan.from_toml(dump_plan(plan), registry=REGISTRY))


@FUZZ
@given(st.text())
def test_any_string_is_written_as_a_toml_string_that_reads_back(text: str) -> None:
    assert tomllib.loads(f"{toml_key(text)} = {toml_string(text)}") == {text: text}


# Random plan-file data: near-misses of real files more often than pure noise.
scalars = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, -1, 1, 2, 8, 64, 2**31, 2**40, 2**63 - 1]),
    st.floats(allow_nan=True),
    st.text(max_size=8),
)
toml_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=3),
    max_leaves=8,
)
plugin_names = st.sampled_from(["fsdp2", "meta_init", "fsdp", "FSDP2", "metainit", "hsdp", "",
                                "tp", "compile"])
option_names = st.sampled_from([
    "dim", "reshard_after_forward", "reshard_after_foward", "mixed_precision", "offload",
    "blocks", "after", "before", "seed", "device", "init_fn", "initfn", "name", "nmae", "x",
])
plugin_entries = st.one_of(
    st.dictionaries(option_names, toml_values, max_size=4).flatmap(
        lambda opts: plugin_names.map(lambda n: {"name": n, **opts})),
    toml_values,
)
mesh_tables = st.one_of(
    st.dictionaries(st.one_of(identifiers, st.text(max_size=5)),
                    st.one_of(st.sampled_from([0, -1, 1, 2, 8, 2**40, -(2**63)]), toml_values),
                    max_size=4),
    toml_values,
)
topology_tables = st.one_of(
    st.dictionaries(st.sampled_from(["nodes", "devices_per_node", "intra_node_gbps",
                                     "inter_node_gbps", "node", "bandwidth"]),
                    st.one_of(st.sampled_from([0, -1, 1, 2, 8, 2**62]), toml_values), max_size=4),
    toml_values,
)
noise = st.fixed_dictionaries({}, optional={
    "mesh": mesh_tables,
    "topology": topology_tables,
    "plugins": st.one_of(st.lists(plugin_entries, max_size=3), toml_values),
    "mesj": toml_values,
    "plugin": toml_values,
})
keys = st.one_of(option_names, st.sampled_from(["mesh", "topology", "plugins", "nodes",
                                                "devices_per_node", "inter_node_gbps", "dp_shard",
                                                "tp", "dpshard"]))
values = st.one_of(st.sampled_from([0, -1, 1, 2, 8, 2**40, "fsdp2", "meta_init", "bf16"]),
                   toml_values)


@st.composite
def near_misses(draw: st.DrawFn) -> dict[str, Any]:
    """A valid plan's data with a few random edits: set, delete or rename a key."""
    data = tomllib.loads(dump_plan(draw(plans())))
    for _ in range(draw(st.integers(0, 3))):
        # Earlier edits may have replaced a table by a value: edit only what is a table.
        plugins = data.get("plugins") if isinstance(data.get("plugins"), list) else []
        tables = [t for t in (data, data.get("mesh"), data.get("topology"), *plugins)
                  if isinstance(t, dict)]
        table = draw(st.sampled_from(tables))
        action = draw(st.sampled_from(["set", "delete", "rename"]))
        if action == "set" or not table:
            table[draw(keys)] = draw(values)
        else:
            key = draw(st.sampled_from(sorted(table)))
            value = table.pop(key)
            if action == "rename":
                table[draw(keys)] = value
    return data


plan_data = st.one_of(near_misses(), noise)


def to_toml_document(data: dict[str, Any]) -> str:
    """Any dict as a TOML document: each top-level key with an inline value."""
    return "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in data.items())


def load_or_error(text: str) -> ParallelPlan | None:
    """The contract: a plan (which then validates and explains) or PlanFileError."""
    try:
        plan = ParallelPlan.from_toml(text, registry=REGISTRY)
    except PlanFileError as exc:
        assert exc.report.codes() and exc.report.exit_code() == 2
        return None
    world = plan.world_size()
    assert plan.validate(world_size=world).exit_code() in (0, 1)
    plan.explain(world_size=world)
    return plan


@FUZZ
@given(plan_data)
def test_random_structured_plan_files_never_crash(data: dict[str, Any]) -> None:
    load_or_error(to_toml_document(data))


@FUZZ
@given(st.one_of(
    st.text(),
    st.lists(st.sampled_from(["[mesh]", "[topology]", "[[plugins]]", "dp_shard = 8",
                              "tp = -1", "nodes = 2", "devices_per_node = 0", 'name = "fsdp2"',
                              'name = "fsd"', "seed = 1", "offload = 1", "x = [1, {a = 2}]",
                              "= 3", "[[mesh]]", '"a" = "b"', "dp_shard = 1e3"]),
             max_size=12).map("\n".join),
))
def test_random_toml_ish_text_never_crashes(text: str) -> None:
    if not text.endswith(".toml"):  # a one-line ".toml" string is read as a path
        load_or_error(text)
