"""``suggest``: the axes the installed plugins offer, the candidate layouts, what fits,
the ranking by predicted step time, and why the best has what it has and each
runner-up lost."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest

from composer_par import ParallelPlan, Registry, Role, Topology
from composer_par.estimate import ModelShape, MoEShape, Workload, estimate_plan, parse_bytes
from composer_par.plugin import (
    Claim,
    Collective,
    EstimatePart,
    Plugin,
    SuggestAxis,
    SuggestChoice,
    hookimpl,
)
from composer_par.tools.suggest import (
    Ranked,
    families,
    format_suggestion,
    plugin_axes,
    rank_key,
    suggest,
    why_best,
)
from tests.cli_run import run

GIB80 = parse_bytes("80GiB")
INSTALLED = set(Registry().names())
WORK = Workload(seq=4096, dtype="bf16")


def _axes(model: ModelShape, topology: Topology, notes: list[str] | None = None,
          work: Workload = WORK) -> Any:
    return plugin_axes(None, {}, model, topology, work, notes if notes is not None else [])


def _layouts(model: ModelShape, topology: Topology, batch: int, work: Workload = WORK
             ) -> list[Any]:
    axes = _axes(model, topology, work=work)
    return [c for family in families(axes, topology, model, work, batch, {}) for c in family]


# -- what the plugins offer ----------------------------------------------------------------

MOE = ModelShape.from_numbers(layers=4, hidden=256, heads=8, kv_heads=2, ffn_hidden=512,
                              vocab=1000, moe=MoEShape(num_experts=8, top_k=2, expert_ffn=128,
                                                       layers=(0, 1, 2, 3)))


def test_each_installed_plugin_offers_its_own_axis() -> None:
    """The core names no plugin: the axes are the plugins' answers, each with its dim,
    its place in the mesh and what it does."""
    notes: list[str] = []
    axes = {a.plugin: a for a in _axes(MOE, Topology(2, 8), notes)}
    expected = {"pp": "pp", "hsdp": "dp_replicate", "fsdp2": "dp_shard", "cp": "cp",
                "ep": "ep", "tp": "tp", "activation_checkpoint": None, "meta_init": None}
    for plugin, dim in expected.items():
        if plugin in INSTALLED:
            assert axes[plugin].dim == dim, plugin
    dims = [a.dim for a in sorted(axes.values(), key=lambda a: a.order) if a.dim]
    assert dims == [d for d in ("pp", "dp_replicate", "dp_shard", "cp", "ep", "tp")
                    if d in dims]
    if "activation_checkpoint" in INSTALLED:
        assert axes["activation_checkpoint"].first_fit
    assert axes["ep"].folded and axes["ep"].samples and axes["cp"].folded
    assert not axes["cp"].samples and axes["fsdp2"].samples
    # a dense model: EP offers nothing
    dense = ModelShape.from_numbers(params=7_000_000_000, layers=32, hidden=4096)
    assert "ep" not in {a.plugin for a in _axes(dense, Topology(2, 8))}


def test_candidates_cover_every_combination_that_fills_the_world() -> None:
    model = ModelShape.from_numbers(params=7_000_000_000, layers=32, hidden=4096, heads=32,
                                    kv_heads=8)
    found = _layouts(model, Topology(4, 8), batch=32)
    sizes = {(c.size("pp"), c.size("dp_replicate"), c.size("dp_shard"), c.size("cp"),
              c.size("tp")) for c in found}
    assert (1, 1, 32, 1, 1) in sizes and (1, 4, 8, 1, 1) in sizes and (1, 32, 1, 1, 1) in sizes
    assert (1, 4, 4, 1, 2) in sizes and (1, 1, 4, 1, 8) in sizes and (4, 1, 8, 1, 1) in sizes
    assert all(p * r * s * c * t == 32 for p, r, s, c, t in sizes)
    # TP sizes divide the devices of a node and the head counts
    odd = ModelShape.from_numbers(params=1_000_000_000, layers=8, hidden=1536, heads=12,
                                  kv_heads=4)
    assert {c.size("tp") for c in _layouts(odd, Topology(2, 8), batch=16)} == {1, 2, 4}
    # the global batch must split evenly over the data shards, each its micro-batches
    assert all(32 % (c.size("dp_replicate") * c.size("dp_shard")) == 0 for c in found)
    assert all(c.passes * c.size("dp_replicate") * c.size("dp_shard") == 32 for c in found)


def test_first_fit_axes_make_families_fastest_first() -> None:
    """A family differs only in activation checkpointing's mode, from none to full."""
    if "activation_checkpoint" not in INSTALLED:
        pytest.skip("activation_checkpoint is not installed")
    model = ModelShape.from_numbers(params=7_000_000_000, layers=32, hidden=4096)
    axes = _axes(model, Topology(1, 8))
    all_families = list(families(axes, Topology(1, 8), model, WORK, 8, {}))
    family = next(f for f in all_families if f[0].size("tp") == f[0].size("cp") == 1)
    assert [c.label().split(" + ")[-1] for c in family][1:] == ["AC selective", "AC full"]
    assert [c.preference for c in family] == [0, 1, 3]
    # with a model-parallel dim (tensor or context parallelism here), selective that
    # issues the collectives again comes between
    for dim in ("tp", "cp"):
        mp_family = next(f for f in all_families if f[0].size(dim) > 1)
        assert [c.label().split(" + ")[-1] for c in mp_family][1:] == [
            "AC selective", "AC selective save=matmul", "AC full"], dim
        assert [c.preference for c in mp_family] == [0, 1, 2, 3]
        assert dict(mp_family[2].plugins())["activation_checkpoint"] == {
            "mode": "selective", "save": ["matmul"]}


def test_no_layout_joins_what_validation_refuses_together() -> None:
    """A schedule whose backward runs twice (tagged split_backward) never comes with
    selective checkpointing, which allows one recompute (CP606); 1F1B still does."""
    if not {"pp", "activation_checkpoint"} <= INSTALLED:
        pytest.skip("pp or activation_checkpoint is not installed")
    model = ModelShape.from_numbers(params=7_000_000_000, layers=32, hidden=4096)
    topology = Topology(2, 8)

    def modes(schedule: str) -> set[str]:
        axes = plugin_axes(None, {"pp": {"schedule": schedule}}, model, topology, WORK, [])
        return {dict(c.plugins()).get("activation_checkpoint", {}).get("mode", "none")
                for family in families(axes, topology, model, WORK, 64, {})
                for c in family if c.size("pp") > 1}

    assert modes("ZBVZeroBubble") == {"none", "full"}
    assert modes("1F1B") == {"none", "selective", "full"}


def test_candidate_meshes_and_plugins() -> None:
    model = ModelShape.from_numbers(params=7_000_000_000, layers=32, hidden=4096, heads=32)
    c = next(c for c in _layouts(model, Topology(4, 8), batch=32)
             if (c.size("dp_replicate"), c.size("dp_shard"), c.size("tp")) == (4, 2, 4)
             and c.label().endswith("AC full"))
    assert c.mesh().to_dict() == {"dp_replicate": 4, "dp_shard": 2, "tp": 4}
    assert [n for n, _ in c.plugins()] == ["hsdp", "fsdp2", "tp", "activation_checkpoint",
                                           "meta_init"]
    assert dict(c.plugins())["tp"] == {"sequence_parallel": True}
    assert dict(c.plugins())["fsdp2"] == {"mixed_precision": "bf16"}
    assert c.label() == "replicate 4 + FSDP 2 + TP 4 + AC full"
    assert c.passes == 32 // 8


# -- the ranking ----------------------------------------------------------------------------


def test_slow_inter_node_links_keep_the_shard_dim_inside_a_node() -> None:
    """13B on 4 nodes of 8, 100 Gbit/s between nodes, no pipelines: sharding over all
    32 ranks sends every all-gather across nodes; replicating across nodes and sharding
    inside them is faster, and the reasons say so."""
    model = ModelShape.from_numbers(params=13_000_000_000)
    result = suggest(model, Topology(4, 8), GIB80, seq=4096, global_batch=256,
                     inter_node_gbps=100, max_sizes={"pp": 1})
    best = result.best
    assert best is not None and best.candidate.size("dp_shard") <= 8
    assert best.candidate.size("dp_replicate") * best.candidate.size("dp_shard") \
        * best.candidate.size("cp") * best.candidate.size("tp") == 32
    fsdp = next(r for r in result.ranked if r.candidate.size("dp_shard") == 32
                and r.candidate.label() == "FSDP 32")
    assert fsdp.fits and fsdp.reason.startswith("slower:")
    assert "dp_shard(32) all-gathers, reduce-scatters across nodes" in fsdp.reason
    # with links between nodes as fast as inside them, sharding over more nodes wins
    fast = suggest(model, Topology(4, 8), GIB80, seq=4096, global_batch=256,
                   inter_node_gbps=900, max_sizes={"pp": 1})
    assert fast.best is not None and fast.best.candidate.size("dp_shard") > 8


def test_adds_tp_when_activations_do_not_fit() -> None:
    model = ModelShape.from_numbers(params=7_000_000_000, layers=32, hidden=4096, heads=32)
    # without the cp plugin (with it, CP splits the sequence instead: see below)
    result = suggest(model, Topology(2, 8), GIB80, seq=262_144, registry=Registry(block=["cp"]))
    best = result.best
    assert best is not None and best.candidate.size("tp") > 1
    why = next(line for line in result.why if line.startswith(f"TP {best.candidate.size('tp')}:"))
    assert "no layout without it fits" in why and "activations" in why
    plan = result.plan_toml or ""
    assert 'name = "tp"' in plan and "sequence_parallel = true" in plan


def test_adds_tp_when_a_block_s_parameters_do_not_fit() -> None:
    # one enormous block: gathering it unsharded (FSDP's working set) does not fit
    model = ModelShape.from_numbers(layers=1, hidden=65536, heads=512)
    result = suggest(model, Topology(8, 8), GIB80, seq=2048)
    best = result.best
    assert best is not None and best.candidate.size("tp") > 1
    why = next(line for line in result.why if line.startswith("TP"))
    assert "no layout without it fits" in why and "communication buffers" in why


def test_nothing_fits() -> None:
    model = ModelShape.from_numbers(params=175_000_000_000)
    result = suggest(model, Topology(1, 8), GIB80, seq=2048)
    assert result.best is None and result.plan_toml is None
    assert all(r.reason.startswith("does not fit") for r in result.ranked)
    assert any("no layout fits" in note for note in result.notes)
    assert "best plan:" not in format_suggestion(result)


def test_runners_up_say_why_they_lost_and_are_ranked_by_step_time() -> None:
    model = ModelShape.from_numbers(params=13_000_000_000)
    result = suggest(model, Topology(4, 8), GIB80, seq=4096, inter_node_gbps=100)
    reasons = [r.reason for r in result.ranked[1:]]
    assert any(r.startswith("slower:") for r in reasons)
    assert any(r.startswith("does not fit: needs") for r in reasons)
    # fitting layouts first, by predicted step time (to 3 significant digits)
    seconds = [float(f"{r.seconds:.3g}") for r in result.ranked if r.fits]
    assert seconds == sorted(seconds)
    assert [r.fits for r in result.ranked] == sorted((r.fits for r in result.ranked),
                                                     reverse=True)
    # a step's parts add up: compute, what is exposed, a bubble's idle time
    for r in result.ranked[:20]:
        step = r.estimate.step
        assert step.seconds >= step.compute_seconds + step.exposed_seconds


def test_the_ranking_is_that_of_estimating_each_layout() -> None:
    """suggest's fitting layouts, their order and the best are those of estimating every
    layout of the space by itself (estimate_plan on the plan each stands for), from the
    fastest choice of a first-fit axis to the first that fits; why the best won is
    explained from those estimates."""
    model, topology, memory = MOE, Topology(2, 4), 96 * 2**20
    work = Workload(seq=4096, micro_batch=1, dtype="bfloat16", reduce_dtype="float32")
    reference = []
    for family in families(_axes(model, topology, work=work), topology, model, work,
                           topology.world_size, {}):
        for candidate in family:
            plan = ParallelPlan(candidate.mesh(), topology=topology)
            for name, options in candidate.plugins():
                plan.use(Registry().get(name)(**options))
            accumulate = 1 if candidate.runs_passes else candidate.passes
            est = estimate_plan(plan, model, attrs.evolve(
                work, grad_accum=accumulate, sync="every" if accumulate > 1 else "last"),
                world_size=topology.world_size, device_memory=memory, device="h100")
            reference.append(Ranked(candidate, est))
            if est.fits:
                break
    fitting = sorted((r for r in reference if r.fits), key=rank_key)
    assert fitting and any(not r.fits for r in reference)  # the memory decides something

    def row(r: Ranked) -> tuple[Any, ...]:
        return (r.candidate.key(), r.seconds, r.estimate.memory.total)

    result = suggest(model, topology, memory, seq=4096)
    assert [row(r) for r in result.ranked] == [row(r) for r in fitting] + [
        row(r) for r in sorted((r for r in reference if not r.fits),
                               key=lambda r: r.estimate.memory.total)]
    assert result.best is not None and row(result.best) == row(fitting[0])
    assert list(result.why) == why_best(fitting[0], reference, memory)


@attrs.frozen
class Zigzag(Plugin):
    """A third-party model-parallel plugin: claims ``zz``, states its own collectives, and
    offers suggest its dim at size 2 only."""

    name: ClassVar[str] = "zigzag"

    def claims(self) -> tuple[Claim, ...]:
        return (Claim("zz", Role.MODEL_PARALLEL),)

    @hookimpl
    def composer_par_estimate(self, layout: Any, workload: Any) -> EstimatePart | None:
        if "zz" not in layout.mesh or layout.mesh.size("zz") < 2:
            return None
        return EstimatePart(collectives=(Collective("zz", "all_reduce", 10**9, 1, "zigzag"),))

    @hookimpl
    def composer_par_suggest(self) -> list[SuggestAxis]:
        def choices(ctx: Any) -> list[SuggestChoice]:
            return [SuggestChoice("ZZ 2", {})] if ctx.size("zz") == 2 else [SuggestChoice()]

        return [SuggestAxis(self.name, "zz", 45, (2,), choices, role=Role.MODEL_PARALLEL)]


def test_a_third_party_plugin_s_axis_is_tried_and_priced() -> None:
    """A plugin registered beside the built-ins offers its dim; suggest tries it in every
    combination and prices it through the plugin's own terms."""
    registry = Registry(extra=[Zigzag])
    model = ModelShape.from_numbers(params=1_000_000_000, layers=16, hidden=2048, heads=16)
    result = suggest(model, Topology(1, 8), GIB80, seq=2048, registry=registry)
    zz = [r for r in result.ranked if r.candidate.size("zz") == 2]
    assert zz and all("ZZ 2" in r.candidate.label() for r in zz)
    for r in zz:
        (traffic,) = [t for t in r.estimate.traffic if t.dim.name == "zz"]
        assert traffic.payload == 10**9
    assert {r.candidate.size("zz") for r in result.ranked} == {1, 2}


# -- the command ---------------------------------------------------------------------------

ARGV = ["suggest", "--params", "13e9", "--nodes", "4", "--devices-per-node", "8",
        "--device-memory", "80GiB", "--inter-node-gbps", "100", "--seq", "4096",
        "--global-batch", "256", "--max-size", "pp=1"]


def test_suggest_command_text(tmp_path: Path) -> None:
    output = tmp_path / "best.toml"
    code, out, _ = run([*ARGV, "--top", "3", "--output", str(output)])
    assert code == 0
    assert "best plan:" in out and "```toml" in out and "candidates (best first):" in out
    assert "WHY NOT" in out and "TOKENS/S/DEV" in out and f"plan file written to {output}" in out
    text = output.read_text()
    assert "[mesh]" in text and "inter_node_gbps = 100" in text
    if {"hsdp", "fsdp2", "meta_init"} <= INSTALLED:
        plan = ParallelPlan.from_toml(text)
        assert plan.validate(world_size=32).ok
        assert plan.topology == Topology(4, 8, inter_node_gbps=100.0)


def test_suggest_command_json_and_exit_codes() -> None:
    code, out, _ = run([*ARGV, "--json"])
    data = json.loads(out)
    assert code == 0 and data["ok"] and data["exit_code"] == 0
    assert data["global_batch"] == 256
    assert data["estimate"]["step_time"]["seconds"] == data["best"]["step_seconds"]
    assert data["candidates"][0]["reason"] == ""
    assert all("pp" not in c["mesh"] for c in data["candidates"])  # --max-size pp=1
    code, out, _ = run(["suggest", "--params", "175e9", "--nodes", "1", "--devices-per-node",
                        "8", "--device-memory", "80GiB", "--seq", "2048", "--json"])
    assert code == 1 and json.loads(out)["best"] is None
    for bad in (["--device-memory", "lots"], ["--nodes", "0"], ["--max-size", "tp"]):
        argv = [*ARGV]
        argv[argv.index(bad[0]) + 1] = bad[1]
        assert run(argv)[0] == 2
    assert run(["suggest", "--nodes", "4", "--devices-per-node", "8", "--device-memory",
                "80GiB", "--seq", "4096"])[0] == 2  # no model
    assert run([*ARGV, "--option", "nosuch.x=1"])[0] == 2
    assert run([*ARGV, "--option", "pp"])[0] == 2


def test_options_reach_the_plugins_suggest_makes() -> None:
    """--option PLUGIN.OPTION=VALUE makes the plugin with it in every layout it joins."""
    code, out, _ = run([*ARGV[:-2], "--option", "fsdp2.reshard_after_forward=false",
                        "--json"])
    data = json.loads(out)
    assert code == 0
    fsdp2 = [p for c in data["candidates"] for p in c["plugins"] if p["name"] == "fsdp2"]
    assert fsdp2 and all(p["reshard_after_forward"] is False for p in fsdp2)


@pytest.mark.skipif("tp" not in INSTALLED, reason="the tp plugin is not installed")
def test_suggest_with_a_model() -> None:
    code, out, _ = run(["suggest", "--model", "tests.dryrun_models:llama_1b", "--nodes", "2",
                        "--devices-per-node", "8", "--device-memory", "24GiB", "--seq", "8192",
                        "--json"])
    data = json.loads(out)
    assert code == 0 and data["model"]["kv_heads"] == 4
    # TP sizes must divide the 4 KV heads: no TP 8 candidate
    assert all(c["mesh"].get("tp", 1) <= 4 for c in data["candidates"])


# -- context parallelism -----------------------------------------------------------------

# Llama 3 8B's shape (as docs/estimate.md gives it to suggest)
LLAMA_8B = ModelShape.from_numbers(params=8_000_000_000, layers=32, hidden=4096, heads=32,
                                   kv_heads=8, ffn_hidden=14336, vocab=128256)


@pytest.mark.skipif("cp" not in INSTALLED, reason="the cp plugin is not installed")
def test_cp_sizes_cut_the_sequence_and_alltoall_divides_the_heads() -> None:
    found = _layouts(LLAMA_8B, Topology(8, 8), batch=64, work=Workload(seq=131_072))
    cp = [c for c in found if c.size("cp") > 1]
    # 2 x cp divides the sequence, each rank keeping at least 2048 tokens
    assert {c.size("cp") for c in cp} == {2, 4, 8, 16, 32, 64}
    # alltoall where cp divides a tp rank's heads (32 / tp) and K/V heads (8 / tp)
    alltoall = {(c.size("tp"), c.size("cp")) for c in cp if "alltoall" in c.label()}
    assert (1, 8) in alltoall and (2, 4) in alltoall and (4, 2) in alltoall
    assert (2, 8) not in alltoall and (8, 2) not in alltoall
    short = _layouts(LLAMA_8B, Topology(8, 8), batch=64, work=Workload(seq=4096))
    assert {c.size("cp") for c in short} == {1, 2}


@pytest.mark.skipif("cp" not in INSTALLED, reason="the cp plugin is not installed")
def test_suggests_cp_for_llama_8b_at_128k_tokens_on_8_nodes() -> None:
    """No layout without CP fits 64 GiB (the smallest needs its activations' ~73 GiB);
    suggest proposes CP, and the plan file it writes reads back and validates."""
    gib64 = parse_bytes("64GiB")
    result = suggest(LLAMA_8B, Topology(8, 8), gib64, seq=131_072)
    without = [r for r in result.ranked if r.candidate.size("cp") == 1]
    assert without and not any(r.fits for r in without)
    best = result.best
    assert best is not None and best.candidate.size("cp") > 1
    assert best.estimate.memory.total <= gib64
    # a cp rank's activations are those of seq / cp tokens
    assert best.estimate.layout.sequence_split == best.candidate.size("cp")
    why = next(line for line in result.why if line.startswith(f"CP {best.candidate.size('cp')}"))
    assert "no layout without it fits" in why
    plan_toml = result.plan_toml or ""
    assert f"cp = {best.candidate.size('cp')}" in plan_toml and 'name = "cp"' in plan_toml
    assert "seq_len = 131072" in plan_toml
    if {"cp", "hsdp", "fsdp2", "activation_checkpoint", "meta_init"} <= INSTALLED:
        assert result.report is not None and result.report.ok
        plan = ParallelPlan.from_toml(plan_toml)
        assert plan.validate(world_size=64).ok
        assert plan.world_size() == 64
    # with room for a layout without CP (PP 8 x TP 8 needs ~210 GiB: without loss
    # parallelism each rank's loss holds three fp32 copies of 128k tokens' logits at the
    # whole vocabulary), CP is still faster than every layout without it
    roomy = suggest(LLAMA_8B, Topology(8, 8), parse_bytes("256GiB"), seq=131_072)
    assert any(r.fits and r.candidate.size("cp") == 1 for r in roomy.ranked)
    assert roomy.best is not None and roomy.best.candidate.size("cp") > 1
    fastest_without = min((r for r in roomy.ranked if r.fits and r.candidate.size("cp") == 1),
                          key=lambda r: r.seconds)
    assert roomy.best.seconds < fastest_without.seconds


# -- progress ------------------------------------------------------------------------------


def test_progress_counts_every_layout() -> None:
    """suggest reports (done, total) after each family: done grows to the total, which
    counts every layout of the space (those estimated and the leaner ones passed over)."""
    seen: list[tuple[int, int]] = []
    result = suggest(MOE, Topology(2, 4), GIB80, seq=4096,
                     progress=lambda done, total: seen.append((done, total)))
    total = len(_layouts(MOE, Topology(2, 4), 8, Workload(seq=4096, dtype="bfloat16",
                                                          reduce_dtype="float32")))
    assert seen and {t for _, t in seen} == {total} and result.layouts == total
    dones = [d for d, _ in seen]
    assert dones == sorted(dones) and dones[-1] == total
    assert len(result.ranked) < total  # the leaner choices past a fit are not estimated
    assert f"({total - len(result.ranked)} more not estimated" in format_suggestion(result)


def test_progress_line_goes_to_stderr_only() -> None:
    from composer_par.cli.plan_tools import LayoutProgress

    stream = io.StringIO()
    progress = LayoutProgress(stream, quiet_for=0.0)
    for done in range(0, 101, 5):
        progress(done, 100)
    progress.close()
    lines = stream.getvalue().splitlines()
    # not a terminal: one line per tenth, then how long it took
    assert lines[0] == "suggest: 0 of 100 layouts (0%)"
    assert lines[-2] == "suggest: 100 of 100 layouts (100%)" and len(lines) == 12
    assert lines[-1].startswith("suggest: done in ")
    quiet = io.StringIO()
    progress = LayoutProgress(quiet)  # a search shorter than a second says nothing
    progress(50, 100)
    progress.close()
    assert quiet.getvalue() == ""
    # under --json, stdout is the JSON document alone
    code, out, _ = run([*ARGV, "--json", "--no-progress"])
    assert code == 0 and json.loads(out)["layouts"] >= len(json.loads(out)["candidates"])
