"""Tasks of tests/test_ep_estimate.py: the MoE Llama of tests/ep_workers.py with its
router's choice of experts, and with a uniform choice that spreads every rank's routed
(token, slot) pairs evenly over the experts, so that each ep rank receives exactly as
many pairs as it sends (the estimate's routing); and what a rank holds of the experts."""

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
        from torch.distributed.tensor import DTensor

        probs = F.softmax(F.linear(x, self.router.weight).float(), dim=-1)
        k, experts = self.router.top_k, self.router.num_experts
        slots = torch.arange(x.shape[0] * k, device=x.device).view(-1, k)
        index = slots % experts
        if isinstance(probs, DTensor):  # TP's replicate_rest: the router's weight replicated
            index = DTensor.from_local(index, probs.device_mesh, probs.placements)
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
uniform_shared = UniformMoETask(num_experts=8, shared_expert=True)


def held_elements(plan_toml: str, task: str = "uniform") -> tuple[int, int]:
    """After apply on this rank: the elements it holds of every parameter, and of the
    routed experts' tensors (a pipeline stage's: its part of the model)."""
    from torch.distributed.tensor import DTensor

    from composer_par.testing.parity import apply_to_built, build_plan

    model, _, _ = apply_to_built(globals()[task], build_plan(plan_toml))
    held = {name: (p.to_local() if isinstance(p, DTensor) else p).numel()
            for name, p in model.named_parameters()}
    return sum(held.values()), sum(n for name, n in held.items() if ".experts." in name)


def activations(mesh: str, plugin: str, seq: int, batch: int,
                **sizes: Any) -> dict[str, int]:
    """This rank's activations held for backward at the end of one forward, by torch's
    memory tracker, with each activation-checkpointing mode: the MoE Llama with uniform
    routing, ``batch`` sequences of ``seq`` tokens per rank, the next-token loss, under
    the plan of ``mesh`` and ``plugin``."""
    import torch

    from composer_par.models.llama import next_token_loss
    from composer_par.testing.activation_memory import held_for_backward
    from composer_par.testing.parity import apply_to_built, build_plan

    task = attrs.evolve(uniform, seq_len=seq, **sizes)
    out = {}
    for mode in ("none", "selective", "full"):
        ac = ("" if mode == "none" else
              f'[[plugins]]\nname = "activation_checkpoint"\nmode = "{mode}"\n\n')
        plan = (f'[mesh]\n{mesh}\n\n[[plugins]]\nname = "{plugin}"\n\n{ac}'
                '[[plugins]]\nname = "meta_init"\nseed = 7\n')
        model, _, _ = apply_to_built(task, build_plan(plan))
        tokens = torch.randint(0, task.vocab_size, (batch, seq),
                               generator=torch.Generator().manual_seed(0))
        out[mode] = held_for_backward(
            model, lambda m=model, t=tokens: next_token_loss(m(t), t))["activations"]
    return out
