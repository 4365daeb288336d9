"""composer_par.aux_loss: an auxiliary loss made inside forward reaches backward as a
side gradient of the step's scale, and the step's record, once; outside a step it is
the model's own business."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint

from composer_par.aux_loss import (
    add_aux_loss,
    aux_losses_paused,
    collect_aux_losses,
    in_step,
)


def _block(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    h = x * weight
    return add_aux_loss(h, 3.0 * (weight ** 2).sum())


def test_outside_a_step_the_output_passes_untouched() -> None:
    x, weight = torch.ones(2), torch.ones(2, requires_grad=True)
    out = x * weight
    assert add_aux_loss(out, (weight ** 2).sum()) is out
    assert not in_step()


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_the_loss_gets_the_scale_as_its_gradient_and_is_recorded(scale: float) -> None:
    x, weight = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0], requires_grad=True)
    with collect_aux_losses(scale) as record:
        assert in_step()
        (scale * _block(x, weight).sum()).backward()
    # d/dw of scale * (sum(x * w) + 3 * sum(w^2)) = scale * (x + 6 w)
    torch.testing.assert_close(weight.grad, scale * (x + 6 * weight.detach()))
    total = record.total()
    assert total is not None
    torch.testing.assert_close(total, torch.tensor(3.0 * 1.25))
    assert not in_step()


def test_paused_forwards_add_neither_a_record_nor_a_gradient() -> None:
    x, weight = torch.ones(2), torch.ones(2, requires_grad=True)
    with collect_aux_losses(1.0) as record, aux_losses_paused():
        _block(x, weight).sum().backward()
    assert record.total() is None
    torch.testing.assert_close(weight.grad, x)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_block_counts_once(reentrant: bool) -> None:
    x, weight = torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor(
        [0.5, -1.0], requires_grad=True)
    with collect_aux_losses(1.0) as record:
        out = torch.utils.checkpoint.checkpoint(_block, x, weight, use_reentrant=reentrant)
        out.sum().backward()
    assert len(record.values) == 1
    torch.testing.assert_close(weight.grad, x.detach() + 6 * weight.detach())


def test_one_step_at_a_time() -> None:
    with (collect_aux_losses(1.0), pytest.raises(RuntimeError, match="one training step"),
          collect_aux_losses(1.0)):
        pass
    assert not in_step()


def test_the_moe_llama_refuses_to_add_its_aux_loss_twice_in_a_step() -> None:
    from composer_par.models.moe_llama import MoELlama, MoELlamaConfig

    model = MoELlama(MoELlamaConfig(vocab_size=16, dim=16, n_layers=1, n_heads=2,
                                    n_kv_heads=1, ffn_hidden=32, max_seq_len=4))
    tokens = torch.randint(0, 16, (2, 4))
    model(tokens)
    assert model.aux_loss().requires_grad  # outside a step: the model's own way
    with collect_aux_losses(1.0), pytest.raises(RuntimeError, match="next-token loss alone"):
        model(tokens)
        model.aux_loss()


def test_a_hugging_face_router_loss_is_transformers_own() -> None:
    """add_router_loss pools the routers' statistics as load_balancing_loss_func does:
    inside a step it records router_aux_loss_coef times transformers' aux_loss (split
    over pipeline stages: tests/test_ep_pp.py)."""
    from composer_par.models.hf_router_loss import add_router_loss
    from tests import hf_workers

    model = hf_workers.build("mixtral", meta=False, router_aux_loss_coef=0.1)
    assert add_router_loss(model) == model.config.num_hidden_layers
    tokens = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    expected = model(input_ids=tokens, output_router_logits=True).aux_loss
    with collect_aux_losses(1.0) as record:
        model(input_ids=tokens)
    total = record.total()
    assert total is not None
    torch.testing.assert_close(total, 0.1 * expected)


def test_add_router_loss_names_a_model_without_routers() -> None:
    from composer_par.models.hf_router_loss import add_router_loss

    with pytest.raises(ValueError, match="Linear records no router_logits"):
        add_router_loss(torch.nn.Linear(2, 2))
