"""TP on multi-head latent attention (DeepSeek-V2 and V3, tiny configs): at parity with one
process on real gloo ranks, losses and every rank's full parameters.

DeepSeek-V2's own tp plan splits the heads (q_proj, kv_b_proj colwise, o_proj rowwise)
and gives ``kv_a_proj_with_mqa`` the style ``mla_kv_a_proj``: the projection stays whole,
and the rotary part of its output, which every head reads directly, has its gradient
summed over tp (each rank's heads give only their part of it). Its ``kv_a_layernorm``
runs on the replicated latent and keeps its gradient as it is. DeepSeek-V3's plan (in
transformers 5.24) leaves attention whole and splits the experts. Experts left whole
(``replicate_rest``) compute on local tensors, so transformers' grouped_mm runs in float32
as in one process.
"""

from __future__ import annotations

import pytest

from composer_par.testing.parity import ParityCase, check_parity

pytestmark = pytest.mark.distributed

TASKS = ["deepseek_v2", "deepseek_v3"]
INIT = '\n[[plugins]]\nname = "meta_init"\nseed = 7\n'
TP = '[[plugins]]\nname = "tp"\n'
PLANS = {
    "tp 2": (2, "[mesh]\ntp = 2\n\n" + TP + INIT),
    "tp 2, replicate_rest = false": (2, "[mesh]\ntp = 2\n\n" + TP + "replicate_rest = false\n"
                                     + INIT),
    "fsdp2 x tp": (4, '[mesh]\ndp_shard = 2\ntp = 2\n\n[[plugins]]\nname = "fsdp2"\n\n' + TP
                   + INIT),
    "ep x tp": (4, '[mesh]\nep = 2\ntp = 2\n\n[[plugins]]\nname = "ep"\n\n' + TP + INIT),
}


def _parity(task: str, plan: str, world: int) -> None:
    case = ParityCase(task=f"tests.ep_workers:{task}", plan=plan, world_size=world, steps=3,
                      lr=0.5, reference="accumulate")
    result = check_parity(case, timeout=400)
    result.assert_close()
    assert result.losses[-1] != result.losses[0], result.losses  # it trained


@pytest.mark.timeout(900)
@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("task", TASKS)
def test_latent_attention_under_tp_matches_single_process(task: str, plan: str) -> None:
    world, text = PLANS[plan]
    _parity(task, text, world)


@pytest.mark.timeout(600)
def test_experts_left_whole_run_grouped_mm_in_float32() -> None:
    """Mixtral with a tp plan that names attention only: its experts are replicated with
    the rest, and their grouped matrix products run on local float32 tensors (DTensor's
    propagation of grouped_mm accepts bf16 only)."""
    plan = ("[mesh]\ntp = 2\n\n" + TP + "[plugins.plan]\n"
            + "".join(f'"model.layers.*.self_attn.{p}_proj" = "colwise"\n' for p in "qkv")
            + '"model.layers.*.self_attn.o_proj" = "rowwise"\n' + INIT)
    _parity("mixtral", plan, 2)
