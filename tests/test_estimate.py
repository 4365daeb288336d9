"""The estimator: units, hand-computed cases, the plugin hook, the CLI, and (on real gloo
ranks) its per-mesh-dim bytes against the collectives FSDP2, HSDP and TP actually issue."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest

from composer_par import MeshSpec, ParallelPlan, Registry, Role, Topology
from composer_par.estimate import (
    ACCOUNTING,
    Collective,
    EstimateError,
    EstimatePart,
    Layout,
    ModelShape,
    ParamGroup,
    TensorShape,
    Workload,
    activation_bytes,
    dtype_name,
    estimate_plan,
    parse_bytes,
    parse_count,
    split_bytes,
)
from composer_par.estimate.accumulation import SyncCost
from composer_par.plugin import Claim, EstimateSettings, Plugin, hookimpl
from composer_par.testing.comm_count import group_label
from tests.cli_run import run

ROOT = Path(__file__).resolve().parent.parent
GBPS = 900e9 / 8  # the default intra-node bandwidth in bytes/s


# -- units -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "value"), [("13e9", 13_000_000_000), ("1.3B", 1_300_000_000),
                                             ("350M", 350_000_000), ("7b", 7_000_000_000),
                                             ("12", 12), (5e3, 5000)])
def test_parse_count(text: Any, value: int) -> None:
    assert parse_count(text) == value


@pytest.mark.parametrize(("text", "value"), [("80GiB", 80 * 2**30), ("80GB", 80 * 10**9),
                                             ("512MiB", 512 * 2**20), ("80", 80 * 2**30),
                                             ("1.5 TiB", int(1.5 * 2**40))])
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("bad", ["", "lots", "-3", "0", "13x"])
def test_bad_counts_and_sizes_say_what_they_expected(bad: str) -> None:
    with pytest.raises(EstimateError, match="expected"):
        parse_count(bad)
    with pytest.raises(EstimateError, match="expected"):
        parse_bytes(bad)


def test_dtype_names() -> None:
    assert dtype_name("bf16") == "bfloat16" and dtype_name("torch.float32") == "float32"
    with pytest.raises(EstimateError, match="dtype must be one of"):
        dtype_name("int8")


# -- hand-computed cases ---------------------------------------------------------------------

# 4 blocks of one 1024x1024 matrix, and a root of one 1000x1024 matrix.
HAND = ModelShape(
    params=4 * 1024 * 1024 + 1000 * 1024, layers=4, hidden=1024, heads=16,
    groups=(ParamGroup("blocks", (TensorShape("w", (1024, 1024)),), count=4),
            ParamGroup("root", (TensorShape("emb", (1000, 1024)),), block=False)),
)
WORK = Workload(seq=1024, micro_batch=2, dtype="bf16", reduce_dtype="fp32", optimizer="adamw")


def planned(mesh: MeshSpec, topology: Topology, *plugins: Plugin, work: Workload = WORK,
            model: ModelShape = HAND) -> Any:
    """The estimate of ``plugins`` over ``mesh`` (every term is a plugin's own)."""
    plan = ParallelPlan(mesh, topology=topology)
    for plugin in plugins:
        plan.use(plugin)
    return estimate_plan(plan, model, work, world_size=topology.world_size)


def fsdp(*, work: Workload = WORK, model: ModelShape = HAND, **options: Any) -> Any:
    from composer_par import FSDP2

    return planned(MeshSpec(dp_shard=8), Topology(1, 8), FSDP2(**options), work=work,
                   model=model)


def hsdp(mesh: MeshSpec, topology: Topology, work: Workload = WORK) -> Any:
    from composer_par import FSDP2, HSDP

    plugins: list[Plugin] = [HSDP()]
    if "dp_shard" in mesh:
        plugins.append(FSDP2())
    return planned(mesh, topology, *plugins, work=work)


def test_fsdp_on_one_node_by_hand() -> None:
    est = fsdp()
    local = 4 * 128 * 1024 + 125 * 1024  # dim 0 split 8 ways
    assert est.memory.local_params == local
    assert (est.memory.params, est.memory.grads, est.memory.optimizer) == (
        2 * local, 2 * local, 12 * local)
    (traffic,) = est.traffic
    forward, backward, reduce = traffic.collectives
    full = 4 * 1024 * 1024 + 1000 * 1024
    assert (forward.kind, forward.payload, forward.calls) == ("all_gather", full * 2, 5)
    # FSDP2's default: every group but the root's and the last block's is resharded
    # after forward
    assert (backward.kind, backward.payload, backward.calls) == (
        "all_gather", 3 * 1024 * 1024 * 2, 3)
    assert (reduce.kind, reduce.payload, reduce.calls) == ("reduce_scatter", full * 4, 5)
    payload = full * 2 + 3 * 1024 * 1024 * 2 + full * 4
    assert traffic.payload == payload
    assert traffic.intra_bytes == pytest.approx(payload * 7 / 8)  # a ring of 8
    assert traffic.inter_bytes == 0
    assert traffic.seconds == pytest.approx(payload * 7 / 8 / GBPS)


def test_fsdp_reshard_options_and_padding() -> None:
    padded = attrs.evolve(HAND, groups=(
        *HAND.groups[:1], ParamGroup("root", (TensorShape("emb", (1001, 1024)),), block=False)))
    est = fsdp(reshard_after_forward=True, model=padded)
    gathers = [c for c in est.traffic[0].collectives if c.kind == "all_gather"]
    # dim 0 of 1001 is padded to 1008 (a multiple of 8), and the root reshards too
    assert gathers[1].payload == (4 * 1024 * 1024 + 1008 * 1024) * 2 and gathers[1].calls == 5
    est = fsdp(reshard_after_forward=False)
    assert [c.kind for c in est.traffic[0].collectives] == ["all_gather", "reduce_scatter"]
    est = fsdp(reshard_after_forward=2)
    regroup = est.traffic[0].collectives[1]
    assert (regroup.group_size, regroup.nodes, regroup.calls) == (2, 1, 5)


def test_hsdp_across_two_nodes_by_hand() -> None:
    est = hsdp(MeshSpec(dp_replicate=2, dp_shard=4), Topology(2, 4))
    replicate, shard = est.traffic
    local = 4 * 256 * 1024 + 250 * 1024
    assert est.memory.local_params == local  # sharded 4 ways only
    assert replicate.dim.crosses_nodes and not shard.dim.crosses_nodes
    (all_reduce,) = replicate.collectives
    assert all_reduce.kind == "all_reduce" and all_reduce.payload == local * 4
    # a ring of 2, one rank per node: 2 * X * 1/2 leaves the node, nothing stays inside
    assert (replicate.intra_bytes, replicate.inter_bytes) == (0, local * 4)
    assert shard.inter_bytes == 0


def test_replicate_alone_all_reduces_whole_gradients() -> None:
    est = hsdp(MeshSpec(dp_replicate=4), Topology(1, 4))
    (collective,) = est.traffic[0].collectives
    assert collective.payload == HAND.params * 4 and collective.calls == 5
    assert est.memory.local_params == HAND.params


# -- gradient accumulation: each sync policy of the training step ----------------------------


def _hsdp(work: Workload) -> Any:
    return hsdp(MeshSpec(dp_replicate=2, dp_shard=4), Topology(2, 4), work)


def test_accumulation_policies_by_hand() -> None:
    k = 4
    full = 4 * 1024 * 1024 + 1000 * 1024  # elements of every group, unsharded
    local = 4 * 256 * 1024 + 250 * 1024  # one rank's shard over dp_shard(4)
    units = 5  # 4 blocks and the root
    est = _hsdp(attrs.evolve(WORK, grad_accum=k))
    costs = {c.sync: c for c in est.accumulation}
    assert list(costs) == ["last", "reduce_scatter", "every"]
    # "last": whole fp32 gradients held, one reduce-scatter (fp32 input: full * 4 B) and
    # one all-reduce (the fp32 shard: local * 4 B) per unit per step.
    assert costs["last"] == SyncCost("last", full * 4, True, units, full * 4, units, local * 4)
    # the others hold the sharded 16-bit gradients, as without accumulation
    assert costs["reduce_scatter"] == SyncCost("reduce_scatter", local * 2, False, k * units,
                                               k * full * 4, units, local * 4)
    assert costs["every"] == SyncCost("every", local * 2, False, k * units, k * full * 4,
                                      k * units, k * local * 4)
    # The estimate itself is the workload's policy ("last" by default).
    assert est.memory.grads == full * 4
    replicate, shard = est.traffic
    assert replicate.calls() == {"all_reduce": units}
    assert shard.calls() == {"all_gather": k * (units + 3), "reduce_scatter": units}
    every = _hsdp(attrs.evolve(WORK, grad_accum=k, sync="every"))
    assert every.memory.grads == local * 2
    assert every.traffic[1].calls()["reduce_scatter"] == k * units
    assert every.accumulation == est.accumulation
    # One micro-batch: nothing to compare, and the policies are all the same step.
    one = _hsdp(WORK)
    assert one.accumulation == () and one.to_dict()["accumulation"] is None
    for sync in ("reduce_scatter", "every"):
        other = _hsdp(attrs.evolve(WORK, sync=sync))
        assert (other.memory, other.traffic) == (one.memory, one.traffic)


def test_replicate_alone_defers_its_all_reduce_under_last_and_reduce_scatter() -> None:
    est = hsdp(MeshSpec(dp_replicate=4), Topology(1, 4), attrs.evolve(WORK, grad_accum=2))
    calls = {c.sync: (c.reduce_scatter_calls, c.all_reduce_calls) for c in est.accumulation}
    assert calls == {"last": (0, 5), "reduce_scatter": (0, 5), "every": (0, 10)}
    # no shard dim: the gradients are whole under every policy
    assert {c.grads for c in est.accumulation} == {HAND.params * 2}


# Measured by tests/test_accumulation.py on gloo (the project's Llama: 2 blocks and the
# root, accumulate=4), per optimizer step: FSDP2 over 2 ranks and HSDP 2 x FSDP2 2.
MEASURED_ACCUMULATION = {
    ("fsdp2", "every"): {"dp_shard": {"all_gather": 16, "reduce_scatter": 12}},
    ("fsdp2", "last"): {"dp_shard": {"all_gather": 16, "reduce_scatter": 3}},
    ("hsdp", "every"): {"dp_replicate": {"all_reduce": 12},
                        "dp_shard": {"all_gather": 16, "reduce_scatter": 12}},
    ("hsdp", "last"): {"dp_replicate": {"all_reduce": 3},
                       "dp_shard": {"all_gather": 16, "reduce_scatter": 3}},
    ("hsdp", "reduce_scatter"): {"dp_replicate": {"all_reduce": 3},
                                 "dp_shard": {"all_gather": 16, "reduce_scatter": 12}},
}


def test_accumulation_counts_equal_the_measured_ones() -> None:
    import torch

    from composer_par.testing.tasks import llama

    plans = {"fsdp2": ('[mesh]\ndp_shard = 2\n[[plugins]]\nname = "fsdp2"\n', 2),
             "hsdp": ('[mesh]\ndp_replicate = 2\ndp_shard = 2\n[[plugins]]\nname = "hsdp"\n'
                      '[[plugins]]\nname = "fsdp2"\n', 4)}
    with torch.device("meta"):
        shape = ModelShape.from_module(llama.build())
    for (layout, sync), measured in MEASURED_ACCUMULATION.items():
        if layout == "hsdp" and "hsdp" not in Registry().names():
            continue
        text, world = plans[layout]
        workload = Workload(seq=llama.seq_len, grad_accum=4, sync=sync)
        est = estimate_plan(ParallelPlan.from_toml(text), shape, workload, world_size=world)
        assert {t.dim.name: t.calls() for t in est.traffic} == measured, (layout, sync)
        (cost,) = [c for c in est.accumulation if c.sync == sync]
        assert cost.reduce_scatter_calls == measured["dp_shard"]["reduce_scatter"]
        assert cost.all_reduce_calls == measured.get("dp_replicate", {}).get("all_reduce", 0)


def test_split_bytes_ring_model() -> None:
    assert split_bytes("all_gather", 800, 8, 1) == (700, 0)
    assert split_bytes("all_reduce", 800, 8, 1) == (1400, 0)
    # 32 ranks on 4 nodes (8 per node): 1/8 of the ring traffic leaves the node
    intra, inter = split_bytes("reduce_scatter", 3200, 32, 4)
    assert inter == pytest.approx(3100 / 8) and intra == pytest.approx(3100 * 7 / 8)
    assert split_bytes("all_gather", 800, 1, 1) == (0, 0)


def test_tensor_parallel_with_sequence_parallel_by_hand() -> None:
    from composer_par import FSDP2, TP

    est = planned(MeshSpec(dp_shard=2, tp=2), Topology(1, 4), TP(sequence_parallel=True),
                  FSDP2())
    tp = next(t for t in est.traffic if t.dim.name == "tp")
    x = 1024 * 2 * 1024 * 2  # s * b * h, bf16
    calls = 2 * (2 * 4 + 1)  # 2 per block and direction, +1 at the embedding / head
    assert {c.kind: (c.calls, c.payload) for c in tp.collectives} == {
        "all_gather": (calls, calls * x), "reduce_scatter": (calls, calls * x)}
    # TP splits every matrix (dim 0 by 2), then FSDP by 2
    assert est.memory.local_params == 4 * 256 * 1024 + 250 * 1024


def test_tp_backward_all_reduces_once_per_shared_input_or_per_linear() -> None:
    """Without sequence parallel, 2 forward all-reduces per block (+1 at the embedding)
    and in backward one per input the column-parallel Linears share (the auto plan's
    shared_input: 2 per block), or with an explicit plan one per Linear (5 of a Llama
    block's 7 matrices), +1 at the head."""
    from composer_par import TP

    llama = attrs.evolve(HAND, matrices_per_block=7)
    explicit = {"layers.*.attention.wq": "colwise", "layers.*.attention.wo": "rowwise"}
    shared = {**explicit, "layers.*.attention": "shared_input"}

    def all_reduces(tp: TP) -> int:
        est = planned(MeshSpec(tp=2), Topology(1, 2), tp, model=llama)
        traffic = next(t for t in est.traffic if t.dim.name == "tp")
        return sum(c.calls for c in traffic.collectives if c.kind == "all_reduce")

    assert all_reduces(TP()) == (2 * 4 + 1) + (2 * 4 + 1)
    assert all_reduces(TP(plan=explicit)) == (2 * 4 + 1) + (5 * 4 + 1)
    assert all_reduces(TP(plan=shared)) == (2 * 4 + 1) + (2 * 4 + 1)


def test_activations_follow_korthikanti() -> None:
    sbh = 1024 * 2 * 1024
    eager = attrs.evolve(WORK, attention="eager")
    kw: dict[str, Any] = {"tp": 1, "sequence_parallel": False, "loss_parallel": False}
    # 34 + 5*a*s/h = 34 + 5*16*1024/1024 = 114 per block, 4 blocks, 16-bit
    assert activation_bytes(HAND, eager, "bfloat16", mode="none", **kw) == 4 * 114 * sbh
    assert activation_bytes(HAND, eager, "bfloat16", mode="selective", **kw) == 4 * 34 * sbh
    assert activation_bytes(HAND, eager, "bfloat16", mode="full", **kw) == (4 * 2 + 114) * sbh
    assert activation_bytes(HAND, eager, "float32", mode="none", **kw) == 2 * 4 * 114 * sbh
    # SDPA keeps no attention scores
    assert activation_bytes(HAND, WORK, "bfloat16", mode="none", **kw) == 4 * 34 * sbh
    tp = {"tp": 4, "loss_parallel": False}
    assert activation_bytes(HAND, eager, "bfloat16", mode="none", sequence_parallel=False,
                            **tp) == 4 * (10 + 24 / 4 + 80 / 4) * sbh
    assert activation_bytes(HAND, eager, "bfloat16", mode="none", sequence_parallel=True,
                            **tp) == 4 * 114 * sbh / 4
    with_vocab = attrs.evolve(HAND, vocab=1000)
    assert activation_bytes(with_vocab, WORK, "bfloat16", mode="none", **kw) == (
        4 * 34 * sbh + 1024 * 2 * 1000 * 4)  # + fp32 logits


def test_fp32_and_sgd_accounting() -> None:
    est = fsdp(work=Workload(seq=8, dtype="fp32", optimizer="sgd"))
    local = est.memory.local_params
    assert (est.memory.params, est.memory.grads, est.memory.optimizer) == (
        4 * local, 4 * local, 0)
    est = fsdp(work=Workload(seq=8, dtype="bf16", optimizer="sgd"))
    assert est.memory.optimizer == 4 * local  # the fp32 master copy


def test_analytic_model_from_the_parameter_count() -> None:
    shape = ModelShape.from_numbers(params=13_000_000_000)
    assert (shape.hidden, shape.layers, shape.heads) == (5120, 41, 40)
    assert shape.params == 13_000_000_000
    assert sum(g.numel * g.count for g in shape.groups) == pytest.approx(shape.params, rel=1e-3)
    assert "hidden 5120" in shape.describe() and "assumed" in shape.describe()
    shape = ModelShape.from_numbers(layers=32, hidden=4096, heads=32, ffn_hidden=11008,
                                    vocab=32000)
    assert shape.params == pytest.approx(6.74e9, rel=0.01)  # Llama-2 7B
    with pytest.raises(EstimateError, match="--params"):
        ModelShape.from_numbers(layers=2)


def test_model_measured_from_a_meta_module() -> None:
    import torch

    from composer_par.models.llama import parameter_count
    from tests.dryrun_models import SMALL, small_llama

    with torch.device("meta"):
        model = small_llama()
    shape = ModelShape.from_module(model)
    assert shape.params == parameter_count(SMALL)
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.vocab) == (
        2, 64, 4, 2, 256)
    assert shape.matrices_per_block == 7 and [g.block for g in shape.groups] == [
        True, True, False]


def test_the_plan_gives_dtypes_and_checkpointing() -> None:
    text = """
[mesh]
dp_shard = 4
[[plugins]]
name = "fsdp2"
reshard_after_forward = false
mixed_precision = "bf16"
[[plugins]]
name = "meta_init"
"""
    plan = ParallelPlan.from_toml(text)
    est = estimate_plan(plan, HAND, Workload(seq=128), world_size=4)
    assert (est.dtype, est.reduce_dtype) == ("bfloat16", "float32")
    assert est.layout.reshard_after_forward is False
    est = estimate_plan(plan, HAND, Workload(seq=128, dtype="fp32"), world_size=4)
    assert (est.dtype, est.reduce_dtype) == ("float32", "float32")  # --dtype wins
    plain = ParallelPlan.from_toml(text.replace('mixed_precision = "bf16"\n', ""))
    est = estimate_plan(plain, HAND, Workload(seq=128), world_size=4)
    assert est.dtype == "float32" and any("float32" in n for n in est.notes)
    if "activation_checkpoint" in Registry().names():
        checkpointed = ParallelPlan.from_toml(
            text + '[[plugins]]\nname = "activation_checkpoint"\nmode = "full"\nevery = 2\n')
        est = estimate_plan(checkpointed, HAND, Workload(seq=128), world_size=4)
        assert est.activation_checkpoint == "full" and est.layout.checkpoint_every == 2


# -- the plugin hook ---------------------------------------------------------------------------


@attrs.frozen
class PipelineStub(Plugin):
    """Claims a mesh dim with a role the estimator has no built-in for, and states it."""

    name: ClassVar[str] = "pipeline_stub"

    def claims(self) -> tuple[Claim, ...]:
        return (Claim("pp", Role.OTHER),)

    @hookimpl
    def composer_par_estimate(self, layout: Layout, model: ModelShape,
                              workload: Workload) -> EstimatePart:
        activations = workload.seq * workload.micro_batch * model.hidden * 2
        return EstimatePart(
            collectives=(Collective("pp", "all_to_all", 8 * activations, 8, "stage handoffs"),),
            memory={"stage buffers": 3 * activations},
            activation_checkpoint="full",
        )


@attrs.frozen
class QuietFSDP(Plugin):
    """A shard plugin that says it communicates nothing: its answer replaces FSDP's."""

    name: ClassVar[str] = "quiet_fsdp"
    provides: ClassVar[frozenset[str]] = frozenset({"data_parallel"})

    def claims(self) -> tuple[Claim, ...]:
        return (Claim("dp_shard", Role.SHARD),)

    @hookimpl
    def composer_par_estimate(self) -> EstimatePart:
        return EstimatePart(collectives=())


def test_plugins_state_their_own_terms_through_composer_par_estimate() -> None:
    plan = ParallelPlan(MeshSpec(dp_shard=2, pp=2)).use(QuietFSDP()).use(PipelineStub())
    est = estimate_plan(plan, HAND, Workload(seq=64), world_size=4)
    assert [t.dim.name for t in est.traffic] == ["pp"]  # dp_shard: replaced by nothing
    (pp,) = est.traffic
    assert pp.payload == 8 * 64 * 1024 * 2 and pp.calls() == {"all_to_all": 8}
    assert est.memory.extra == {"pipeline_stub: stage buffers": 3 * 64 * 1024 * 2}
    assert est.activation_checkpoint == "full"
    assert any("stated by pipeline_stub" in note for note in est.notes)


@attrs.frozen
class ColumnSplit(Plugin):
    """Holds each matrix split on tensor dim 1 over its dim (not the TP-style dim 0): it
    says so through composer_par_estimate_shape, and the core counts what it holds."""

    name: ClassVar[str] = "column_split"

    def claims(self) -> tuple[Claim, ...]:
        return (Claim("xp", Role.MODEL_PARALLEL),)

    @hookimpl
    def composer_par_estimate_shape(self, layout: Layout, model: ModelShape) -> ModelShape:
        size = layout.mesh.size("xp")
        groups = tuple(attrs.evolve(g, tensors=tuple(
            attrs.evolve(t, shape=(t.shape[0], t.shape[1] // size), tp=False)
            if len(t.shape) == 2 else t for t in g.tensors)) for g in model.groups)
        return attrs.evolve(model, groups=groups)


def test_a_plugin_states_what_one_rank_holds_through_the_shape_hook() -> None:
    """The shape hook's answer is what the core divides and what every plugin's terms
    see: FSDP2 shards the halved matrices over dp_shard, and gathers them."""
    from composer_par import FSDP2

    plan = ParallelPlan(MeshSpec(dp_shard=2, xp=2)).use(FSDP2()).use(ColumnSplit())
    est = estimate_plan(plan, HAND, WORK, world_size=4)
    assert est.memory.local_params == (4 * 1024 * 512 + 1000 * 512) // 2
    forward = next(c for c in est.traffic[0].collectives if c.kind == "all_gather")
    assert forward.payload == (4 * 1024 * 512 + 1000 * 512) * 2  # bf16, gathered over 2
    plain = estimate_plan(ParallelPlan(MeshSpec(dp_shard=2, xp=2)).use(FSDP2()), HAND, WORK,
                          world_size=4)
    assert plain.memory.local_params == 2 * est.memory.local_params


def test_a_wrong_hook_answer_is_an_error() -> None:
    @attrs.frozen
    class Wrong(Plugin):
        name: ClassVar[str] = "wrong"

        @hookimpl
        def composer_par_estimate(self) -> Any:
            return {"bytes": 1}

    plan = ParallelPlan(MeshSpec(dp_shard=1)).use(Wrong())
    with pytest.raises(EstimateError, match="must return an EstimatePart"):
        estimate_plan(plan, HAND, Workload(seq=8), world_size=1)


# -- the settings hook: what the estimate knows of a plan's plugins ---------------------------


@attrs.frozen
class OtherShard(Plugin):
    """A third-party FSDP: shards over dp_shard, says how it runs through
    composer_par_estimate_settings (the estimate cannot read its options) and states its
    own terms through composer_par_estimate: one all-gather of every parameter per step
    behind compute, a buffer holding the largest group, the FLOPs of packing its bucket,
    a report section and an accounting line."""

    name: ClassVar[str] = "other_shard"
    provides: ClassVar[frozenset[str]] = frozenset({"data_parallel"})

    keep_gathered: bool = False
    low_precision: bool = False

    def claims(self) -> tuple[Claim, ...]:
        return (Claim("dp_shard", Role.SHARD),)

    @hookimpl
    def composer_par_estimate_settings(self) -> EstimateSettings:
        return EstimateSettings(
            reshard_after_forward=False if self.keep_gathered else None,
            param_dtype="BF16" if self.low_precision else None,  # any spelling of dtypes
            reduce_dtype="fp32" if self.low_precision else None)

    @hookimpl
    def composer_par_estimate(self, layout: Layout, model: ModelShape,
                              workload: Workload) -> EstimatePart:
        from composer_par.plugin import ComputeTerm, EstimateSection, MemoryTerm, dtype_bytes

        size = dtype_bytes(workload.dtype)
        gathered = sum(g.numel * g.count for g in model.groups) * size
        largest = max(g.numel for g in model.groups) * size
        return EstimatePart(
            collectives=(Collective("dp_shard", "all_gather", gathered, 1,
                                    "every parameter, once per step", overlap="compute"),),
            terms=(MemoryTerm("buffers", largest, "its bucket: the largest group"),),
            compute=(ComputeTerm("packing its bucket", flops=1e12),),
            sections=(EstimateSection("other_shard", ("other_shard: one bucket per step",),
                                      {"bucket_bytes": largest}),),
            accounting=("other_shard: one all-gather of every parameter per step",))


def _same_estimate(a: Any, b: Any) -> None:
    assert (a.dtype, a.reduce_dtype, a.activation_checkpoint) == (
        b.dtype, b.reduce_dtype, b.activation_checkpoint)
    assert (a.memory.params, a.memory.grads, a.memory.optimizer, a.memory.activations) == (
        b.memory.params, b.memory.grads, b.memory.optimizer, b.memory.activations)


def test_a_third_party_shard_plugin_states_its_own_terms() -> None:
    """The core divides parameters, gradients and optimizer states by the shard dim
    whoever claims it, with the dtypes the plugins' settings give (as FSDP2's options
    do); everything else in the estimate is the plugin's own: its collectives, its
    buffer, its compute, its section and its accounting."""
    from composer_par import FSDP2

    work = Workload(seq=128)

    def est(plugin: Plugin) -> Any:
        return estimate_plan(ParallelPlan(MeshSpec(dp_shard=4)).use(plugin), HAND, work,
                             world_size=4)

    tuned = est(OtherShard(keep_gathered=True, low_precision=True))
    _same_estimate(tuned, est(FSDP2(reshard_after_forward=False, mixed_precision="bf16")))
    _same_estimate(est(OtherShard()), est(FSDP2()))
    plain = est(OtherShard())
    assert (plain.dtype, tuned.dtype) == ("float32", "bfloat16")
    assert tuned.layout.reshard_after_forward is False
    assert plain.layout.reshard_after_forward is None
    # its terms, and nothing of FSDP2's
    (dp,) = tuned.traffic
    whole = HAND.params * 2
    assert [(c.kind, c.payload, c.calls, c.overlap) for c in dp.collectives] == [
        ("all_gather", whole, 1, "compute")]
    bucket = 1024 * 1024 * 2  # a block's matrix, bf16
    assert tuned.memory.comm_buffers == bucket
    assert tuned.step.extra_flops == 1e12
    text = tuned.format()
    for words in ("other_shard: its bucket: the largest group", "other_shard: one bucket per step",
                  "other_shard: one all-gather of every parameter per step"):
        assert words in text
    data = tuned.to_dict()
    assert data["sections"] == {"other_shard": {"bucket_bytes": bucket}}
    assert tuned.section("other_shard") == {"bucket_bytes": bucket}
    assert data["memory"]["terms"] == [{"plugin": "other_shard", "category": "buffers",
                                        "bytes": bucket,
                                        "why": "its bucket: the largest group"}]


@attrs.frozen
class HalvingHook(Plugin):
    """A third-party comm hook on HSDP's replicate dim: its all-reduce sends half the
    bytes (composer_par_estimate_comm_hook), and it states an all-reduce of its own on
    that dim, which it is not asked about."""

    name: ClassVar[str] = "halving_hook"
    asked: list[Any] = attrs.field(factory=list, eq=False)

    @hookimpl
    def composer_par_comm_hooks(self) -> list[Any]:
        from composer_par.plugin import CommHook

        return [CommHook("dp_replicate", all_reduce=lambda setup: None)]

    @hookimpl
    def composer_par_estimate(self) -> EstimatePart:
        return EstimatePart(collectives=(Collective("dp_replicate", "all_reduce", 1000, 1,
                                                    "its own counter"),))

    @hookimpl
    def composer_par_estimate_comm_hook(self, collective: Collective
                                        ) -> tuple[Collective, ...]:
        self.asked.append(collective)
        return (attrs.evolve(collective, payload=collective.payload // 2,
                             why=f"halved: {collective.why}"),)


def test_a_comm_hooks_plugin_states_what_runs_in_place_of_a_collective() -> None:
    from composer_par import FSDP2, HSDP

    def traffic(*extra: Plugin) -> list[Collective]:
        plan = ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2)).use(HSDP()).use(FSDP2())
        for p in extra:
            plan.use(p)
        est = estimate_plan(plan, HAND, Workload(seq=128), world_size=4)
        return list(next(t for t in est.traffic if t.dim.name == "dp_replicate").collectives)

    (plain,) = traffic()
    hook = HalvingHook()
    halved, own = traffic(hook)
    assert (halved.kind, halved.payload, halved.calls, halved.overlap) == (
        "all_reduce", plain.payload // 2, plain.calls, plain.overlap)
    assert halved.why == f"halved: {plain.why}"
    assert (own.payload, own.why) == (1000, "its own counter")
    # asked about HSDP's all-reduce alone (once per estimate pass), never its own
    assert hook.asked and all(c.why == plain.why for c in hook.asked)


def test_settings_answers_merge_in_plan_order_and_are_checked() -> None:
    @attrs.frozen
    class States(Plugin):
        name: ClassVar[str] = "states"
        label: str = "states"
        settings: EstimateSettings = attrs.field(factory=EstimateSettings)

        def declare(self) -> Any:
            return attrs.evolve(super().declare(), plugin=self.label)

        @hookimpl
        def composer_par_estimate_settings(self) -> Any:
            return self.settings

    first = States("first", EstimateSettings(sequence_parallel=True, activation_checkpoint="full",
                                             checkpoint_every=2))
    second = States("second", EstimateSettings(activation_checkpoint="selective_matmuls"))
    plan = ParallelPlan(MeshSpec(dp_shard=1)).use(first).use(second)
    layout = Layout.from_plan(plan, world_size=1)
    # the later answer's set field wins; an unset (None) field keeps the earlier answer's
    assert (layout.sequence_parallel, layout.activation_checkpoint, layout.checkpoint_every) == (
        True, "selective", 2)
    assert layout.loss_parallel is False  # nobody set it: the default
    for bad, message in [({"x": 1}, "must return EstimateSettings or None; got dict"),
                         (EstimateSettings(param_dtype="int8"), "dtype must be one of"),
                         (EstimateSettings(checkpoint_every=0), "checkpoint_every must be")]:
        wrong = ParallelPlan(MeshSpec(dp_shard=1)).use(States("bad", bad))  # type: ignore[arg-type]
        with pytest.raises(EstimateError, match=message) as info:
            Layout.from_plan(wrong, world_size=1)
        assert "plugin 'bad'" in str(info.value)


def test_the_built_ins_answer_the_settings_hook() -> None:
    from composer_par import FSDP2, TP, ActivationCheckpoint

    plan = (ParallelPlan(MeshSpec(dp_shard=2, tp=2))
            .use(TP(sequence_parallel=True, loss_parallel=True))
            .use(FSDP2(reshard_after_forward=2, mixed_precision={"param_dtype": "fp16"}))
            .use(ActivationCheckpoint(mode="selective", every=3)))
    answers = dict(plan.hooks.estimate_settings())
    assert answers == {
        "tp": EstimateSettings(sequence_parallel=True, loss_parallel=True),
        "fsdp2": EstimateSettings(reshard_after_forward=2, param_dtype="float16"),
        "activation_checkpoint": EstimateSettings(activation_checkpoint="selective",
                                                  checkpoint_every=3,
                                                  checkpoint_reissue="none"),
    }
    layout = Layout.from_plan(plan, world_size=4)
    assert (layout.reshard_after_forward, layout.param_dtype, layout.reduce_dtype) == (
        2, "float16", None)
    assert (layout.sequence_parallel, layout.loss_parallel) == (True, True)
    assert (layout.activation_checkpoint, layout.checkpoint_every) == ("selective", 3)
    assert layout.reissue("selective") == "none" and layout.reissue("full") == "early_stop"
    matmul_only = ActivationCheckpoint(mode="selective", save=["matmul"])
    no_early_stop = ActivationCheckpoint(mode="full", early_stop=False)
    assert matmul_only.composer_par_estimate_settings().checkpoint_reissue == "early_stop"
    assert no_early_stop.composer_par_estimate_settings().checkpoint_reissue == "all"


def test_a_declared_checkpointing_policy_is_the_estimates_fallback() -> None:
    @attrs.frozen
    class Wraps(Plugin):
        """Checkpoints blocks, declares its policy, and does not answer the settings hook."""

        name: ClassVar[str] = "wraps"

        def declare(self) -> Any:
            return attrs.evolve(super().declare(), checkpointing="selective_attention")

    layout = Layout.from_plan(ParallelPlan(MeshSpec()).use(Wraps()), world_size=1)
    assert layout.activation_checkpoint == "selective"
    assert Layout.from_plan(ParallelPlan(MeshSpec()).use(OtherShard()),
                            world_size=1).activation_checkpoint is None


# -- the CLI -----------------------------------------------------------------------------------

PLAN_64 = """
[mesh]
dp_replicate = 8
dp_shard = 8
[topology]
nodes = 8
devices_per_node = 8
[[plugins]]
name = "{replicate}"
[[plugins]]
name = "fsdp2"
mixed_precision = "bf16"
[[plugins]]
name = "meta_init"
"""


@pytest.fixture
def plan_64(tmp_path: Path) -> str:
    replicate = "hsdp" if "hsdp" in Registry().names() else "fsdp2"
    path = tmp_path / "plan64.toml"
    path.write_text(PLAN_64.format(replicate=replicate))
    return str(path)


@pytest.fixture
def fsdp_plan(tmp_path: Path) -> str:
    path = tmp_path / "fsdp.toml"
    path.write_text('[mesh]\ndp_shard = 8\n[topology]\nnodes = 1\ndevices_per_node = 8\n'
                    '[[plugins]]\nname = "fsdp2"\n[[plugins]]\nname = "meta_init"\n')
    return str(path)


def test_estimate_command_text_and_json(fsdp_plan: str) -> None:
    argv = ["estimate", fsdp_plan, "--params", "1.3B", "--layers", "24", "--hidden", "2048",
            "--seq", "2048", "--dtype", "bf16", "--device-memory", "80GiB"]
    code, out, _ = run(argv)
    assert code == 0, out
    for words in ("memory per rank:", "optimizer states", "communication per step and rank:",
                  "dp_shard(8)", "inside a node", "accounting:", "fits in 80.00 GiB"):
        assert words in out
    code, out, _ = run([*argv, "--json"])
    data = json.loads(out)
    assert data["exit_code"] == 0 and data["fits"] is True
    assert data["model"]["params"] == 1_300_000_000
    assert data["communication"][0]["dim"] == "dp_shard"
    # the core's accounting, then each plugin's (fsdp2's)
    assert data["accounting"][:len(ACCOUNTING)] == list(ACCOUNTING)
    assert [a.split(":")[0] for a in data["accounting"][len(ACCOUNTING):]] == ["fsdp2"]
    step = data["step_time"]
    assert step["seconds"] > step["compute_seconds"] > 0 and 0 < step["mfu"] < 1
    assert "tokens/s per device" in out.replace("\\n", "") or True
    assert data["memory"]["total"] == sum(data["memory"][k] for k in (
        "params", "grads", "optimizer", "activations", "comm_buffers"))


def test_estimate_command_shows_every_sync_policy(fsdp_plan: str) -> None:
    argv = ["estimate", fsdp_plan, "--params", "1.3B", "--layers", "24", "--hidden", "2048",
            "--seq", "2048", "--dtype", "bf16", "--accumulate", "4"]
    code, out, _ = run(argv)
    assert code == 0, out
    assert "micro-batch 1 x 4 accumulated (sync 'last')" in out
    assert "gradient accumulation: 4 micro-batches per optimizer step" in out
    assert "kept unsharded between the 4 micro-batches" in out
    code, out, _ = run([*argv, "--sync", "every", "--json"])
    data = json.loads(out)
    accumulation = data["accumulation"]
    assert (accumulation["accumulate"], accumulation["sync"]) == (4, "every")
    policies = {p["sync"]: p for p in accumulation["policies"]}
    assert list(policies) == ["last", "reduce_scatter", "every"]
    # 24 blocks and the root reduce-scatter once per step, or once per micro-batch
    assert policies["last"]["reduce_scatter_calls"] == 25
    assert policies["every"]["reduce_scatter_calls"] == 100
    assert policies["last"]["unsharded"] and not policies["every"]["unsharded"]
    assert data["memory"]["grads"] == policies["every"]["grads"] < policies["last"]["grads"]
    (shard,) = data["communication"]
    assert shard["calls"]["reduce_scatter"] == 100
    # --grad-accum is the same option
    code, out, _ = run([*argv[:-2], "--grad-accum", "4", "--sync", "every", "--json"])
    assert json.loads(out)["accumulation"] == accumulation
    assert run([*argv, "--sync", "never"])[0] == 2


def test_estimate_exit_codes(fsdp_plan: str, tmp_path: Path) -> None:
    base = ["estimate", fsdp_plan, "--seq", "4096"]
    assert run([*base, "--params", "70e9", "--device-memory", "8GiB"])[0] == 1  # does not fit
    code, out, err = run([*base, "--json"])  # no model
    assert code == 2 and "--params" in err and json.loads(out)["exit_code"] == 2
    assert run([*base, "--params", "lots"])[0] == 2
    assert run(["estimate", str(tmp_path / "missing.toml"), "--params", "1e9",
                "--seq", "8"])[0] == 2
    assert run([*base, "--model", "tests.dryrun_models:nope"])[0] == 2


def test_estimate_with_a_model(plan_64: str) -> None:
    code, out, _ = run(["estimate", plan_64, "--model", "tests.dryrun_models:llama_1b",
                        "--seq", "2048", "--micro-batch", "2", "--json"])
    data = json.loads(out)
    assert code == 0
    assert data["model"]["params"] == 1_100_048_384 and data["model"]["kv_heads"] == 4
    dims = {c["dim"]: c for c in data["communication"]}
    if "hsdp" in Registry().names():
        assert dims["dp_replicate"]["crosses_nodes"] is True
        assert dims["dp_replicate"]["calls"] == {"all_reduce": 23}  # 22 blocks + root
    assert dims["dp_shard"]["crosses_nodes"] is False


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


def test_estimate_and_suggest_from_numbers_never_import_torch(plan_64: str) -> None:
    argvs = [["estimate", plan_64, "--params", "13e9", "--seq", "4096"],
             ["suggest", "--params", "13e9", "--nodes", "4", "--devices-per-node", "8",
              "--device-memory", "80GiB", "--seq", "4096"],
             ["explain", plan_64, "--svg", str(Path(plan_64).with_suffix(".svg"))],
             # long sequences: context-parallel layouts and the cp plugin's own terms
             ["suggest", "--params", "8e9", "--layers", "32", "--hidden", "4096", "--heads",
              "32", "--kv-heads", "8", "--ffn-hidden", "14336", "--vocab", "128256", "--nodes",
              "8", "--devices-per-node", "8", "--device-memory", "64GiB", "--seq", "131072"]]
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argvs)], capture_output=True,
                          text=True, timeout=120, check=True, cwd=ROOT)
    probe = json.loads(done.stdout)
    assert probe["codes"] == [0, 0, 0, 0] and probe["torch"] == []


# -- measured: the estimator against real collectives on gloo ---------------------------------

LLAMA_WORLD = 4
BASE = '[[plugins]]\nname = "meta_init"\nseed = 3\n'
MEASURED_PLANS: dict[str, tuple[str, tuple[str, ...]]] = {
    "fsdp2": ('[mesh]\ndp_shard = 4\n[[plugins]]\nname = "fsdp2"\n', ()),
    "fsdp2 reshard true, bf16": ('[mesh]\ndp_shard = 4\n[[plugins]]\nname = "fsdp2"\n'
                                 'reshard_after_forward = true\nmixed_precision = "bf16"\n', ()),
    "fsdp2 reshard 2": ('[mesh]\ndp_shard = 4\n[[plugins]]\nname = "fsdp2"\n'
                        "reshard_after_forward = 2\n", ()),
    # Each module of units= is a unit of its own; reshard_units per unit (an int: a sub-group).
    "fsdp2 embedding and head units, last block kept": (
        '[mesh]\ndp_shard = 4\n[[plugins]]\nname = "fsdp2"\nunits = ["tok_embeddings", "output"]\n'
        'reshard_units = { "layers.1" = false, root = true }\n', ()),
    "fsdp2 torchtitan's units": (
        '[mesh]\ndp_shard = 4\n[[plugins]]\nname = "fsdp2"\n'
        'units = ["tok_embeddings", ["norm", "output"]]\n'
        'reshard_units = { "norm + output" = false }\n', ()),
    "fsdp2 last block reshard 2": ('[mesh]\ndp_shard = 4\n[[plugins]]\nname = "fsdp2"\n'
                                   'reshard_units = { "layers.1" = 2 }\n', ()),
    "hsdp x fsdp2": ('[mesh]\ndp_replicate = 2\ndp_shard = 2\n[[plugins]]\nname = "hsdp"\n'
                     '[[plugins]]\nname = "fsdp2"\n', ("hsdp",)),
    "hsdp alone": ('[mesh]\ndp_replicate = 4\n[[plugins]]\nname = "hsdp"\n', ("hsdp",)),
    "fsdp2 x tp, sequence parallel": (
        '[mesh]\ndp_shard = 2\ntp = 2\n[[plugins]]\nname = "tp"\nsequence_parallel = true\n'
        '[[plugins]]\nname = "fsdp2"\n', ("tp",)),
    "fsdp2 x tp": ('[mesh]\ndp_shard = 2\ntp = 2\n[[plugins]]\nname = "tp"\n'
                   '[[plugins]]\nname = "fsdp2"\n', ("tp",)),
    # full checkpointing reissues a block's collectives up to its last saved tensor
    "fsdp2 x tp, full checkpointing": (
        '[mesh]\ndp_shard = 2\ntp = 2\n[[plugins]]\nname = "tp"\n[[plugins]]\nname = "fsdp2"\n'
        '[[plugins]]\nname = "activation_checkpoint"\nmode = "full"\n', ("tp",)),
    "fsdp2 x tp, sequence parallel, full checkpointing": (
        '[mesh]\ndp_shard = 2\ntp = 2\n[[plugins]]\nname = "tp"\nsequence_parallel = true\n'
        '[[plugins]]\nname = "fsdp2"\n[[plugins]]\nname = "activation_checkpoint"\n'
        'mode = "full"\n', ("tp",)),
    "fsdp2 x tp, full checkpointing without early stop": (
        '[mesh]\ndp_shard = 2\ntp = 2\n[[plugins]]\nname = "tp"\n[[plugins]]\nname = "fsdp2"\n'
        '[[plugins]]\nname = "activation_checkpoint"\nmode = "full"\nearly_stop = false\n',
        ("tp",)),
    "fsdp2 x tp, selective checkpointing saving matmul outputs only": (
        '[mesh]\ndp_shard = 2\ntp = 2\n[[plugins]]\nname = "tp"\n[[plugins]]\nname = "fsdp2"\n'
        '[[plugins]]\nname = "activation_checkpoint"\nmode = "selective"\nsave = ["matmul"]\n',
        ("tp",)),
    "fsdp2 x tp, sequence parallel, selective checkpointing": (
        '[mesh]\ndp_shard = 2\ntp = 2\n[[plugins]]\nname = "tp"\nsequence_parallel = true\n'
        '[[plugins]]\nname = "fsdp2"\n[[plugins]]\nname = "activation_checkpoint"\n'
        'mode = "selective"\n', ("tp",)),
    # a comm hook's own collectives in place of the replicate all-reduce
    # (composer_par_estimate_comm_hook): 16-bit all-to-all and all-gather
    "hsdp x fsdp2, compress bf16": (
        '[mesh]\ndp_replicate = 2\ndp_shard = 2\n[[plugins]]\nname = "hsdp"\n'
        '[[plugins]]\nname = "fsdp2"\n[[plugins]]\nname = "compress"\nmethod = "bf16"\n',
        ("hsdp", "compress")),
    "hsdp alone, compress fp16": (
        '[mesh]\ndp_replicate = 4\n[[plugins]]\nname = "hsdp"\n[[plugins]]\n'
        'name = "compress"\nmethod = "fp16"\n', ("hsdp", "compress")),
    # loss-parallel cross-entropy's reductions happen inside DTensor's dispatch
    "fsdp2 x tp, sequence and loss parallel": (
        '[mesh]\ndp_shard = 2\ntp = 2\n[[plugins]]\nname = "tp"\nsequence_parallel = true\n'
        'loss_parallel = true\n[[plugins]]\nname = "fsdp2"\n', ("tp",)),
}


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_estimated_bytes_per_mesh_dim_match_measured_collectives_within_5_percent() -> None:
    import torch

    from composer_par.testing.distributed import run_ranks
    from composer_par.testing.tasks import llama

    installed = set(Registry().names())
    cases = {name: text + BASE for name, (text, needs) in MEASURED_PLANS.items()
             if set(needs) <= installed}
    measured = run_ranks("tests.estimate_workers:measure_steps", LLAMA_WORLD,
                         args=(list(cases.values()),), timeout=500)
    with torch.device("meta"):
        shape = ModelShape.from_module(llama.build())
    report = []
    for (name, text), result in zip(cases.items(), measured[0], strict=True):
        plan = ParallelPlan.from_toml(text)
        _, shards = plan.data_shard(0, LLAMA_WORLD)
        workload = Workload(seq=llama.seq_len, micro_batch=llama.global_batch // shards)
        est = estimate_plan(plan, shape, workload, world_size=LLAMA_WORLD)
        got: dict[str, int] = {}
        calls: dict[str, dict[str, int]] = {}
        for label, kinds in result["summary"].items():
            if label == "self":
                # a 1-rank group (HSDP alone's own all-reduce under a comm hook): it moves
                # no bytes between ranks
                continue
            dim = label.removesuffix(" (subgroup)")
            got[dim] = got.get(dim, 0) + sum(k["bytes"] for k in kinds.values())
            for kind, totals in kinds.items():
                calls.setdefault(dim, {}).setdefault(kind, 0)
                calls[dim][kind] += totals["calls"]
        expected = {t.dim.name: t.payload for t in est.traffic}
        report.append((name, expected, got))
        assert set(got) == set(expected), (name, expected, result["summary"])
        for dim, value in expected.items():
            assert got[dim] == pytest.approx(value, rel=0.05), (name, dim, expected, got)
        # Measured on torch 2.13: the counts match exactly too.
        assert calls == {t.dim.name: t.calls() for t in est.traffic}, (name, calls)
    # Every rank measures the same (a symmetric layout): spot-check the last one.
    for first, last in zip(measured[0], measured[-1], strict=True):
        assert first["summary"] == last["summary"]
    assert report


def test_group_labels_name_mesh_dims() -> None:
    mesh = MeshSpec(dp_replicate=2, dp_shard=2, tp=2)
    rank = 5  # coordinate (1, 0, 1)
    assert group_label(mesh, rank, [4, 5]) == "tp"
    assert group_label(mesh, rank, [5, 7]) == "dp_shard"
    assert group_label(mesh, rank, [1, 5]) == "dp_replicate"
    assert group_label(mesh, rank, [4, 5, 6, 7]) == "dp_shard+tp"
    assert group_label(mesh, rank, range(8)) == "dp_replicate+dp_shard+tp"
    assert group_label(mesh, rank, [5]) == "self"
    assert group_label(mesh, rank, [0, 5]) == "dp_replicate+tp (subgroup)"
    assert group_label(mesh, rank, [0, 1]) == "other"  # not a group of this rank
    assert group_label(mesh, rank, []) == "none"
    assert group_label(MeshSpec(dp_shard=8), 0, [0, 1]) == "dp_shard (subgroup)"


def test_tensors_with_fewer_rows_than_shards_split_on_their_second_dim() -> None:
    """As the fsdp2 plugin has FSDP2 do: Mixtral's 8 fused experts over 32 shard ranks
    are split on each expert's rows, not padded to 32 experts (four times the bytes)."""
    from composer_par.estimate.model_shape import TensorShape

    experts = TensorShape("experts.w1", (8, 64, 32), tp=False, experts=True)
    assert experts.local_numel(1, 32) == 8 * 2 * 32
    assert experts.local_numel(1, 8) == 64 * 32  # one expert a rank: dim 0 as before
    # FSDP2 splits no dim but the first unevenly: 30 rows per expert stay on dim 0.
    uneven = TensorShape("experts.w1", (8, 30, 32), tp=False, experts=True)
    assert uneven.local_numel(1, 32) == 30 * 32
    assert TensorShape("norm.weight", (16,), tp=False).local_numel(1, 32) == 1  # padded


# -- the worked example of docs/writing-plugins.md ------------------------------------------


def _documented_ema() -> type:
    """The EMA plugin of docs/writing-plugins.md ("What it costs"), exactly as printed."""
    import re

    text = (ROOT / "docs" / "writing-plugins.md").read_text(encoding="utf-8")
    section = text.split("### What it costs", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "docs/writing-plugins.md lost its estimate example"
    namespace: dict[str, Any] = {}
    exec(compile(match.group(1), "writing-plugins.md", "exec"), namespace)
    return namespace["EMA"]


def test_the_documented_plugin_states_its_terms_in_estimate() -> None:
    """Its fp32 copy of each rank's shard, its compute and its accounting line appear in
    the estimate; on the host it costs the device nothing."""
    from composer_par import FSDP2

    ema = _documented_ema()
    plain = planned(MeshSpec(dp_shard=4), Topology(1, 4), FSDP2())
    with_ema = planned(MeshSpec(dp_shard=4), Topology(1, 4), FSDP2(), ema())
    on_host = planned(MeshSpec(dp_shard=4), Topology(1, 4), FSDP2(), ema(on_host=True))
    shard = HAND.params // 4
    assert with_ema.memory.total - plain.memory.total == 4 * shard
    assert on_host.memory.total == plain.memory.total
    assert with_ema.step.extra_flops == on_host.step.extra_flops == 3 * shard
    assert "ema: an fp32 average of each rank's parameters, on the device" in with_ema.format()


def test_the_documented_plugin_is_offered_by_suggest_only_when_asked() -> None:
    """opt_in: suggest leaves it out unless given an option of it; asked, it keeps the
    average on the device where that fits, on the host where it does not."""
    from composer_par.tools.suggest import suggest

    registry = Registry(extra=[_documented_ema()])
    model = ModelShape.from_numbers(params=1_000_000_000, layers=16, hidden=2048, heads=16)
    unasked = suggest(model, Topology(1, 8), parse_bytes("80GiB"), seq=2048,
                      registry=registry)
    assert not any("EMA" in r.candidate.label() for r in unasked.ranked)
    asked = suggest(model, Topology(1, 8), parse_bytes("80GiB"), seq=2048, registry=registry,
                    options={"ema": {"on_host": False}})
    assert asked.ranked and all("EMA" in r.candidate.label() for r in asked.ranked)
    assert all("on host" not in r.candidate.label() for r in asked.ranked)
    tight = suggest(ModelShape.from_numbers(params=8_000_000_000, layers=32, hidden=4096,
                                            heads=32),
                    Topology(1, 8), parse_bytes("28GiB"), seq=2048, registry=registry,
                    options={"ema": {"on_host": False}})
    assert any("EMA on host" in r.candidate.label() for r in tight.ranked)
