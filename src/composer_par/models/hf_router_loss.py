"""A Hugging Face MoE model's router loss under ``plan.training_step``, pipeline or not.

transformers' ``load_balancing_loss_func`` (Mixtral, Qwen2/3-MoE, OLMoE, ...) pools every
layer's routing before multiplying: with ``C_e`` the top-k slots that chose expert ``e``
and ``P_e`` the sum of its router probabilities, both over all layers and tokens, and
``R`` the rows counted (layers x tokens), the loss is ``num_experts * sum_e (C_e / R) *
(P_e / R)``. It does not split into per-layer parts, so a pipeline stage cannot add its
layers' share alone: :func:`add_router_loss` has the model carry ``(C, P, R)`` from stage
to stage (:mod:`composer_par.aux_loss`), each router adding its layer in the model's
layer order, and the last stage's forward turn the totals into ``router_aux_loss_coef``
times the loss, a side gradient on its logits. The gradient of ``P`` flows back to every
stage through the pipeline's own sends; ``C`` and ``R`` take none, as in transformers.
Without a pipeline the model's one forward does all of it. Under context parallelism
each rank routes its part of every sequence, and the totals are summed over the cp
ranks before they multiply (:func:`composer_par.aux_loss.sequence_total`).

The step then adds the loss itself: give it the next-token loss from ``outputs.logits``
and leave ``output_router_logits`` off (transformers would add its own copy to
``outputs.loss`` only, which the step does not use). Padding masks are not counted: the
loss is transformers' without ``attention_mask``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from composer_par.aux_loss import add_aux_loss, current_carry, mark_carrying, sequence_total


class _RouterLoss:
    """The running ``(C, P, R)`` of one forward (one stage's, under a pipeline)."""

    def __init__(self, num_experts: int, top_k: int, coef: float, index: int) -> None:
        self.num_experts, self.top_k, self.coef, self.index = num_experts, top_k, coef, index
        self.counts: torch.Tensor | None = None
        self.probs: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None

    def begin(self, module: nn.Module, args: Any) -> None:
        carry = current_carry()
        incoming = None if carry is None else carry.incoming
        if incoming is None:
            self.counts = self.probs = self.rows = None
            return
        n = self.num_experts
        self.counts, self.probs, self.rows = (incoming[:n].detach(), incoming[n:2 * n],
                                              incoming[2 * n].detach())

    def add_layer(self, module: nn.Module, args: Any, output: Any) -> None:
        logits = output[self.index] if isinstance(output, tuple) else output
        # transformers' own arithmetic, layer by layer from zero: the same sums.
        weights = torch.softmax(logits.float(), dim=-1)
        _, selected = torch.topk(weights, self.top_k, dim=-1)
        counts = torch.histc(selected.reshape(-1).float(), bins=self.num_experts, min=0,
                             max=self.num_experts)
        rows = torch.tensor(float(weights.shape[0]), device=weights.device)
        if self.counts is None or self.probs is None or self.rows is None:
            zeros = torch.zeros(self.num_experts, dtype=torch.float32, device=weights.device)
            self.counts, self.probs, self.rows = zeros, zeros, torch.zeros_like(rows)
        self.counts = self.counts + counts
        self.probs = self.probs + weights.sum(dim=0)
        self.rows = self.rows + rows

    def finish(self, module: nn.Module, args: Any, output: Any) -> Any:
        counts, probs, rows = self.counts, self.probs, self.rows
        self.counts = self.probs = self.rows = None
        carry = current_carry()
        if carry is not None and not carry.last:
            if counts is None or probs is None or rows is None:  # a stage without routers
                device = output.logits.device
                carry.outgoing = torch.zeros(2 * self.num_experts + 1, device=device)
            else:
                carry.outgoing = torch.cat([counts, probs, rows.reshape(1)])
            return output
        if counts is None or probs is None or rows is None:
            return output
        n = self.num_experts
        # Under context parallelism, the totals of the whole sequences.
        totals = sequence_total(module, torch.cat([counts, probs, rows.reshape(1)]))
        counts, probs, rows = totals[:n], totals[n:2 * n], totals[2 * n]
        loss = torch.sum((counts / rows) * (probs / rows)) * n
        output.logits = add_aux_loss(output.logits, self.coef * loss)
        return output


def add_router_loss(model: nn.Module) -> int:
    """Make ``model``'s router loss part of ``plan.training_step`` (see the module); call
    it before ``plan.apply``. Returns the number of routers found."""
    recorder = getattr(model, "_can_record_outputs", None) or {}
    router = recorder.get("router_logits")
    needed = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
    if router is None or not all(hasattr(model, name) for name in needed):
        raise ValueError(
            f"{type(model).__name__} records no router_logits with a router loss "
            "(a Hugging Face MoE causal LM such as MixtralForCausalLM has them)")
    settings: dict[str, Any] = {name: getattr(model, name) for name in needed}
    pool = _RouterLoss(int(settings["num_experts"]), int(settings["num_experts_per_tok"]),
                       float(settings["router_aux_loss_coef"]), router.index)
    routers = [m for m in model.modules() if isinstance(m, router.target_class)]
    for module in routers:
        module.register_forward_hook(pool.add_layer)
    model.register_forward_pre_hook(pool.begin)
    model.register_forward_hook(pool.finish)
    mark_carrying(model)
    return len(routers)


__all__ = ["add_router_loss"]
