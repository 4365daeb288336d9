"""Real Hugging Face models, without processes: what TP(plan="auto") reads from them and
the styles it gives, the fallbacks and findings (CP407 beside CP408/CP420, CP409, CP421),
sequence parallel's layouts or its refusal, tied weights against FSDP blocks (CP424),
activation checkpointing and the generation cache (CP422, CP423), MetaInit's
distribution against the model's own ``post_init``, and the model's own FSDP and
expert-parallel plans (CP425-CP427; one test applies FSDP2 on 2 gloo ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from composer_par.plugins.tp import resolve

from composer_par import (
    FSDP2,
    TP,
    ActivationCheckpoint,
    MeshSpec,
    MetaInit,
    ParallelPlan,
    PlanError,
)
from composer_par.blocks import find_blocks
from composer_par.findings import Report
from composer_par.plugin.initialize import materialize
from tests import hf_workers

pytest.importorskip("transformers")


def only(report: Report, code: str) -> Any:
    found = [f for f in report.findings if f.code == code]
    assert len(found) == 1, report.format()
    return found[0]


def styles(family: str, **tp: Any) -> dict[str, str]:
    resolution = resolve(TP(**tp), hf_workers.build(family), 2)
    assert not [f for f in resolution.findings if f.severity.value == "error"], (
        resolution.findings)
    out = {p: s.style for p, _, s in resolution.entries}
    out.update({p: s.style for p, _, _, s in resolution.params})
    return out


# -- what the auto plan reads -----------------------------------------------------------


def test_auto_plan_is_the_instance_plan_with_its_prefixes() -> None:
    got = styles("llama")
    assert got["model.embed_tokens"] == "embedding_rowwise"  # only on the instance plan
    assert got["lm_head"] == "colwise_gather"  # colwise_gather_output
    assert got["model.layers.1.self_attn.k_proj"] == "colwise"
    assert got["model.layers.0.mlp.down_proj"] == "rowwise"
    assert resolve(TP(), hf_workers.build("llama"), 2).source == "Hugging Face tp plan"


def test_every_style_of_these_families_is_honoured() -> None:
    qwen3 = styles("qwen3")  # replicated_with_grad_allreduce
    assert qwen3["model.layers.0.self_attn.q_norm"] == "replicate_grad_allreduce"
    phi3 = styles("phi3")  # colwise_gather_output inside attention, rowwise_split_input
    assert phi3["model.layers.0.self_attn.qkv_proj"] == "colwise_gather"
    assert phi3["model.layers.0.self_attn.o_proj"] == "rowwise"
    resolution = resolve(TP(), hf_workers.build("phi3"), 2)
    o_proj = {p: s for p, _, s in resolution.entries}["model.layers.0.self_attn.o_proj"]
    assert o_proj.input_layouts == ("replicate",)
    for family in ("mixtral", "qwen3_moe"):  # packed_colwise and rowwise on parameters
        moe = styles(family)
        assert moe["model.layers.0.mlp.experts"] == "experts"  # moe_tp_experts
        assert moe["model.layers.0.mlp.experts.gate_up_proj"] == "packed_colwise"
        assert moe["model.layers.0.mlp.experts.down_proj"] == "rowwise"
    assert styles("gpt_neox")["gpt_neox.embed_in"] == "embedding_rowwise"


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3"])
def test_fused_experts_split_as_transformers_5_24_split_them_on_any_release(
        family: str) -> None:
    # transformers 5.25 dropped these entries from its models' tp plans; the plan the
    # same TP() makes is the same on both releases (and on 5.24 nothing is added).
    from composer_par.plugins.tp.auto import fused_expert_entries, hf_tp_plan

    from tests import ep_workers

    with torch.device("meta"):
        model = getattr(ep_workers, family).build()
    plan = hf_tp_plan(model)
    assert plan["model.layers.*.mlp.experts"] == "moe_tp_experts"
    assert plan["model.layers.*.mlp.experts.gate_up_proj"] == "packed_colwise"
    assert plan["model.layers.*.mlp.experts.down_proj"] == "rowwise"
    own = {**model._tp_plan, "model.layers.*.mlp.experts": "replicate"}
    assert fused_expert_entries(model, own) == {}  # a plan that names them keeps its word


def test_experts_with_biases_or_no_ep_plan_get_no_entries() -> None:
    from composer_par.plugins.tp.auto import fused_expert_entries

    assert fused_expert_entries(hf_workers.build("llama"), {}) == {}
    # gpt-oss's experts carry biases transformers never split over tp
    from tests import ep_gpt_oss_workers

    with torch.device("meta"):
        gpt_oss = ep_gpt_oss_workers.GptOssTask().build()
    assert fused_expert_entries(gpt_oss, {}) == {}


def test_cp407_is_reported_beside_a_plan_problem() -> None:
    # tp 4 on 2 KV heads, with a style TP does not honour in the model's own plan: the
    # head count is still checked (and the style falls back: CP420, a warning).
    model = hf_workers.build("llama")
    model._tp_plan = {**model._tp_plan, "model.layers.*.self_attn.q_proj": "ep_router"}
    plan = ParallelPlan(MeshSpec(dp_shard=16, tp=4)).use(FSDP2()).use(TP()).use(MetaInit())
    report = plan.validate(model, world_size=64)
    # (and FSDP2 follows the model's own FSDP plan: CP425, an info)
    assert sorted(report.codes()) == ["CP407", "CP420", "CP425"], report.format()
    assert "num_key_value_heads=2" in only(report, "CP407").message
    fallback = only(report, "CP420")
    assert "'ep_router'" in fallback.message and "self_attn.q_proj" in fallback.message
    # and beside a pattern that matches nothing (CP408)
    typo = {**hf_workers.HANDWRITTEN, "model.layers.*.self_attn.q_projj": "colwise"}
    plan = ParallelPlan(MeshSpec(dp_shard=16, tp=4)).use(FSDP2()).use(TP(plan=typo))
    report = plan.use(MetaInit()).validate(hf_workers.build("qwen3"), world_size=64)
    assert {"CP407", "CP408"} <= set(report.codes()), report.format()


def test_a_style_tp_does_not_honour_leaves_its_module_whole() -> None:
    model = hf_workers.build("mixtral")
    model._tp_plan = {**model._tp_plan, "model.layers.*.mlp.experts": "ep_dispatch_experts"}
    resolution = resolve(TP(), model, 2)
    assert [f.code for f in resolution.findings] == ["CP420"]
    got = {p for p, _, _ in resolution.entries} | {p for p, _, _, _ in resolution.params}
    assert not [p for p in got if ".experts" in p]  # the experts and their weights: whole
    assert "model.layers.0.self_attn.q_proj" in got  # the rest of the plan applies
    assert "expert-parallel" in resolution.findings[0].message


def test_norms_beside_split_projections_get_their_gradient_summed() -> None:
    plan = TP(plan=hf_workers.HANDWRITTEN)  # q_norm / k_norm left out
    resolution = resolve(plan, hf_workers.build("qwen3"), 2)
    got = {p: s.style for p, _, s in resolution.entries}
    assert got["model.layers.0.self_attn.k_norm"] == "replicate_grad_allreduce"
    assert "model.layers.0.input_layernorm" not in got  # on the replicated stream
    finding = only(Report.of(resolution.findings), "CP421")
    assert "model.layers.*.self_attn.q_norm" in finding.message


def test_tied_embeddings_stay_tied_or_the_plan_says_why() -> None:
    resolution = resolve(TP(), hf_workers.build("gemma"), 2)
    assert len(resolution.ties) == 1  # embedding_rowwise and colwise_gather: dim 0 both
    plan = {**hf_workers.HANDWRITTEN, "model.embed_tokens": "embedding_colwise"}
    report = ParallelPlan(MeshSpec(tp=2)).use(TP(plan=plan)).use(MetaInit()).validate(
        hf_workers.build("gemma"), world_size=2)
    finding = only(report, "CP409")
    assert "is tied to" in finding.message and "shard(1)" in finding.message
    assert "leave both" in finding.fix


# -- one gradient sum per shared input ------------------------------------------------------


def test_attention_and_mlp_share_their_input_and_moe_blocks_do_not() -> None:
    """Without sequence parallel the auto plan gives attention and the MLP
    ``shared_input`` (their colwise layers' input gradients summed once); a
    mixture-of-experts block, whose router stays replicated, keeps the sum per layer;
    sequence parallel and an explicit plan get none."""
    llama = styles("llama")
    assert llama["model.layers.0.self_attn"] == "shared_input"
    assert llama["model.layers.0.mlp"] == "shared_input"
    assert llama["model.layers.0.self_attn.q_proj"] == "colwise"
    qwen3 = styles("qwen3")  # its per-head q/k norms work on what q and k produce
    assert qwen3["model.layers.0.self_attn"] == "shared_input"
    mixtral = styles("mixtral")
    assert mixtral["model.layers.0.self_attn"] == "shared_input"
    assert "model.layers.0.mlp" not in mixtral
    assert "shared_input" not in styles("llama", sequence_parallel=True).values()
    assert "shared_input" not in styles("llama", plan=hf_workers.HANDWRITTEN).values()


# -- sequence parallel ------------------------------------------------------------------


def test_sequence_parallel_keeps_the_stream_a_sequence_sharded_dtensor() -> None:
    resolution = resolve(TP(sequence_parallel=True), hf_workers.build("mixtral"), 2)
    assert not resolution.findings
    got = {p: s for p, _, s in resolution.entries}
    assert got["model.embed_tokens"].output_layouts == ("shard(1)",)
    assert got["model.embed_tokens"].use_local_output is False
    assert got["model.layers.0.self_attn.o_proj"].output_layouts == ("shard(1)",)
    assert got["model.layers.0.input_layernorm"].style == "sequence_parallel"
    assert got["model.norm"].style == "sequence_parallel"
    assert got["model.layers.0.self_attn"].style == "sequence_region"
    # the MoE block: its router and experts compute on plain tensors
    assert got["model.layers.0.mlp"].style == "sequence_region_local"


def test_sequence_parallel_is_refused_before_anything_changes_where_it_cannot_work() -> None:
    model = hf_workers.build("vit")
    plan = ParallelPlan(MeshSpec(tp=2)).use(TP(sequence_parallel=True)).use(MetaInit())
    with pytest.raises(PlanError) as err:
        plan.apply(model)
    assert "found no token embedding" in only(err.value.report, "CP408").message
    assert all(p.is_meta for p in model.parameters())


# -- blocks and tied weights ------------------------------------------------------------


def test_detected_blocks_never_split_tied_weights() -> None:
    model = hf_workers.build("bert")
    blocks = [p for p, _ in find_blocks(model)]
    # _no_split_modules names BertEmbeddings, whose word embedding is the MLM decoder's.
    assert "bert.embeddings" not in blocks
    assert blocks == ["bert.encoder.layer.0", "bert.encoder.layer.1"]


def test_explicit_blocks_splitting_a_tie_are_refused_untouched_cp424() -> None:
    model = hf_workers.build("bert")
    before = {n: p for n, p in model.named_parameters()}
    plan = (ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2(blocks=["BertEmbeddings", "BertLayer"]))
            .use(MetaInit()))
    with pytest.raises(PlanError) as err:
        plan.apply(model)
    finding = only(err.value.report, "CP424")
    assert "bert.embeddings.word_embeddings.weight" in finding.message
    assert "cls.predictions.decoder.weight" in finding.message
    assert {n: p for n, p in model.named_parameters()} == before
    assert all(p.is_meta for p in model.parameters())


# -- activation checkpointing -----------------------------------------------------------


def test_checkpointed_training_runs_without_the_generation_cache_cp422() -> None:
    model = hf_workers.build("llama")
    plan = ParallelPlan(MeshSpec()).use(ActivationCheckpoint()).use(MetaInit(seed=1))
    assert "use_cache is True" in only(plan.validate(model), "CP422").message
    model = plan.apply(model)
    model.train()
    inputs = hf_workers.batch("llama", 0)
    out = model(**inputs)  # a recomputed block appending to a cache fails in backward
    out.loss.backward()
    assert out.past_key_values is None
    assert all(p.grad is not None for p in model.parameters())
    model.eval()
    with torch.no_grad():
        assert model(input_ids=inputs["input_ids"]).past_key_values is not None
    assert model.config.use_cache is True  # generation is unchanged


def test_a_model_without_gradient_checkpointing_support_gets_cp423() -> None:
    model = hf_workers.build("vit")
    model.supports_gradient_checkpointing = False
    report = ParallelPlan(MeshSpec()).use(ActivationCheckpoint()).use(MetaInit()).validate(model)
    finding = only(report, "CP423")
    assert finding.severity.value == "warning" and "ViTForImageClassification" in finding.message


# -- MetaInit against post_init ---------------------------------------------------------


@pytest.mark.parametrize("family", list(hf_workers.FAMILIES))
def test_meta_init_draws_from_the_models_own_initialization(family: str) -> None:
    ours = hf_workers.build(family)
    materialize(ours, torch.device("cpu"), 3)
    theirs = hf_workers.build(family, meta=False)  # post_init on CPU
    mine = dict(ours.named_parameters(remove_duplicate=False))
    for name, param in theirs.named_parameters(remove_duplicate=False):
        a, b = mine[name].detach(), param.detach()
        assert a.shape == b.shape, name
        if b.numel() < 64 or float(b.std()) == 0.0:  # constants: ones, zeros
            assert torch.equal(a, b), name
            continue
        # Two samples of one distribution: means within 5 standard errors, spreads
        # within 5 standard errors of a standard deviation's estimate.
        n = b.numel()
        assert abs(float(a.mean()) - float(b.mean())) < 5 * float(b.std()) / n**0.5, name
        assert abs(float(a.std()) / float(b.std()) - 1) < 5 / (2 * n) ** 0.5, (
            name, a.std(), b.std())
        assert not torch.equal(a, b), name  # our own draws
    # buffers (rotary inverse frequencies, position ids, Gemma's embedding scale)
    buffers = dict(ours.named_buffers())
    for name, buffer in theirs.named_buffers():
        assert torch.equal(buffers[name], buffer), name
    # ties as the model makes them
    assert hf_workers._tied(ours) == hf_workers._tied(theirs)


def test_gpt2_scaled_residual_projections() -> None:
    """GPT-2's _init_weights rescales c_proj from its attention and MLP modules (which own
    no weights themselves): std 0.02 / sqrt(2 * n_layer) = 0.01 with 2 layers."""
    model = hf_workers.build("gpt2")
    materialize(model, torch.device("cpu"), 0)
    for block in model.transformer.h:
        for owner in (block.attn, block.mlp):
            assert abs(float(owner.c_proj.weight.detach().std()) - 0.01) < 0.0015
        assert abs(float(block.mlp.c_fc.weight.detach().std()) - 0.02) < 0.002


# -- estimate -----------------------------------------------------------------------------


def test_estimate_follows_the_models_attention_implementation() -> None:
    from composer_par.estimate import ModelShape, Workload, estimate_plan

    plan = ParallelPlan(MeshSpec(dp_shard=8)).use(FSDP2()).use(MetaInit())
    work = Workload(seq=4096, dtype="bf16", optimizer="adamw")  # attention: sdpa (default)
    found = {}
    for kind in ("sdpa", "eager"):
        model = hf_workers.build("llama", attn_implementation=kind)
        shape = ModelShape.from_module(model)
        assert shape.attention == kind and f"attention {kind} (its config)" in shape.describe()
        est = estimate_plan(plan, shape, work, world_size=8)
        assert est.workload.attention == kind
        found[kind] = est.memory.activations
    # eager keeps the attention scores (5 * heads * seq / hidden per token and layer)
    assert found["eager"] > 10 * found["sdpa"]


# -- the model's own FSDP and expert-parallel plans -----------------------------------------


def test_the_models_own_fsdp_plan_gives_units_beside_the_blocks_cp425() -> None:
    from composer_par.plugins.fsdp2 import own_units

    model = hf_workers.build("llama")
    assert model._fsdp_plan == {"lm_head": "keep_full_weight",  # transformers 5.24's own
                                "model.embed_tokens": "free_full_weight",
                                "model.layers.*": "free_full_weight",
                                "model.norm": "keep_full_weight"}
    units, left = own_units(model, find_blocks(model))
    assert [(u.paths, u.style) for u in units] == [
        (("lm_head",), "keep_full_weight"), (("model.embed_tokens",), "free_full_weight"),
        (("model.norm",), "keep_full_weight")] and not left  # model.layers.*: the blocks
    plan = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(MetaInit())
    finding = only(plan.validate(model, world_size=2), "CP425")
    assert finding.severity.value == "info"
    # the final norm (one small weight) joins the head it feeds: one unit, kept whole
    assert ("model.embed_tokens (free_full_weight), model.norm + lm_head (keep_full_weight)"
            in finding.message)
    assert "model.norm (64 small parameter(s)) with lm_head" in finding.message
    # A tied embedding and head stay in the root's unit, together.
    units, left = own_units(hf_workers.build("gemma"), find_blocks(hf_workers.build("gemma")))
    assert [u.key for u in units] == ["model.norm"]
    assert [key for key, _ in left] == ["lm_head", "model.embed_tokens"]
    assert "is tied to model.embed_tokens.weight outside it" in left[0][1]
    # transformers' default plan names base-model modules GPT-2, ViT and BERT lack (and
    # layers GPT-NeoX has as its blocks): nothing beside the blocks, nothing said.
    for family in ("gpt2", "vit", "bert", "gpt_neox"):
        model = hf_workers.build(family)
        assert own_units(model, find_blocks(model)) == ([], []), family
        assert "CP425" not in plan.validate(model, world_size=2).codes(), family


def test_explicit_blocks_replace_the_models_own_fsdp_plan_cp426() -> None:
    plan = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2(blocks="model.layers")).use(MetaInit())
    report = plan.validate(hf_workers.build("qwen3"), world_size=2)
    finding = only(report, "CP426")
    assert "blocks='model.layers' gives the FSDP units" in finding.message
    assert "model.norm (keep_full_weight)" in finding.message and "CP425" not in report.codes()


def test_the_expert_parallel_plan_is_reported_as_not_applied_cp427() -> None:
    plan = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(MetaInit())
    for family in ("mixtral", "qwen3_moe"):
        model = hf_workers.build(family)
        assert model._ep_plan["model.layers.*.mlp.experts"] == "ep_dispatch_experts"
        finding = only(plan.validate(model, world_size=2), "CP427")
        assert "which no plugin of this plan applies" in finding.message
        assert "add EP()" in (finding.fix or "")
        assert finding.severity.value == "info"
    assert "CP427" not in plan.validate(hf_workers.build("llama"), world_size=2).codes()
    # With EP in the plan the experts are dispatched: nothing to report.
    from composer_par import EP

    with_ep = ParallelPlan(MeshSpec(dp_shard=2, ep=2)).use(FSDP2()).use(EP()).use(MetaInit())
    assert "CP427" not in with_ep.validate(hf_workers.build("mixtral"), world_size=4).codes()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp2_shards_the_models_own_units_as_its_plan_says() -> None:
    from composer_par.testing.distributed import run_ranks

    for result in run_ranks(hf_workers.own_fsdp_units, 2, args=("llama",), timeout=240):
        assert result["units"] == ["lm_head", "model.embed_tokens", "model.layers.0",
                                   "model.layers.1", "model.norm"]
        # keep_full_weight: whole from forward to backward; free_full_weight: sharded again
        assert result["sharded_after_forward"] == {
            "lm_head": False, "model.norm": False, "model.embed_tokens": True}
        assert ("the model's own FSDP units: model.embed_tokens (free_full_weight), "
                "model.norm + lm_head (keep_full_weight)") in result["applied"][0]
        assert "joined: model.norm (64 small parameter(s)) with lm_head" in result["applied"][0]
