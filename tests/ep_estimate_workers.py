"""Tasks of tests/test_ep_estimate.py: the MoE Llama of tests/ep_workers.py with its
router's choice of experts, and with a uniform choice that spreads every rank's routed
(token, slot) pairs evenly over the experts, so that each ep rank receives exactly as
many pairs as it sends (the estimate's routing)."""

from __future__ import annotations

from typing import Any

import attrs

from tests.ep_workers import MoELlamaTask


class _UniformRouter:
    """Token t's slots go to experts ``t*k, ..., t*k + k-1`` (mod the expert count): on
    every rank the pairs cover the experts evenly, whatever the tokens. The router's
    probabilities still weight them, so its weights train."""

    def __init__(self, router: Any) -> None:
        self.router = router

    def __call__(self, x: Any) -> Any:
        import torch
        import torch.nn.functional as F

        probs = F.softmax(F.linear(x, self.router.weight).float(), dim=-1)
        k, experts = self.router.top_k, self.router.num_experts
        slots = torch.arange(x.shape[0] * k, device=x.device).view(-1, k)
        index = slots % experts
        weights = probs.gather(1, index)
        return probs, weights.to(x.dtype), index


@attrs.frozen
class UniformMoETask(MoELlamaTask):
    """The MoE Llama whose routing is uniform (see :class:`_UniformRouter`)."""

    def build(self) -> Any:
        model = super().build()
        for layer in model.layers:
            layer.moe.router.forward = _UniformRouter(layer.moe.router)
        return model


# 8 experts, top-2, 2 blocks, hidden 32; 8 sequences of 8 tokens per step.
routed = MoELlamaTask(num_experts=8)
uniform = UniformMoETask(num_experts=8)
