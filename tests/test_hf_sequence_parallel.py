"""TP with sequence parallel on Hugging Face models beyond the matrix's dense ones (tiny
configs, 3 steps of SGD on 2 real gloo ranks, every rank's parameter parts and the losses
against the single-process reference, as in test_hf_models).

Under a Hugging Face model's own plan the residual stream stays a DTensor sharded on the
sequence, and a module whose layers the plan splits gathers its input once
(``sequence_region``), kept a DTensor. A MoE block computes on plain tensors beside its
split layers (its router, experts run on local parts, a shared expert one module down),
and DeepSeek-V3's latent attention beside ``q_a_proj``, which the plan leaves whole: a
DTensor there met a plain tensor in the first forward. Such a module gets its gathered
input as a plain tensor (``sequence_region_local``) and computes as without sequence
parallel. A plan that leaves a block's layers whole outside any split module (HunYuan's
splits the token embedding only) is refused before anything is applied (CP408).
"""

from __future__ import annotations

import pytest

from composer_par import TP
from tests import hf_workers

pytest.importorskip("transformers")


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_moe_blocks_and_latent_attention_train_at_parity_under_sequence_parallel() -> None:
    cases = [("qwen2_moe", "tp_sp"), ("deepseek_v3", "tp_sp")]
    results = hf_workers.trained(cases, 2, timeout=240)
    assert all(row["applied"] for rows in results for row in rows)


def test_a_module_with_plain_tensors_beside_split_layers_gets_a_plain_input() -> None:
    from composer_par.plugins.tp.resolution import resolve

    resolution = resolve(TP(sequence_parallel=True), hf_workers.build("deepseek_v3"), 2)
    assert not resolution.findings
    specs = {path: spec for path, _, spec in resolution.entries}
    layer = "model.layers.1"
    assert specs[f"{layer}.self_attn"].style == "sequence_region_local"
    assert specs[f"{layer}.mlp"].style == "sequence_region_local"
    # the shared expert is no region of its own: the MoE block gathered its input
    assert f"{layer}.mlp.shared_experts" not in specs
    down = specs[f"{layer}.mlp.shared_experts.down_proj"]
    assert (down.output_layouts, down.use_local_output) == (("replicate",), True)
    assert specs[f"{layer}.mlp.shared_experts.up_proj"].input_layouts == ("replicate",)
    # a dense block's MLP keeps the DTensor region
    assert specs["model.layers.0.mlp"].style == "sequence_region"


def test_a_plan_leaving_layers_whole_on_the_stream_is_refused_cp408() -> None:
    from composer_par.plugins.tp.resolution import resolve

    resolution = resolve(TP(sequence_parallel=True), hf_workers.build("hunyuan"), 2)
    assert [f.code for f in resolution.findings] == ["CP408"]
    message = resolution.findings[0].message
    assert "model.layers.*.self_attn.q_proj" in message
    assert "model.layers.*.mlp.down_proj" in message
    assert "whole outside any module whose layers it splits" in message
