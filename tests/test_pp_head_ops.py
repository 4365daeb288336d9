"""PP at parity on models whose forward works on the hidden state outside any module a
stage could leave out: what a ``*ForCausalLM`` does to its head's output (Granite divides
the logits by ``logits_scaling``, Gemma 2 softcaps them) runs once, on the stage holding
the head, and what the base model does to its embedding's output (Granite's
``embedding_multiplier``) once, on the first stage. Llama, which does neither, is the
case with nothing to leave out.

Real gloo ranks, ``plan.training_step``, losses and every parameter (each rank's stage,
gathered) against single-process training from the same MetaInit weights.
"""

from __future__ import annotations

import pytest

from tests.test_pp_parity import case, check, pp

pytestmark = pytest.mark.distributed

# Clipped as the other Hugging Face cases are (unclipped at lr 1, the microbatches'
# summation order grows past atol in the steps), at a norm each model's gradients pass:
# Granite's logits divided by 8 give it smaller ones.
TASKS = {"Granite (logits_scaling, embedding_multiplier)": ("hf_granite", 0.1),
         "Gemma 2 (final_logit_softcapping)": ("hf_gemma2", 0.5),
         "Llama (no op around the head)": ("hf_llama", 0.5)}


def test_ops_around_the_head_run_once_on_two_stages() -> None:
    cases = {f"{name}, PP 2, 1F1B": case(task, "pp = 2", pp("1F1B"), world=2, clip=clip)
             for name, (task, clip) in TASKS.items()}
    # Two stages per rank: the first stage's part and the last's are copies of one model.
    cases["Granite, PP 2, Interleaved1F1B"] = case(
        "hf_granite", "pp = 2", pp("Interleaved1F1B", stages_per_rank=2), world=2, clip=0.1)
    check(cases, timeout=900)


def test_each_stage_says_which_ops_it_leaves_to_the_other() -> None:
    from composer_par.testing.distributed import run_ranks
    from tests.pp_workers import boundary_events

    found = {task: run_ranks(boundary_events, 2, args=(task,), timeout=300)
             for task in ("hf_granite", "hf_gemma2", "hf_llama")}
    first, last = found["hf_granite"]
    # Stage 0 leaves the division by logits_scaling to stage 1, which leaves the
    # multiplication by embedding_multiplier to stage 0; each said once.
    assert [(e["stage"], e["left_out_after_last_block"]) for e in first] == [(0, ["div"])]
    assert [(e["stage"], e["left_out_before_first_block"]) for e in last] == [(1, ["mul"])]
    assert first[0]["model"] == "GraniteForCausalLM"
    gemma_first, _ = found["hf_gemma2"]
    assert gemma_first[0]["left_out_after_last_block"] == ["div", "tanh", "mul"]
    # Llama applies nothing around its head or embedding: nothing to say.
    assert found["hf_llama"] == [[], []]


def test_a_stage_that_cannot_find_its_hidden_state_refuses_naming_the_op() -> None:
    from composer_par.testing.distributed import RankFailure, run_ranks
    from tests.pp_workers import pooled_step

    with pytest.raises(RankFailure) as failed:
        run_ranks(pooled_step, 2, timeout=300)
    text = str(failed.value)
    assert "PipelineError: ERROR CP612 [pp]" in text, text
    assert "Pooled's forward changes the hidden state stage 1 received" in text
    assert "(mean)" in text and "layers.2" in text
