"""CP: the load-balanced split, the rule codes CP821-CP825, and training at parity with one
process on real gloo ranks (the project's Llama and Hugging Face decoders, both modes,
composed with FSDP2, HSDP, TP and activation checkpointing)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
import torch.nn as nn
from composer_par.plugins.cp import (
    CP,
    chunks_of_rank,
    rank_positions,
    shard_sequence,
    unshard_sequence,
)
from hypothesis import given
from hypothesis import strategies as st

from composer_par import MeshSpec, MetaInit, ParallelPlan, Topology
from composer_par.findings import Report
from composer_par.models.llama import Llama, LlamaConfig
from composer_par.testing.parity import ParityCase
from tests.composition_workers import check_cases

# -- the load-balanced split -----------------------------------------------------------


def test_rank_holds_a_head_and_a_tail_chunk() -> None:
    assert [chunks_of_rank(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert rank_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert rank_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


@given(size=st.integers(1, 6), chunk=st.integers(1, 5), batch=st.integers(1, 3),
       seq_dim=st.integers(0, 2))
def test_split_round_trips(size: int, chunk: int, batch: int, seq_dim: int) -> None:
    shape = [batch, 3, 2]
    shape[seq_dim] = 2 * size * chunk
    whole = torch.arange(torch.Size(shape).numel()).reshape(shape)
    parts = [shard_sequence(whole, size, r, seq_dim) for r in range(size)]
    assert all(p.shape[seq_dim] == 2 * chunk for p in parts)
    assert torch.equal(unshard_sequence(parts, seq_dim), whole)
    every = torch.cat([rank_positions(shape[seq_dim], size, r) for r in range(size)])
    assert sorted(every.tolist()) == list(range(shape[seq_dim]))


def test_uneven_sequence_is_refused_with_the_rule() -> None:
    with pytest.raises(ValueError, match="CP821"):
        rank_positions(10, 2, 0)


# -- rule codes ------------------------------------------------------------------------


def codes(report: Report) -> list[str]:
    return [f.code for f in report.findings]


def meta_llama(**config: Any) -> Llama:
    with torch.device("meta"):
        return Llama(LlamaConfig(**config))


def cp_plan(cp: CP, size: int = 2, topology: Topology | None = None) -> ParallelPlan:
    return ParallelPlan(MeshSpec(cp=size), topology=topology).use(cp).use(MetaInit())


def test_cp821_sequence_not_divisible() -> None:
    report = cp_plan(CP(seq_len=4098), 4).validate(world_size=4)
    assert codes(report) == ["CP821"]
    assert "2 * cp = 8" in report.errors[0].message and "4104" in (report.errors[0].fix or "")
    assert cp_plan(CP(seq_len=4096), 4).validate(world_size=4).ok


def test_cp822_alltoall_needs_heads_divisible() -> None:
    model = meta_llama(dim=48, n_heads=6, n_kv_heads=6)
    report = cp_plan(CP(mode="alltoall"), 4).validate(model, world_size=4)
    assert codes(report) == ["CP822"]
    assert "cp(4)" in report.errors[0].message and "6" in report.errors[0].message
    # allgather drives any head count
    assert cp_plan(CP(), 4).validate(model, world_size=4).ok


def test_cp823_attention_cp_cannot_drive() -> None:
    from tests import hf_workers

    eager = hf_workers.build("llama", attn_implementation="eager")
    eager.config._attn_implementation = "eager"
    report = cp_plan(CP()).validate(eager, world_size=2)
    assert "CP823" in codes(report)
    assert "model.layers.0.self_attn" in report.errors[0].message
    with torch.device("meta"):
        plain = nn.Sequential(nn.Linear(4, 4))
    assert codes(cp_plan(CP()).validate(plain, world_size=2)) == ["CP823"]


def test_cp824_attention_that_is_not_causal_self_attention() -> None:
    from tests import hf_workers

    bert = hf_workers.build("bert")
    bert.config._attn_implementation = "sdpa"
    report = cp_plan(CP()).validate(bert, world_size=2)
    assert "CP824" in codes(report)
    assert "not causal" in next(f for f in report.findings if f.code == "CP824").message


def test_cp827_transformers_router_loss_under_cp_is_refused() -> None:
    """Mixtral set to add its router loss itself would pool each rank's part of the
    sequences; with add_router_loss (which totals over cp) the plan is accepted."""
    from composer_par.models.hf_router_loss import add_router_loss
    from tests import hf_workers

    model = hf_workers.build("mixtral", output_router_logits=True)
    model.config._attn_implementation = "sdpa"
    report = cp_plan(CP()).validate(model, world_size=2)
    assert codes(report) == ["CP827"], report.format()
    assert "add_router_loss" in report.errors[0].fix
    add_router_loss(model)
    assert cp_plan(CP()).validate(model, world_size=2).ok
    plain = hf_workers.build("mixtral")
    plain.config._attn_implementation = "sdpa"
    assert cp_plan(CP()).validate(plain, world_size=2).ok


def test_cp825_cp_across_nodes_warns() -> None:
    # cp is folded into data parallelism: the core's CP302 (a tensor-parallel dim across
    # nodes is an error) leaves it to CP825, which says what cp would move there.
    report = cp_plan(CP(), 8, Topology(nodes=2, devices_per_node=4)).validate(world_size=8)
    assert codes(report) == ["CP825"]
    assert "spans nodes" in report.warnings[0].message
    assert "K and V" in report.warnings[0].message
    with_seq = cp_plan(CP(seq_len=4096), 8, Topology(nodes=2, devices_per_node=4))
    assert "3584 tokens" in with_seq.validate(world_size=8).warnings[0].message
    inside = ParallelPlan(MeshSpec(dp_replicate=2, cp=4),
                          topology=Topology(nodes=2, devices_per_node=4))
    inside.use(CP()).use(MetaInit())
    assert "CP825" not in codes(inside.validate(world_size=8))


def test_mode_option_is_checked() -> None:
    with pytest.raises(ValueError, match="mode"):
        CP(mode="rings")


def test_cp823_ring_cannot_mask_a_sliding_window() -> None:
    from tests import hf_workers

    for family, windowed in (("mistral", True), ("gemma3", True), ("qwen3", False),
                             ("llama", False)):
        model = hf_workers.build(family, meta=True)
        model.config._attn_implementation = "sdpa"
        found = codes(cp_plan(CP(mode="ring")).validate(model, world_size=2))
        assert ("CP823" in found) == windowed, (family, found)
        assert "CP823" not in codes(cp_plan(CP()).validate(model, world_size=2)), family


def test_cp826_ring_on_ranks_without_cuda(fake_world: Any) -> None:
    # Validated away from the ranks (no process group): the devices are not known.
    assert "CP826" not in codes(cp_plan(CP(mode="ring")).validate(meta_llama(),
                                                                   world_size=2))
    fake_world(2)
    report = cp_plan(CP(mode="ring")).validate(meta_llama(), world_size=2)
    assert ("CP826" in codes(report)) == (not torch.cuda.is_available()), report.format()
    assert "CP826" not in codes(cp_plan(CP()).validate(meta_llama(), world_size=2))


def test_cp_ranks_read_the_same_samples() -> None:
    from composer_par import FSDP2

    plan = ParallelPlan(MeshSpec(dp_shard=2, cp=2)).use(FSDP2()).use(CP()).use(MetaInit())
    assert [plan.data_shard(r, 4) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]


# -- parity ------------------------------------------------------------------------------

_CP = '[[plugins]]\nname = "cp"\nmode = "{mode}"\n\n[[plugins]]\nname = "meta_init"\n'
PLANS = {
    "cp2": "[mesh]\ncp = 2\n\n" + _CP,
    "cp4": "[mesh]\ncp = 4\n\n" + _CP,
    "fsdp2": '[mesh]\ndp_shard = 2\ncp = 2\n\n[[plugins]]\nname = "fsdp2"\n\n' + _CP,
    "hsdp": '[mesh]\ndp_replicate = 2\ncp = 2\n\n[[plugins]]\nname = "hsdp"\n\n' + _CP,
    "tp": '[mesh]\ncp = 2\ntp = 2\n\n[[plugins]]\nname = "tp"\n\n' + _CP,
    "fsdp2_tp": '[mesh]\ndp_shard = 2\ncp = 2\ntp = 2\n\n[[plugins]]\nname = "fsdp2"\n\n'
                '[[plugins]]\nname = "tp"\n\n' + _CP,
    "pp": '[mesh]\npp = 2\ncp = 2\n\n[[plugins]]\nname = "pp"\nschedule = "1F1B"\n\n' + _CP,
    "fsdp2_ac": '[mesh]\ndp_shard = 2\ncp = 2\n\n[[plugins]]\nname = "activation_checkpoint"'
                '\n\n[[plugins]]\nname = "fsdp2"\n\n' + _CP,
    "ac_selective": '[mesh]\ncp = 2\n\n[[plugins]]\nname = "activation_checkpoint"\n'
                    'mode = "selective"\n\n' + _CP,
}
MODES = ("allgather", "alltoall")


def _cases(task: str, plan: str, world: int) -> list[ParityCase]:
    return [ParityCase(f"tests.cp_workers:{task}", PLANS[plan].format(mode=mode), world,
                       steps=4) for mode in MODES]


def _check(cases: list[ParityCase], timeout: float) -> None:
    for case, result in zip(cases, check_cases(cases, timeout=timeout), strict=True):
        try:
            result.assert_close()
        except AssertionError as exc:
            raise AssertionError(f"{case.task} {case.plan!r}: {exc}") from None


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_parity_on_two_ranks() -> None:
    """CP 2 in both modes: the project's Llama and three Hugging Face families (Mistral
    and Gemma 3 with sliding-window layers narrower than the sequence); the project's
    Llama and Hugging Face's with selective checkpointing too, which keeps CP's gathered
    and traded tensors for backward."""
    tasks = ["llama", "hf_llama", "hf_qwen3", "hf_mistral", "hf_gemma3"]
    _check([c for t in tasks for c in _cases(t, "cp2", 2)]
           + [c for t in ("llama", "hf_llama") for c in _cases(t, "ac_selective", 2)],
           timeout=280)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_parity_on_four_ranks() -> None:
    """CP 4, and CP 2 composed with FSDP2 (dp_shard x cp), HSDP, TP and activation
    checkpointing, both modes."""
    plans = ["cp4", "fsdp2", "hsdp", "tp", "fsdp2_ac"]
    _check([c for p in plans for c in _cases("llama_kv4", p, 4)], timeout=280)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_training_step_gives_the_global_mean_loss() -> None:
    """The plan's training step on dp_shard x cp: the loss it returns is the mean over
    every token of the global batch on every rank, the parameters at parity."""
    from composer_par.testing.distributed import run_ranks
    from composer_par.testing.parity import parity_result
    from tests import cp_workers

    case = _cases("llama", "fsdp2", 4)[0]
    ranks = run_ranks(cp_workers.train_with_training_step, 4, args=(case,), timeout=200)
    parity_result(case, ranks).assert_close()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_parity_with_a_pipeline() -> None:
    """pp 2 x cp 2 through the plan's training step (positions given to every stage,
    cut into microbatches with the tokens), both modes."""
    from composer_par.testing.distributed import run_ranks
    from composer_par.testing.parity import parity_result
    from tests import cp_workers

    cases = _cases("llama_kv4", "pp", 4)
    ranks = run_ranks(cp_workers.train_many_with_training_step, 4, args=(cases,),
                      timeout=280)
    for i, case in enumerate(cases):
        parity_result(case, [per_rank[i] for per_rank in ranks]).assert_close()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_parity_on_eight_ranks() -> None:
    """dp_shard 2 x cp 2 x tp 2: FSDP2 over dp_shard x cp, TP inside, both modes."""
    _check(_cases("llama_kv4", "fsdp2_tp", 8), timeout=280)


def test_blockwise_chunks_are_exact_causal_attention() -> None:
    """Each chunk of queries over the keys up to its end, merged by log-sum-exp, is the
    causal attention of the whole sequence, gradients included (float64)."""
    from composer_par.plugins.cp.blockwise import chunk_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 8, dtype=torch.float64, generator=gen,
                           requires_grad=True) for _ in range(3))
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn(reference.shape, dtype=torch.float64, generator=gen)
    expected = torch.autograd.grad(reference, (q, k, v), grad)
    out = torch.cat([chunk_attention(q[:, :, c * 8:(c + 1) * 8], k[:, :, :(c + 1) * 8],
                                     v[:, :, :(c + 1) * 8], c * 8) for c in range(4)], dim=2)
    torch.testing.assert_close(out, reference)
    for ours, theirs in zip(torch.autograd.grad(out, (q, k, v), grad), expected, strict=True):
        torch.testing.assert_close(ours, theirs)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", MODES)
def test_estimate_equals_a_real_steps_bytes(mode: str) -> None:
    """The attention collectives CommCounter counts in one step are what
    ``attention_collectives`` predicts, call for call and byte for byte."""
    from composer_par.plugins.cp.estimate import attention_collectives

    from composer_par.testing.parity import measure_comm
    from tests.cp_workers import llama

    case = _cases("llama", "cp2", 2)[MODES.index(mode)]
    measured = measure_comm(attrs.evolve(case, steps=1), timeout=200)
    # The project's Llama repeats K/V to the query heads before its attention math.
    predicted = attention_collectives(
        "cp", mode, size=2, layers=llama.n_layers, batch=llama.global_batch,
        seq=llama.seq_len, heads=llama.n_heads, kv_heads=llama.n_heads,
        head_dim=llama.dim // llama.n_heads, dtype_bytes=4)
    for rank in range(2):
        counted = {kind: value for kind, value in measured.summary[rank]["cp"].items()
                   if kind != "all_reduce"}  # CP's own gradient averaging, apart
        assert counted == {c.kind: {"calls": c.calls, "bytes": c.payload}
                           for c in predicted}, (rank, counted)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", MODES)
def test_estimate_under_tp_equals_a_real_steps_bytes(mode: str) -> None:
    """cp 2 x tp 2: each rank's attention runs on its tp share of the heads, and so do
    the K/V CP moves; the plan's estimate (through the hooks) is the step's counted cp
    collectives, call for call and byte for byte."""
    from composer_par.estimate import ModelShape, Workload, estimate_plan
    from composer_par.testing.parity import measure_comm
    from tests.cp_workers import llama_kv4 as task

    case = _cases("llama_kv4", "tp", 4)[MODES.index(mode)]
    measured = measure_comm(attrs.evolve(case, steps=1), timeout=200)
    shape = ModelShape.from_numbers(layers=task.n_layers, hidden=task.dim,
                                    heads=task.n_heads, kv_heads=task.n_kv_heads,
                                    ffn_hidden=4 * task.dim, vocab=task.vocab_size)
    est = estimate_plan(ParallelPlan.from_toml(case.plan), shape,
                        Workload(seq=task.seq_len, micro_batch=task.global_batch,
                                 dtype="float32"), world_size=4)
    (cp,) = [t for t in est.traffic if t.dim.name == "cp"]
    predicted = {c.kind: {"calls": c.calls, "bytes": c.payload} for c in cp.collectives}
    for rank in range(4):
        counted = {kind: value for kind, value in measured.summary[rank]["cp"].items()
                   if kind != "all_reduce"}  # CP's own gradient averaging, apart
        assert counted == predicted, (rank, counted, predicted)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("checkpointing", "again"), [
    ('mode = "full"', True), ('mode = "selective"', False),
    ('mode = "selective"\nsave = ["matmul"]', True)], ids=["full", "selective", "matmul"])
@pytest.mark.parametrize("mode", MODES)
def test_checkpointing_issues_the_forwards_collectives_again_unless_saved(
        mode: str, checkpointing: str, again: bool) -> None:
    """cp 2 with activation checkpointing: full checkpointing's recomputation gathers
    (or trades) each layer's K and V again, and so does selective checkpointing that
    saves matmul outputs only; selective's default saves the functional collectives'
    outputs, CP's among them, and issues none again. The step's counted cp collectives
    are the plan's estimate, call for call and byte for byte, on both ranks."""
    from composer_par.estimate import ModelShape, Workload, estimate_plan
    from composer_par.testing.parity import measure_comm
    from tests.cp_workers import llama_kv4 as task

    plan = PLANS["cp2"].format(mode=mode).replace(
        "[[plugins]]\nname = \"cp\"",
        f"[[plugins]]\nname = \"activation_checkpoint\"\n{checkpointing}\n\n"
        "[[plugins]]\nname = \"cp\"")
    measured = measure_comm(ParityCase("tests.cp_workers:llama_kv4", plan, 2, steps=1),
                            timeout=200)
    shape = ModelShape.from_numbers(layers=task.n_layers, hidden=task.dim,
                                    heads=task.n_heads, kv_heads=task.n_kv_heads,
                                    ffn_hidden=4 * task.dim, vocab=task.vocab_size)
    est = estimate_plan(ParallelPlan.from_toml(plan), shape,
                        Workload(seq=task.seq_len, micro_batch=task.global_batch,
                                 dtype="float32"), world_size=2)
    (cp,) = [t for t in est.traffic if t.dim.name == "cp"]
    predicted: dict[str, dict[str, int]] = {}
    for c in cp.collectives:
        totals = predicted.setdefault(c.kind, {"calls": 0, "bytes": 0})
        totals["calls"] += c.calls
        totals["bytes"] += c.payload
    assert any(c.why.startswith("recomputation") for c in cp.collectives) == again
    for rank in range(2):
        counted = {kind: value for kind, value in measured.summary[rank]["cp"].items()
                   if kind != "all_reduce"}  # CP's own gradient averaging, apart
        assert counted == predicted, (rank, counted, predicted)


def test_estimate_divides_activations_by_cp_and_adds_buffers() -> None:
    from composer_par import FSDP2
    from composer_par.estimate import ModelShape, Workload, estimate_plan

    model = ModelShape.from_numbers(layers=4, hidden=256, heads=8, kv_heads=2,
                                   ffn_hidden=512, vocab=1000)
    work = Workload(seq=8192)
    # A cp rank's activations are those of half the sequence alone.
    half = estimate_plan(ParallelPlan(MeshSpec(dp_shard=4)).use(FSDP2()), model,
                         Workload(seq=4096), world_size=4)
    with_cp = estimate_plan(ParallelPlan(MeshSpec(dp_shard=2, cp=2)).use(FSDP2()).use(CP()),
                            model, work, world_size=4)
    assert with_cp.memory.activations == half.memory.activations
    kv = 2 * 2 * 32 * 4 * 8192 // 2  # K and V, 2 heads of 32, fp32, half the sequence
    assert with_cp.memory.extra == {"cp: cp allgather buffers": 4 * kv}
    traffic = next(t for t in with_cp.traffic if t.dim.name == "cp")
    cp_dim = {c.kind: c.payload for c in traffic.collectives}
    assert cp_dim == {"all_gather": 4 * 2 * 2 * 32 * 4 * 8192,
                      "all_to_all": 4 * 2 * 2 * 32 * 4 * 8192}


# -- the estimate of FSDP2 x CP and of cp across nodes -----------------------------------

# Two blocks of hidden 64 (4 heads, K/V on every head, MLP 128) and no embeddings: every
# tensor's rows divide by 4, so FSDP2 pads nothing over dp_shard x cp.
_HIDDEN, _FFN, _LAYERS = 64, 128, 2
_BLOCK = 4 * _HIDDEN * _HIDDEN + 3 * _HIDDEN * _FFN + 2 * _HIDDEN  # q k v o, gated MLP, norms
_PARAMS = _LAYERS * _BLOCK


def _shape() -> Any:
    from composer_par.estimate import ModelShape

    shape = ModelShape.from_numbers(layers=_LAYERS, hidden=_HIDDEN, heads=4, ffn_hidden=_FFN)
    assert shape.params == _PARAMS
    return shape


def _estimate(plan_toml: str, seq: int = 64) -> Any:
    from composer_par.estimate import Workload, estimate_plan

    plan = ParallelPlan.from_toml(plan_toml)
    return estimate_plan(plan, _shape(), Workload(seq=seq, dtype="float32"), world_size=4)


_TOPOLOGY = "[topology]\nnodes = 2\ndevices_per_node = 2\n\n"


def test_fsdp2_with_cp_shards_over_dp_shard_x_cp_in_the_estimate() -> None:
    """FSDP2 over dp_shard 2 x cp 2: each rank holds a quarter of the parameters, and its
    all-gathers and reduce-scatters run over the four ranks of dp_shard x cp, which span
    both nodes (ranks 0, 1 on node 0; 2, 3 on node 1)."""
    est = _estimate('[mesh]\ndp_shard = 2\ncp = 2\n\n' + _TOPOLOGY + '[[plugins]]\nname = '
                    '"fsdp2"\n\n[[plugins]]\nname = "cp"\n')
    quarter = _PARAMS // 4
    mem = est.memory
    assert (mem.local_params, mem.params, mem.grads, mem.optimizer) == (
        quarter, 4 * quarter, 4 * quarter, 8 * quarter)  # fp32 AdamW: 4 + 4 + 8 B
    dp = next(t for t in est.traffic if t.dim.name == "dp_shard")
    whole = 4 * _PARAMS  # every block gathered whole, its gradients reduce-scattered, fp32
    # forward all-gathers every block, backward all but the last again (resharded after
    # forward; the last stays gathered for its backward), then one reduce-scatter per block
    again = whole // _LAYERS * (_LAYERS - 1)
    assert {(c.kind, c.payload, c.calls, c.group_size, c.nodes) for c in dp.collectives} == {
        ("all_gather", whole, _LAYERS, 4, 2), ("all_gather", again, _LAYERS - 1, 4, 2),
        ("reduce_scatter", whole, _LAYERS, 4, 2)}
    # a ring over 4 ranks sends 3/4 of each payload; on 2 nodes of 2, half of that leaves
    # the node over this rank's own link
    sent = (2 * whole + again) * 3 / 4
    assert (dp.intra_bytes, dp.inter_bytes) == pytest.approx((sent / 2, sent / 2))


def test_hsdp_alone_with_cp_all_reduces_over_dp_replicate_x_cp() -> None:
    """HSDP alone replicates over dp_replicate and cp: each gradient is all-reduced whole
    over the four ranks, on both nodes."""
    est = _estimate('[mesh]\ndp_replicate = 2\ncp = 2\n\n' + _TOPOLOGY + '[[plugins]]\n'
                    'name = "hsdp"\n\n[[plugins]]\nname = "cp"\n')
    dp = next(t for t in est.traffic if t.dim.name == "dp_replicate")
    assert {(c.kind, c.payload, c.calls, c.group_size, c.nodes) for c in dp.collectives} == {
        ("all_reduce", 4 * _PARAMS, _LAYERS, 4, 2)}
    sent = 2 * 4 * _PARAMS * 3 / 4  # an all-reduce: twice a ring's share
    assert (dp.intra_bytes, dp.inter_bytes) == pytest.approx((sent / 2, sent / 2))


def test_cp_across_nodes_puts_its_all_to_all_bytes_on_the_network() -> None:
    """cp 4 on 2 nodes of 2: an all-to-all sends a quarter of its input to each other
    rank, one of them on this node and two on the other; the allgather mode's K/V
    all-gather is a rail-optimized ring (half its wire bytes leave the node)."""
    plan = '[mesh]\ncp = 4\n\n' + _TOPOLOGY + '[[plugins]]\nname = "cp"\nmode = "{}"\n'
    alltoall = _estimate(plan.format("alltoall"))
    cp = next(t for t in alltoall.traffic if t.dim.name == "cp")
    (exchange,) = cp.collectives
    assert exchange.kind == "all_to_all" and cp.dim.nodes == 2
    assert (cp.intra_bytes, cp.inter_bytes) == pytest.approx(
        (exchange.payload / 4, exchange.payload * 2 / 4))
    allgather = _estimate(plan.format("allgather"))
    cp = next(t for t in allgather.traffic if t.dim.name == "cp")
    payload = {c.kind: c.payload for c in cp.collectives}
    ring = payload["all_gather"] * 3 / 4
    assert (cp.intra_bytes, cp.inter_bytes) == pytest.approx(
        (ring / 2 + payload["all_to_all"] / 4, ring / 2 + payload["all_to_all"] * 2 / 4))
    # cp inside a node (dp_shard outer): nothing of cp's crosses it
    inside = _estimate('[mesh]\ndp_shard = 2\ncp = 2\n\n' + _TOPOLOGY + '[[plugins]]\nname = '
                       '"fsdp2"\n\n[[plugins]]\nname = "cp"\nmode = "alltoall"\n')
    cp = next(t for t in inside.traffic if t.dim.name == "cp")
    (exchange,) = cp.collectives
    assert (cp.intra_bytes, cp.inter_bytes) == (exchange.payload / 2, 0.0)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_fsdp2_with_cp_estimate_equals_a_real_steps_bytes() -> None:
    """FSDP2 over dp_shard 2 x cp 2: the all-gathers and reduce-scatters one step issues
    over the flattened dp_shard x cp group are, call for call and byte for byte, the
    estimate's collectives of dp_shard (counted over that group of 4)."""
    import torch

    from composer_par.estimate import ModelShape, Workload, estimate_plan
    from composer_par.testing.parity import measure_comm
    from tests.cp_workers import llama

    case = _cases("llama", "fsdp2", 4)[0]
    measured = measure_comm(attrs.evolve(case, steps=1), timeout=200)
    plan = ParallelPlan.from_toml(case.plan)
    _, shards = plan.data_shard(0, 4)
    with torch.device("meta"):
        shape = ModelShape.from_module(llama.build())
    est = estimate_plan(plan, shape, Workload(seq=llama.seq_len,
                                              micro_batch=llama.global_batch // shards),
                        world_size=4)
    dp = next(t for t in est.traffic if t.dim.name == "dp_shard")
    assert {c.group_size for c in dp.collectives} == {4}
    predicted: dict[str, dict[str, int]] = {}
    for c in dp.collectives:
        slot = predicted.setdefault(c.kind, {"calls": 0, "bytes": 0})
        slot["calls"] += c.calls
        slot["bytes"] += c.payload
    for rank in range(4):
        assert measured.summary[rank]["dp_shard+cp"] == predicted, (rank, measured.summary)


def test_ring_estimate_gathers_kv_twice_and_passes_fp32_gradients() -> None:
    """``ring`` (torch's, counted for its default rotation): K/V repeated to the query
    heads, gathered in forward and again in backward; cp passes of the fp32 K/V
    gradients in backward."""
    from composer_par.plugins.cp.estimate import attention_collectives, kv_buffer_bytes

    shape = {"size": 4, "layers": 3, "batch": 2, "seq": 64, "heads": 8, "kv_heads": 2,
             "head_dim": 16, "dtype_bytes": 2}
    gather, passes = attention_collectives("cp", "ring", **shape)
    [allgather, _] = attention_collectives("cp", "allgather", **{**shape, "kv_heads": 8})
    assert (gather.kind, gather.calls) == ("all_gather", 2 * 3)
    assert gather.payload == 2 * allgather.payload
    local_kv_fp32 = 2 * 8 * 2 * 64 // 4 * 16 * 4
    assert (passes.kind, passes.calls, passes.payload) == ("all_to_all", 3 * 4,
                                                         3 * 4 * local_kv_fp32)
    buffer = {k: v for k, v in shape.items() if k != "layers"}
    assert kv_buffer_bytes("ring", **buffer) == kv_buffer_bytes(
        "allgather", **{**buffer, "kv_heads": 8})


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize(("task", "argument"), [("llama", "positions"),
                                                ("hf_llama", "position_ids")])
def test_a_forward_without_positions_is_refused(task: str, argument: str) -> None:
    """Without the global positions of its tokens a rank's rotary embedding numbers them
    from 0, which trains a different model with no error: the forward is refused, naming
    the argument, and so are positions not cut to the layout; with the rank's own (by
    keyword, or by place) it runs. A Hugging Face model given labels it would shift
    within the rank's part is refused; given them shifted already (shift_labels) it
    runs."""
    from composer_par.testing.distributed import run_ranks

    for rank in run_ranks("tests.cp_workers:forward_without_positions", 2, args=(task,),
                          timeout=180):
        assert f"called without {argument}" in rank["without"], rank
        assert "cp.positions(seq_len)" in rank["without"], rank
        for mistake in ("unsharded", "numbered_here"):
            assert "numbered its" in rank[mistake] and "from 0" in rank[mistake], rank
            assert "cp.shard(tokens)" in rank[mistake], rank
        assert "past its place in the load-balanced layout" in rank["contiguous"], rank
        assert rank["keyword"] == rank.get("positional", "ran") == "ran", rank
        if argument == "position_ids":  # a Hugging Face model shifts labels it is given
            assert "shift by one place within this rank's part" in rank["labels"], rank
            assert "cp.shard(next_token_labels(tokens))" in rank["labels"], rank
            assert rank["shift_labels"] == "ran", rank


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("ranks", [2, 4])
def test_positions_not_cut_to_the_layout_are_told_from_packed_documents(ranks: int) -> None:
    """A rank's positions are refused where no cut of whole sequences gives them: every
    rank numbering from 0 (whole sequences on every rank, or each part numbered alone) or
    a contiguous split. The layout's own positions, and packed documents' (positions that
    restart, including two equal halves, which number rank 0's tokens from 0) pass."""
    from composer_par.testing.distributed import run_ranks

    for seed in (0, 1):
        for rank in run_ranks("tests.cp_workers:positions_judged", ranks, args=(seed,),
                              timeout=180):
            for label in ("layout", "layout_batch", "two_halves", "chunk_docs",
                          "random_docs"):
                assert rank[label] is None, (label, rank)
            assert "numbered its 8 tokens from 0" in rank["numbered_here"], rank
            assert "past its place" in rank["contiguous"], rank
