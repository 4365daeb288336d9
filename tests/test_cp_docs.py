"""docs/cp.md's example runs as written on a Hugging Face model: ``plan.training_step(
model, cp.cross_entropy)`` gives ``cp.cross_entropy`` the model's output object (the one
loss contract), and the loss the step returns is the global batch's mean token loss of
the same weights in one process. The project's loss helpers take what a model returns."""

from __future__ import annotations

import pytest
import torch

from composer_par.models.llama import next_token_loss
from composer_par.outputs import logits_of
from composer_par.testing.distributed import run_ranks


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_cp_doc_example_runs_as_written_on_a_hugging_face_model() -> None:
    ranks = run_ranks("tests.cp_doc_workers:run_doc_example", 4, args=(2,), timeout=280)
    for rank in ranks:
        assert len(rank["losses"]) == 2
        assert rank["losses"] == pytest.approx(rank["expected"], rel=1e-5, abs=1e-5)
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)


def test_loss_helpers_take_what_a_model_returns() -> None:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    logits = torch.randn(2, 6, 11)
    tokens = torch.randint(0, 11, (2, 6))
    expected = next_token_loss(logits, tokens)
    for outputs in (logits, CausalLMOutputWithPast(logits=logits), (logits, None),
                    {"logits": logits}):
        assert logits_of(outputs) is logits
        assert torch.equal(next_token_loss(outputs, tokens), expected)
    with pytest.raises(TypeError, match="holding no logits"):
        logits_of(object())
