"""The estimate of a pipeline plan: per-stage memory against the split and the whole model,
the bubble and the activations in flight against the schedule's timeline, point-to-point
bytes against a hand computation and the topology, ``suggest`` choosing a pipeline where
the inter-node links are slow, and (on real gloo ranks) the sends and FSDP2 collectives of
a pipeline step against the estimate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
from composer_par.plugins.pp.estimate import gathers, held_moments, lowered_order
from composer_par.plugins.pp.schedules import SCHEDULES, placement
from composer_par.plugins.pp.timeline import peak_in_flight, theoretical_bubble, timeline

from composer_par import FSDP2, PP, MeshSpec, ParallelPlan, Registry, Role, Topology
from composer_par.estimate import (
    EstimateError,
    Layout,
    ModelShape,
    Workload,
    estimate,
    estimate_plan,
    parse_bytes,
)
from composer_par.plugin import Plugin, hookimpl
from composer_par.tools.suggest import format_suggestion, suggest
from tests.cli_run import run

ROOT = Path(__file__).resolve().parent.parent
INSTALLED = set(Registry().names())
GIB80 = parse_bytes("80GiB")
pytestmark = pytest.mark.skipif("pp" not in INSTALLED, reason="the pp plugin is not installed")


def pp_layout(mesh: MeshSpec, topology: Topology | None = None, **options: Any) -> Layout:
    roles = {"pp": Role.OTHER, "dp_replicate": Role.REPLICATE, "dp_shard": Role.SHARD,
             "tp": Role.MODEL_PARALLEL}
    owners = {"pp": "pp", "dp_replicate": "hsdp", "dp_shard": "fsdp2", "tp": "tp"}
    return Layout.build(mesh, topology, {n: roles[n] for n in mesh.names},
                        {n: owners[n] for n in mesh.names}, **options)


def pp_estimate(pp: PP, mesh: MeshSpec, model: ModelShape, workload: Workload,
                topology: Topology | None = None, **options: Any) -> Any:
    """``pp`` over ``mesh``, with the data-parallel plugins of its other dims."""
    plan = ParallelPlan(mesh).use(pp)
    if "dp_shard" in mesh:
        plan.use(FSDP2())
    return estimate(pp_layout(mesh, topology, **options), model, workload, plan=plan)


def meta_model(task: str = "llama8") -> Any:
    import torch

    import tests.pp_workers as workers

    with torch.device("meta"):
        return getattr(workers, task).build()


# -- per-stage memory -----------------------------------------------------------------------


@pytest.mark.parametrize("task", ["llama8", "hf_style"])
@pytest.mark.parametrize(("schedule", "pp", "per_rank"),
                         [("1F1B", 4, 1), ("Interleaved1F1B", 2, 2), ("ZBVZeroBubble", 2, 2)])
def test_stage_parameters_are_the_split_s(task: str, schedule: str, pp: int,
                                          per_rank: int) -> None:
    """The estimate splits the model shape as the plugin splits the model: the same
    parameters on each stage, the embedding with the first and the head with the last."""
    from composer_par.blocks import find_blocks

    model = meta_model(task)
    shape = ModelShape.from_module(model)
    plugin = PP(schedule=schedule, stages_per_rank=per_rank, microbatches=4)
    split = plugin.compute_split(model, find_blocks(model), pp)
    est = pp_estimate(plugin, MeshSpec(pp=pp), shape, Workload(seq=8))
    assert est.pipeline is not None
    by_stage = {label: None for r in est.ranks for label in r.stages}
    assert len(by_stage) == pp * per_rank
    layout = placement(pp, pp * per_rank, SCHEDULES[schedule].style)
    for r in est.ranks:
        assert r.stages == tuple(f"stage {s}" for s in layout[r.coordinate])
        assert r.params == sum(split.params[s] for s in layout[r.coordinate])
        assert r.blocks == sum(len(split.blocks[s]) for s in layout[r.coordinate])
    assert sum(r.params for r in est.ranks) == shape.params


@pytest.mark.parametrize(("task", "per_rank"), [("llama8", 5), ("hf_style", 3)])
def test_past_one_block_a_stage_the_ends_are_stages_as_in_the_split(task: str,
                                                                     per_rank: int) -> None:
    """Two stages more than blocks: the estimate's first and last stages hold only the
    embedding and only the norm and head, as the plugin's split makes them."""
    from composer_par.blocks import find_blocks

    model = meta_model(task)
    shape = ModelShape.from_module(model)
    plugin = PP(schedule="Interleaved1F1B", stages_per_rank=per_rank, microbatches=4)
    split = plugin.compute_split(model, find_blocks(model), 2)
    assert split.blocks[0] == split.blocks[-1] == ()
    est = pp_estimate(plugin, MeshSpec(pp=2), shape, Workload(seq=8))
    assert est.pipeline is not None
    layout = placement(2, 2 * per_rank, SCHEDULES["Interleaved1F1B"].style)
    for r in est.ranks:
        assert r.params == sum(split.params[s] for s in layout[r.coordinate])
        assert r.blocks == sum(len(split.blocks[s]) for s in layout[r.coordinate])
    stages = [s for r in est.pipeline.ranks for s in r.stages]
    assert sorted(s.model.layers for s in stages).count(0) == 2


def test_an_explicit_split_is_followed_by_name() -> None:
    from composer_par.blocks import find_blocks

    model = meta_model()
    shape = ModelShape.from_module(model)
    stages = [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3"],
              ["layers.4", "layers.5"], ["layers.6", "layers.7", "norm", "output"]]
    plugin = PP(schedule="GPipe", microbatches=4, split=stages)
    split = plugin.compute_split(model, find_blocks(model), 4)
    est = pp_estimate(plugin, MeshSpec(pp=4), shape, Workload(seq=8))
    assert [r.params for r in est.ranks] == list(split.params)
    assert [r.blocks for r in est.ranks] == [1, 3, 2, 2]


def test_stage_memory_sums_to_the_whole_model_s() -> None:
    """Sharded parameters and optimizer states of the pp ranks add up to the whole model's
    under the same sharding; the gradients a stage accumulates are unsharded, in the
    reduce dtype, through the step."""
    shape = ModelShape.from_module(meta_model())
    workload = Workload(seq=8, dtype="float32")
    plain = estimate(pp_layout(MeshSpec(dp_shard=2).resolve(2)), shape, workload,
                     plan=ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()))
    est = pp_estimate(PP(schedule="1F1B", microbatches=4), MeshSpec(pp=4, dp_shard=2), shape,
                      workload)
    assert sum(r.memory.params for r in est.ranks) == plain.memory.params
    assert sum(r.memory.optimizer for r in est.ranks) == plain.memory.optimizer
    assert sum(r.memory.local_params for r in est.ranks) == plain.memory.local_params
    assert sum(r.memory.grads for r in est.ranks) == shape.params * 4
    assert est.memory == max((r.memory for r in est.ranks), key=lambda m: m.total)
    # without a shard dim nothing changes: the gradients are whole anyway
    alone = pp_estimate(PP(schedule="1F1B", microbatches=4), MeshSpec(pp=4), shape, workload)
    whole = estimate(pp_layout(MeshSpec(dp_shard=1).resolve(1)), shape, workload)
    assert sum(r.memory.grads for r in alone.ranks) == whole.memory.grads


def test_a_shape_from_numbers_splits_its_embedding_and_head_between_the_ends() -> None:
    shape = ModelShape.from_numbers(layers=8, hidden=512, heads=4, vocab=1000)
    est = pp_estimate(PP(schedule="1F1B", microbatches=8), MeshSpec(pp=4), shape,
                      Workload(seq=128))
    assert sum(r.params for r in est.ranks) == shape.params
    ends = [r.params - r.blocks * (shape.params - 2 * 1000 * 512 - 512) // 8
            for r in est.ranks]
    assert ends[1] == ends[2] == 0 and ends[0] > 0 and ends[3] > 0
    assert abs(ends[0] - ends[3]) <= 512
    assert any("half are counted on the first stage" in n for n in est.notes)


# -- activations in flight and the bubble -------------------------------------------------


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_bubble_and_in_flight_are_the_timeline_s(schedule: str) -> None:
    info = SCHEDULES[schedule]
    pp, per_rank, microbatches = 2, info.stages_per_rank or 2, 8
    shape = ModelShape.from_numbers(layers=8, hidden=256, heads=2)
    est = pp_estimate(PP(schedule=schedule, stages_per_rank=per_rank,
                         microbatches=microbatches), MeshSpec(pp=pp), shape, Workload(seq=64))
    assert est.pipeline is not None
    line = timeline(schedule, pp, per_rank, microbatches)
    assert est.pipeline.bubble == line.bubble
    assert est.pipeline.microbatches == microbatches
    if not info.split_backward:
        assert est.pipeline.bubble == pytest.approx(
            theoretical_bubble(schedule, pp, per_rank, microbatches))
    peaks = peak_in_flight(line)
    layout = placement(pp, pp * per_rank, info.style)
    for rank, r in enumerate(est.ranks):
        assert r.in_flight == peaks[rank]
        moments = held_moments(line, rank, layout[rank])
        # the heaviest moments hold the timeline's count of stage-microbatches
        assert max(sum(m) for m in moments) == peaks[rank]
    data = est.to_dict()["pipeline"]
    assert data["bubble"] == line.bubble and data["dim"] == "pp"
    assert [r["in_flight"] for r in data["ranks"]] == list(peaks)


def test_activations_of_the_microbatches_in_flight_by_hand() -> None:
    """1F1B over 4 ranks holds pp - rank microbatches; each is s*b*h*34 bytes per block
    (16-bit, SDPA), and the last stage's also its fp32 logits."""
    s, b, h, vocab = 128, 2, 512, 1000
    shape = ModelShape.from_numbers(layers=8, hidden=h, heads=4, vocab=vocab)
    est = pp_estimate(PP(schedule="1F1B", microbatches=8), MeshSpec(pp=4), shape,
                      Workload(seq=s, micro_batch=b, dtype="bf16"))
    for r in est.ranks:
        held = 4 - r.coordinate
        assert r.in_flight == held
        one = r.blocks * s * b * h * 34 + (s * b * vocab * 4 if r.coordinate == 3 else 0)
        assert r.memory.activations == held * one
    # full checkpointing keeps 2*s*b*h per block and microbatch, + one block recomputed
    full = pp_estimate(PP(schedule="1F1B", microbatches=8), MeshSpec(pp=4), shape,
                       Workload(seq=s, micro_batch=b, dtype="bf16", activation_checkpoint="full"))
    r0 = full.ranks[0]
    assert r0.memory.activations == 4 * r0.blocks * 2 * s * b * h + s * b * h * 34
    # GPipe holds every microbatch
    gpipe = pp_estimate(PP(schedule="GPipe", microbatches=8), MeshSpec(pp=4), shape,
                        Workload(seq=s, micro_batch=b, dtype="bf16"))
    assert [r.in_flight for r in gpipe.ranks] == [8, 8, 8, 8]


def test_fsdp_gathers_follow_the_rank_s_order() -> None:
    # 1F1B, rank 0 of 2, 4 microbatches: F0 F1 B0 F2 B1 F3 B2 B3
    order = [("FORWARD", 0), ("FORWARD", 0), ("FULL_BACKWARD", 0), ("FORWARD", 0),
             ("FULL_BACKWARD", 0), ("FORWARD", 0), ("FULL_BACKWARD", 0), ("FULL_BACKWARD", 0)]
    # resharded after each forward: F0 F1 gather; each backward after a forward gathers;
    # a forward after a backward finds the parameters gathered, the last B3 too
    assert gathers(order, 0, resharded=True) == 5
    assert gathers(order, 0, resharded=False) == 1
    assert gathers(order, 1, resharded=True) == 0
    # the multi-stage runtime unshards a stage itself first
    assert gathers([("UNSHARD", 0), *order], 0, resharded=True) == 1 + 4


def test_accumulation_is_more_microbatches_in_one_pass_as_measured() -> None:
    """``grad_accum=k`` is the training step's ``accumulate=k``: one schedule pass over k
    times the microbatches, one reduce-scatter per unit. The counts are those
    tests/test_accumulation.py measures on gloo (pp 2 x dp_shard 2, 1F1B, 2
    microbatches, the 4-block Llama: 3 units a stage), on every pp rank."""
    import torch

    from tests.accumulation_workers import PP_PLANS
    from tests.pp_workers import llama4

    with torch.device("meta"):
        shape = ModelShape.from_module(llama4.build())
    plan = ParallelPlan.from_toml(PP_PLANS["pp_fsdp2"])
    measured = {1: {"all_gather": 7, "reduce_scatter": 3},
                2: {"all_gather": 11, "reduce_scatter": 3}}
    for k, calls in measured.items():
        est = estimate_plan(plan, shape, Workload(seq=8, grad_accum=k), world_size=4)
        assert est.pipeline is not None and est.pipeline.microbatches == 2 * k
        for rank in est.ranks:
            dims = {t.dim.name: t.calls() for t in rank.traffic}
            assert dims["dp_shard"] == calls, (k, rank.coordinate)
            assert dims["pp"] == {"send": 2 * k}  # one activation or gradient a microbatch
        # a pipeline has no policies to compare: its schedule reduces once per step
        assert est.accumulation == ()
    with pytest.raises(EstimateError, match="once per step"):
        estimate_plan(plan, shape, Workload(seq=8, grad_accum=2, sync="every"), world_size=4)


# -- point-to-point -------------------------------------------------------------------------


def test_point_to_point_bytes_by_hand_and_across_nodes() -> None:
    """pp 4 x dp_shard 2 on 2 nodes of 4: pp ranks 0, 1 on node 0, 2, 3 on node 1. Per
    microbatch a stage sends s*b*h activations on and as many gradient bytes back."""
    s, b, h, m = 128, 2, 512, 8
    x = s * b * h * 2  # bf16
    shape = ModelShape.from_numbers(layers=8, hidden=h, heads=4, vocab=1000)
    mesh = MeshSpec(pp=4, dp_shard=2)
    topology = Topology(2, 4)
    est = pp_estimate(PP(schedule="1F1B", microbatches=m), mesh, shape,
                      Workload(seq=s, micro_batch=b, dtype="bf16"), topology)
    sends = {r.coordinate: {c.why.split(" (")[0]: (c.payload, c.calls, c.nodes)
                            for c in r.sends} for r in est.ranks}
    assert sends == {
        0: {"activations of stage 0 to stage 1": (m * x, m, 1)},
        1: {"activations of stage 1 to stage 2": (m * x, m, 2),
            "input gradients of stage 1 to stage 0": (m * x, m, 1)},
        2: {"activations of stage 2 to stage 3": (m * x, m, 1),
            "input gradients of stage 2 to stage 1": (m * x, m, 2)},
        3: {"input gradients of stage 3 to stage 2": (m * x, m, 1)},
    }
    # which peers cross nodes, as the topology places them
    resolved = mesh.resolve(8)
    for group in resolved.rank_groups("pp"):
        assert [topology.node_of(rank) for rank in group] == [0, 0, 1, 1]
    assert [(r.send_intra_bytes, r.send_inter_bytes) for r in est.ranks] == [
        (m * x, 0), (m * x, m * x), (m * x, m * x), (m * x, 0)]
    data = est.to_dict()["pipeline"]["point_to_point_per_step"]
    assert data["per_pipeline"] == {"intra_node_bytes": 4 * m * x, "inter_node_bytes": 2 * m * x}
    assert data["pipelines"] == 2
    assert data["all_pipelines"] == {"intra_node_bytes": 8 * m * x,
                                     "inter_node_bytes": 4 * m * x}
    # the slowest rank's table times the sends at the bandwidths
    pp_dim = next(t for t in est.slowest.traffic if t.dim.name == "pp")
    assert pp_dim.intra_bytes == m * x and pp_dim.inter_bytes == m * x
    # pp innermost: each pipeline stays on one node
    inner = pp_estimate(PP(schedule="1F1B", microbatches=m), MeshSpec(dp_shard=2, pp=4),
                        shape, Workload(seq=s, micro_batch=b, dtype="bf16"), topology)
    assert all(r.send_inter_bytes == 0 for r in inner.ranks)
    # receive buffers: one per microbatch for each direction a stage receives
    assert est.ranks[1].memory.extra == {"receive buffers (8 per direction and stage)":
                                         2 * m * x}
    assert est.ranks[0].memory.extra == {"receive buffers (8 per direction and stage)": m * x}


@pytest.mark.parametrize(("schedule", "per_rank"), [
    ("Interleaved1F1B", 2), ("LoopedBFS", 2), ("InterleavedZeroBubble", 2),
    ("ZBVZeroBubble", 2), ("DualPipeV", 2)])
def test_sends_are_the_ones_torch_s_lowered_schedule_issues(schedule: str, per_rank: int
                                                            ) -> None:
    """Each rank's sends per step are its SEND_F and SEND_B actions in torch's own lowered
    order: none between two stages of one rank (the V placement's turn)."""
    pp, microbatches = 2, 4
    shape = ModelShape.from_numbers(layers=8, hidden=256, heads=2)
    est = pp_estimate(PP(schedule=schedule, stages_per_rank=per_rank,
                         microbatches=microbatches), MeshSpec(pp=pp), shape, Workload(seq=64))
    orders = lowered_order(schedule, pp, per_rank, microbatches)
    for r in est.ranks:
        torch_sends = sum(1 for kind, _ in orders[r.coordinate] if kind in ("SEND_F", "SEND_B"))
        assert sum(c.calls for c in r.sends) == torch_sends
    if SCHEDULES[schedule].style == "v":
        assert len(est.ranks[1].sends) == 2  # stage 1 back to 0, stage 2 on to 3


# -- what the plugin refuses, and the core's checks ------------------------------------------


def test_no_pipeline_terms_for_a_plan_validation_refuses() -> None:
    shape = ModelShape.from_numbers(layers=8, hidden=256, heads=2)
    est = pp_estimate(PP(schedule="1F1B", microbatches=2), MeshSpec(pp=4), shape,
                      Workload(seq=64))
    assert est.pipeline is None and not est.ranks
    assert any("no pipeline terms" in n and "at least as many microbatches" in n
               for n in est.notes)
    few = ModelShape.from_numbers(layers=2, hidden=256, heads=2)
    est = pp_estimate(PP(schedule="GPipe", microbatches=4), MeshSpec(pp=4), few,
                      Workload(seq=64))
    assert est.pipeline is None and any("CP602" in n for n in est.notes)


@attrs.frozen
class SecondCut(Plugin):
    """States the same pipeline as PP would: a second plugin cutting the model."""

    name: ClassVar[str] = "second_cut"

    @hookimpl
    def composer_par_estimate_pipeline(self, layout: Any, model: Any, workload: Any) -> Any:
        return PP(schedule="GPipe", microbatches=2).composer_par_estimate_pipeline(
            layout, model, workload)


def test_two_plugins_cutting_the_model_are_an_error() -> None:

    shape = ModelShape.from_numbers(layers=8, hidden=256, heads=2)
    mesh = MeshSpec(pp=2)
    plan = ParallelPlan(mesh).use(PP(schedule="GPipe", microbatches=2)).use(SecondCut())
    with pytest.raises(EstimateError, match="more than one plugin cuts the model"):
        estimate(pp_layout(mesh.resolve(2)), shape, Workload(seq=64), plan=plan)


@attrs.define
class PerStageCost(Plugin):
    """A third-party plugin stating one buffer per block of each stage it is asked
    about, recording the stages it was asked about."""

    name: ClassVar[str] = "per_stage_cost"
    asked: list[Any] = attrs.field(factory=list)

    @hookimpl
    def composer_par_estimate(self, layout: Any, model: Any, workload: Any,
                              stage: Any) -> Any:
        from composer_par.estimate import EstimatePart

        if stage is None:
            return None
        self.asked.append(stage)
        return EstimatePart(memory={"per-block buffer": 1000 * model.layers})


def test_stages_equal_but_for_their_label_are_asked_once() -> None:
    """Llama's 8 blocks on 8 stages, 2 a rank over pp 4: stages 1 to 6 hold one block
    each and share an answer; the first (with the embedding) and the last (with the
    head) are asked on their own. Every rank still counts its own stages' terms."""
    shape = ModelShape.from_numbers(layers=8, hidden=256, heads=2, vocab=1000)
    mesh = MeshSpec(pp=4)
    cost = PerStageCost()
    plan = ParallelPlan(mesh).use(PP(schedule="Interleaved1F1B", stages_per_rank=2,
                                     microbatches=4)).use(cost)
    est = estimate(pp_layout(mesh.resolve(4)), shape, Workload(seq=64), plan=plan)
    assert len(est.ranks) == 4 and all(len(r.stages) == 2 for r in est.ranks)
    distinct = {attrs.evolve(s, label="") for s in cost.asked}
    assert len(cost.asked) == len(distinct) == 3
    for rank in est.ranks:
        assert rank.memory.extra["per_stage_cost: per-block buffer"] == 1000 * rank.blocks


# -- the command ------------------------------------------------------------------------------

PLAN = """[mesh]
pp = 4
dp_shard = 8

[topology]
nodes = 4
devices_per_node = 8

[[plugins]]
name = "pp"
schedule = "Interleaved1F1B"
stages_per_rank = 2
microbatches = 8

[[plugins]]
name = "fsdp2"
mixed_precision = "bf16"
"""


def test_estimate_command_text_and_json(tmp_path: Path) -> None:
    if "fsdp2" not in INSTALLED:
        pytest.skip("the fsdp2 plugin is not installed")
    path = tmp_path / "pp.toml"
    path.write_text(PLAN)
    argv = ["estimate", str(path), "--params", "13e9", "--layers", "40", "--hidden", "5120",
            "--vocab", "32000", "--seq", "4096", "--device-memory", "80GiB"]
    code, out, _ = run(argv)
    assert code == 0, out
    assert "memory per rank (the fullest pp rank: pp " in out
    assert "pipeline over pp: Interleaved1F1B, 8 stages over pp(4), 8 microbatches; bubble" in out
    assert "point-to-point per step:" in out and "between nodes per pipeline" in out
    assert "accumulated over the microbatches until the step's one reduce-scatter" in out
    code, out, _ = run([*argv, "--json"])
    data = json.loads(out)
    line = data["pipeline"]
    assert line["bubble"] == pytest.approx(theoretical_bubble("Interleaved1F1B", 4, 2, 8))
    assert [r["stages"] for r in line["ranks"]] == [["stage 0", "stage 4"], ["stage 1", "stage 5"],
                                                   ["stage 2", "stage 6"], ["stage 3", "stage 7"]]
    assert line["point_to_point_per_step"]["pipelines"] == 8
    fullest = line["ranks"][line["fullest_rank"]]
    assert data["memory"]["total"] == fullest["memory"]["total"]
    assert {c["dim"] for c in data["communication"]} == {"pp", "dp_shard"}


PROBE = """
import contextlib, io, json, sys
from composer_par.cli.main import main
codes = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        codes.append(main(argv))
print(json.dumps({"codes": codes,
                  "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}))
"""


def test_a_single_stage_schedule_and_suggest_never_import_torch(tmp_path: Path) -> None:
    path = tmp_path / "pp.toml"
    path.write_text(PLAN.replace('"Interleaved1F1B"\nstages_per_rank = 2', '"1F1B"'))
    argvs = [["estimate", str(path), "--params", "13e9", "--seq", "4096"],
             ["suggest", "--params", "70e9", "--layers", "80", "--hidden", "8192", "--heads",
              "64", "--kv-heads", "8", "--nodes", "8", "--devices-per-node", "8",
              "--device-memory", "80GiB", "--seq", "4096", "--inter-node-gbps", "100"]]
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argvs)], capture_output=True,
                          text=True, timeout=120, check=True, cwd=ROOT)
    probe = json.loads(done.stdout)
    assert probe["codes"] == [0, 0] and probe["torch"] == []


# -- suggest ----------------------------------------------------------------------------------

LLAMA_70B = ModelShape.from_numbers(params=70_000_000_000, layers=80, hidden=8192, heads=64,
                                    kv_heads=8, ffn_hidden=28672, vocab=128256)


def test_suggest_chooses_a_pipeline_for_70b_on_8_nodes_at_100_gbit() -> None:
    result = suggest(LLAMA_70B, Topology(8, 8), GIB80, seq=4096, inter_node_gbps=100)
    best = result.best
    assert best is not None and best.candidate.size("pp") > 1, format_suggestion(result)
    assert best.estimate.pipeline is not None
    # the layouts without a pipeline run their sharded collectives over the slow links
    without = [r for r in result.ranked if r.fits and r.candidate.size("pp") == 1]
    assert without and all(r.reason.startswith("slower:") for r in without)
    fastest = min(without, key=lambda r: r.seconds)
    assert fastest.estimate.inter_bytes > 10 * best.estimate.inter_bytes
    why = next(line for line in result.why if line.startswith(f"PP {best.candidate.size('pp')}"))
    assert "faster than the best layout without it" in why and "across nodes" in why
    # the bubble is priced: a pipeline's step is its busy time over 1 - bubble
    for r in result.ranked:
        step = r.estimate.step
        if r.candidate.size("pp") > 1:
            assert step.bubble > 0 and step.idle_seconds > 0
            assert r.seconds == pytest.approx(step.busy_seconds / (1 - step.bubble))
    plan = result.plan_toml or ""
    assert 'name = "pp"' in plan and 'schedule = "1F1B"' in plan
    assert f"microbatches = {best.candidate.passes}" in plan
    if {"tp", "fsdp2", "hsdp", "meta_init", "cp"} <= INSTALLED:
        assert result.report is not None and result.report.ok, result.report.format()
    text = format_suggestion(result)
    assert "STEP" in text and "MFU" in text and "idle in a" in text


def test_suggest_cli_prices_compute_at_the_given_throughput() -> None:
    """--device-tflops reaches suggest: a layout's compute scales with 1 / throughput."""
    import json
    import subprocess
    import sys

    def compute(tflops: str) -> dict[str, float]:
        done = subprocess.run(
            [sys.executable, "-m", "composer_par.cli", "suggest", "--params", "70B",
             "--layers", "80", "--hidden", "8192", "--heads", "64", "--kv-heads", "8",
             "--seq", "4096", "--nodes", "8", "--devices-per-node", "8",
             "--device-memory", "80GiB", "--inter-node-gbps", "100",
             "--device-tflops", tflops, "--json"],
            capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return {c["layout"]: c["compute_seconds"] for c in json.loads(done.stdout)["candidates"]}

    slow, fast = compute("100"), compute("400")
    assert slow.keys() == fast.keys()
    for layout, seconds in slow.items():
        assert seconds == pytest.approx(4 * fast[layout], rel=1e-6), layout
    bad = subprocess.run([sys.executable, "-m", "composer_par.cli", "suggest", "--params",
                          "1B", "--seq", "8", "--nodes", "1", "--devices-per-node", "8",
                          "--device-memory", "80GiB", "--device-tflops", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--device-tflops" in bad.stderr


def test_suggest_tries_pipelines_whether_or_not_others_fit() -> None:
    """Every combination of the plugins' dims is tried: pipelines beside layouts that fit
    without one, and when nothing fits, pp sizes that divide the world."""
    model = ModelShape.from_numbers(params=13_000_000_000)
    result = suggest(model, Topology(4, 8), GIB80, seq=4096, inter_node_gbps=100)
    assert {r.candidate.size("pp") for r in result.ranked} == {1, 2, 4, 8, 16, 32}
    huge = suggest(ModelShape.from_numbers(params=175_000_000_000), Topology(1, 8), GIB80,
                   seq=2048)
    assert huge.best is None
    assert {r.candidate.size("pp") for r in huge.ranked} == {1, 2, 4, 8}
    assert any("no layout fits" in n for n in huge.notes)


def test_pipeline_candidates_meshes_and_plugins() -> None:
    """A pipeline layout: pp outermost, its schedule running each data shard's
    micro-batches as its microbatches (the training step accumulates none)."""
    model = ModelShape.from_numbers(params=13_000_000_000)
    result = suggest(model, Topology(4, 8), GIB80, seq=4096, inter_node_gbps=100)
    c = next(r.candidate for r in result.ranked if r.candidate.size("pp") == 8
             and r.candidate.size("tp") == 4 and r.candidate.size("dp_replicate") == 1)
    assert next(iter(c.mesh().names)) == "pp" and c.label().startswith("PP 8 + ")
    plugins = dict(c.plugins())
    assert plugins["pp"] == {"schedule": "1F1B", "microbatches": c.passes}
    assert plugins["tp"] == {"sequence_parallel": True}
    assert c.runs_passes and c.passes == 32 // (c.size("dp_shard") * c.size("dp_replicate"))
    est = next(r.estimate for r in result.ranked if r.candidate == c)
    assert est.workload.grad_accum == 1 and est.pipeline.microbatches == c.passes


# -- measured: a pipeline step's sends and FSDP2 collectives on gloo -----------------------

MEASURED = [
    '[mesh]\npp = 2\ndp_shard = 2\n[[plugins]]\nname = "pp"\nschedule = "1F1B"\n'
    'microbatches = 4\n[[plugins]]\nname = "fsdp2"\n',
    '[mesh]\npp = 2\ndp_shard = 2\n[[plugins]]\nname = "pp"\nschedule = "Interleaved1F1B"\n'
    'stages_per_rank = 2\nmicrobatches = 4\n[[plugins]]\nname = "fsdp2"\n'
    'reshard_after_forward = true\n',
    '[mesh]\npp = 2\ndp_shard = 2\n[[plugins]]\nname = "pp"\nschedule = "ZBVZeroBubble"\n'
    'microbatches = 4\n[[plugins]]\nname = "fsdp2"\n',
    '[mesh]\npp = 4\n[[plugins]]\nname = "pp"\nschedule = "GPipe"\nmicrobatches = 4\n',
    # 10 stages over 8 blocks: the embedding and the head on stages of their own
    '[mesh]\npp = 2\ndp_shard = 2\n[[plugins]]\nname = "pp"\nschedule = "Interleaved1F1B"\n'
    'stages_per_rank = 5\nmicrobatches = 4\n[[plugins]]\nname = "fsdp2"\n',
]


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_estimated_sends_and_collectives_match_a_real_pipeline_step() -> None:
    """On 4 gloo ranks, the bytes and calls of every point-to-point send over pp and of
    FSDP2's all-gathers and reduce-scatters over dp_shard in one step equal the estimate's
    for that pp rank, for a single-stage, a looped, a V schedule and GPipe, and with the
    ends on stages of their own."""
    if "fsdp2" not in INSTALLED or "meta_init" not in INSTALLED:
        pytest.skip("fsdp2 and meta_init are needed")
    import torch

    from composer_par.testing.distributed import run_ranks
    from tests.pp_workers import llama8_b16

    plans = [text + '[[plugins]]\nname = "meta_init"\nseed = 3\n' for text in MEASURED]
    measured = run_ranks("tests.estimate_pp_workers:measure_pipeline_steps", 4,
                         args=(plans,), timeout=360)
    with torch.device("meta"):
        shape = ModelShape.from_module(llama8_b16.build())
    for index, text in enumerate(plans):
        plan = ParallelPlan.from_toml(text)
        _, shards = plan.data_shard(0, 4)
        workload = Workload(seq=llama8_b16.seq_len,
                            micro_batch=llama8_b16.global_batch // shards // 4)
        est = estimate_plan(plan, shape, workload, world_size=4)
        assert est.pipeline is not None
        for rank_results in measured:
            got = rank_results[index]
            mine = est.ranks[got["coordinate"]["pp"]]
            expected: dict[tuple[str, str], list[int]] = {}
            for t in mine.traffic:
                for c in t.collectives:
                    slot = expected.setdefault((t.dim.name, c.kind), [0, 0])
                    slot[0] += c.calls
                    slot[1] += c.payload
            seen = {(dim, kind): [v["calls"], v["bytes"]]
                    for dim, kinds in got["summary"].items() for kind, v in kinds.items()
                    if (dim, kind) in expected or kind == "send"}
            assert seen == expected, (text, got["rank"], got["summary"])
            assert sum(s["bytes"] for s in got["sends"]) == sum(c.payload for c in mine.sends)
