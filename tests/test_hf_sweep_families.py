"""Two families of the wider Hugging Face sweep that need more than the matrix's code
paths (tiny configs, built on meta, 3 steps of SGD on real gloo ranks, every rank's
parameter parts against the single-process reference, as in test_hf_models):

- StableLm under FSDP2 x TP(auto): it has no tp plan of its own, the Llama-name fallback
  splits q, k and v, and its attention reshapes by its own head counts, which TP sets to
  the local ones; with per-head q/k norms it is refused (CP431). Under TP with sequence
  parallel (2 ranks) its names get the layout of a Hugging Face plan.
- Apertus under FSDP2 + MetaInit: its XIELU activation's alpha_p / alpha_n (and beta /
  eps buffers) are set by its constructor only (``_init_weights`` leaves them alone);
  MetaInit builds the activation's MLP once on CPU from its config and copies them.
  Under TP its plan leaves that activation out, between two split layers: its scalars'
  gradients are summed over tp.
"""

from __future__ import annotations

from typing import Any

import pytest

from composer_par import TP, MeshSpec, MetaInit, ParallelPlan
from tests import hf_workers

pytest.importorskip("transformers")


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_stablelm_trains_at_parity_under_fsdp2_x_tp_auto() -> None:
    cases = [("stablelm", "fsdp2_tp")]
    results = hf_workers.trained(cases, 4, timeout=540)
    assert all(rows[0]["applied"] for rows in results)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_stablelm_trains_at_parity_under_tp_with_sequence_parallel() -> None:
    """Its forward computes positions from the stream's shape: the stream stays a DTensor
    of the full sequence, as under a Hugging Face model's own plan."""
    cases = [("stablelm", "tp_sp")]
    results = hf_workers.trained(cases, 2, timeout=240)
    assert all(rows[0]["applied"] for rows in results)


def test_stablelm_under_sequence_parallel_gathers_once_per_attention_and_mlp() -> None:
    from composer_par.plugins.tp.resolution import resolve

    model = hf_workers.build("stablelm")
    resolution = resolve(TP(sequence_parallel=True), model, 2)
    assert not resolution.findings
    styles = {path: spec.style for path, _, spec in resolution.entries}
    for layer in ("model.layers.0", "model.layers.1"):
        assert styles[f"{layer}.self_attn"] == styles[f"{layer}.mlp"] == "sequence_region"
        assert styles[f"{layer}.input_layernorm"] == "sequence_parallel"
        assert styles[f"{layer}.post_attention_layernorm"] == "sequence_parallel"
    embedding = next(spec for path, _, spec in resolution.entries
                     if path == "model.embed_tokens")
    assert embedding.output_layouts == ("shard(1)",) and embedding.use_local_output is False
    stage = resolve(TP(sequence_parallel=True), model, 2, ends=False)
    assert [f.code for f in stage.findings] == ["CP408"]
    assert "pipeline stage of a Hugging Face model laid out by the auto plan from its " \
           "Llama names" in stage.findings[0].message


def test_stablelm_attention_head_counts_become_local_after_the_split() -> None:
    from composer_par.plugins.tp.resolution import resolve

    model = hf_workers.build("stablelm")
    resolution = resolve(TP(), model, 2)
    assert resolution.source == "Hugging Face Llama names"
    assert not [f for f in resolution.findings if f.code == "CP431"]
    set_attrs = {(type(m).__name__, a, v) for m, a, v in resolution.local_heads}
    assert set_attrs == {("StableLmAttention", "num_heads", 2),
                         ("StableLmAttention", "num_key_value_heads", 1)}
    assert len(resolution.local_heads) == 2 * 2  # two layers


def test_per_head_norms_under_the_name_fallback_are_refused_cp431() -> None:
    model = hf_workers.build("stablelm", qk_layernorm=True)
    report = ParallelPlan(MeshSpec(tp=2)).use(TP()).use(MetaInit()).validate(model)
    assert report.codes() == ["CP431"], report.format()
    finding = report.findings[0]
    assert "model.layers.*.self_attn (StableLmAttention)" in finding.message
    assert "q_layernorm" in finding.message


def test_a_forward_reading_the_config_head_count_is_refused_cp431() -> None:
    import torch.nn as nn

    class Attention(nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()
            self.config = config
            self.q_proj, self.k_proj = nn.Linear(8, 8), nn.Linear(8, 8)
            self.v_proj, self.o_proj = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):  # type: ignore[no-untyped-def]
            q = self.q_proj(x).view(*x.shape[:2], self.config.num_attention_heads, -1)
            return self.o_proj(q.flatten(2) + self.k_proj(x) + self.v_proj(x))

    class Config:
        num_attention_heads = 2

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.ModuleDict({"self_attn": Attention(Config())})])

    report = ParallelPlan(MeshSpec(tp=2)).use(TP()).use(MetaInit()).validate(Model())
    assert "CP431" in report.codes(), report.format()
    assert "config.num_attention_heads" in report.format()


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_apertus_trains_at_parity_under_fsdp2_with_meta_init_and_under_tp() -> None:
    cases = [("apertus", "fsdp2"), ("apertus", "tp")]
    results = hf_workers.trained(cases, 2, timeout=540)
    assert all(rows[0]["applied"] for rows in results)


def test_apertus_xielu_gets_the_values_of_a_model_built_on_cpu() -> None:
    import torch

    cpu = hf_workers.build("apertus", meta=False)
    model = hf_workers.build("apertus")
    ParallelPlan(MeshSpec()).use(MetaInit(seed=3)).apply(model)
    for layer, built in zip(model.model.layers, cpu.model.layers, strict=True):
        ours, theirs = layer.mlp.act_fn, built.mlp.act_fn
        for name in ("alpha_p", "alpha_n", "beta", "eps"):
            assert torch.equal(getattr(ours, name), getattr(theirs, name)), name


def test_an_activation_left_out_of_a_hf_plan_between_split_layers_sums_its_gradient(
) -> None:
    """Apertus's plan splits up_proj and down_proj and leaves the XIELU activation between
    them out: it runs on each rank's part of the MLP, so its two scalars' gradients are
    summed over tp (CP421). DeepSeek-V3's plan leaves q_a_proj whole and q_a_layernorm out:
    that norm runs on the whole projection's output and stays replicated."""
    from composer_par.plugins.tp.resolution import resolve

    apertus = resolve(TP(), hf_workers.build("apertus"), 2)
    styles = {path: spec.style for path, _, spec in apertus.entries}
    assert styles["model.layers.0.mlp.act_fn"] == "replicate_grad_allreduce"
    assert [f.code for f in apertus.findings] == ["CP421"]
    assert "model.layers.*.mlp.act_fn (XIELUActivation)" in apertus.findings[0].message
    deepseek = resolve(TP(), hf_workers.build("deepseek_v3"), 2)
    assert not deepseek.findings
    assert "model.layers.0.self_attn.q_a_layernorm" in [n for n, _ in deepseek.rest]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_granitemoe_trains_at_parity_under_selective_checkpointing() -> None:
    """Its causal LM's forward takes use_cache through **kwargs: the plugin turns the
    generation cache off (CP422), or the recomputation in backward finds the keys and
    values the forward appended to it and runs different ops (torch refuses the step)."""
    cases = [("granitemoe", "fsdp2_ac_selective")]
    results = hf_workers.trained(cases, 2, timeout=240)
    assert all("CP422" in rows[0]["codes"] for rows in results)


def test_a_constructor_set_module_is_built_again_from_arguments_it_keeps() -> None:
    """A module whose constructor sets its parameter and keeps its arguments as
    attributes is initialized from a CPU copy; one whose constructor leaves a tensor
    empty (torch.empty) is not, and MetaInit still refuses it (CP404)."""
    import torch
    import torch.nn as nn

    from composer_par import PlanError

    class Offset(nn.Module):
        def __init__(self, width: int, start: float = 0.25) -> None:
            super().__init__()
            self.width, self.start = width, start
            self.offset = nn.Parameter(torch.full((width,), start))

    class Empty(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.width = width
            self.offset = nn.Parameter(torch.empty(width))

    with torch.device("meta"):
        offset = Offset(3, start=0.5)
        model = nn.Sequential(nn.Linear(2, 3), offset)
    ParallelPlan(MeshSpec()).use(MetaInit()).apply(model)
    assert torch.equal(offset.offset.detach(), torch.full((3,), 0.5))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 3), Empty(3))
    with pytest.raises(PlanError) as err:
        ParallelPlan(MeshSpec()).use(MetaInit()).apply(model)
    assert err.value.report.codes() == ["CP404"]
