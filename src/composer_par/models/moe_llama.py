"""A mixture-of-experts variant of the small Llama: each block's feed-forward is a
top-k router over experts stored fused as 3-D parameters ``[num_experts, ...]`` (the
layout of transformers 5.x and torchtitan), with an optional shared expert that every
token passes through (DeepSeek / Qwen2-MoE style).

The experts module's forward has the signature of transformers' experts modules,
``experts(hidden [tokens, dim], top_k_index [tokens, k], top_k_weights [tokens, k])``,
so expert parallelism treats this model and Hugging Face's the same way.

The router's auxiliary load-balancing loss (Switch Transformer's ``num_experts *
sum_e(f_e * P_e)``: ``f_e`` the fraction of routed slots that chose expert ``e``, ``P_e``
its mean router probability, both over whole sequences: under context parallelism
totalled over the cp ranks) of the last forward is kept on each MoE module;
:meth:`MoELlama.aux_loss` sums it over the blocks, and :func:`moe_loss` adds it to the
next-token loss with the config's coefficient. Under ``plan.training_step`` each MoE
module hands its weighted loss to :func:`composer_par.aux_loss.add_aux_loss` instead (a
side gradient in backward, added to the step's reported loss), so that a pipeline stage
without the loss function still trains its routers: the step's ``loss_fn`` is then the
next-token loss alone.

Every module that owns tensors has ``reset_parameters()`` initializing its full tensors,
which MetaInit runs on full-size scratch tensors: the same seed gives the same experts
whatever the layout.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn as nn
import torch.nn.functional as F

from composer_par.aux_loss import add_aux_loss, in_step, sequence_total
from composer_par.models.llama import (
    Attention,
    FeedForward,
    LlamaConfig,
    RMSNorm,
    Rotary,
    next_token_loss,
)
from composer_par.plugin import torch_private


@attrs.frozen
class MoELlamaConfig(LlamaConfig):
    num_experts: int = 4
    top_k: int = 2
    # Each expert's hidden width (the dense ffn_hidden is the shared expert's).
    expert_hidden: int = 32
    shared_expert: bool = False
    # Renormalize the top-k probabilities to sum to one (Mixtral, Qwen3-MoE) or not.
    norm_topk_prob: bool = True
    aux_loss_coef: float = 0.01


class Router(nn.Module):
    """A linear gate over the experts; top-k of the softmax probabilities."""

    def __init__(self, cfg: MoELlamaConfig) -> None:
        super().__init__()
        self.top_k, self.num_experts, self.norm_topk_prob = (
            cfg.top_k, cfg.num_experts, cfg.norm_topk_prob)
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(self.weight.shape[1]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(probabilities [tokens, experts], top_k_weights, top_k_index)``."""
        probs = F.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights.to(x.dtype), index


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU feed-forwards, their weights fused on a leading expert dim.

    ``forward`` computes the experts present in ``top_k_index``; an index outside
    ``[0, len(w1))`` (this module may hold a slice of the experts) is skipped.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default, per expert: uniform in +-1/sqrt(fan_in).
        for weight in (self.w1, self.w3, self.w2):
            bound = 1.0 / math.sqrt(weight.shape[-1])
            nn.init.uniform_(weight, -bound, bound)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in range(self.w1.shape[0]):
            token, slot = torch.where(top_k_index == expert)
            if token.numel() == 0:
                continue
            h = x[token]
            h = F.silu(h @ self.w1[expert].t()) * (h @ self.w3[expert].t())
            h = (h @ self.w2[expert].t()) * top_k_weights[token, slot, None]
            out = out.index_add(0, token, h)
        return out


class MoE(nn.Module):
    """Router, experts and the optional shared expert of one block."""

    aux_loss: torch.Tensor | None

    def __init__(self, cfg: MoELlamaConfig) -> None:
        super().__init__()
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.num_experts, cfg.dim, cfg.expert_hidden)
        self.shared_expert = FeedForward(cfg) if cfg.shared_expert else None
        self.aux_loss_coef = cfg.aux_loss_coef
        self.aux_loss = None
        # Tokens routed to each expert by the last forward (observability, not training).
        self.tokens_per_expert: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs, weights, index = self.router(flat)
        num_experts = probs.shape[-1]
        counts = torch.bincount(index.flatten(), minlength=num_experts)
        self.tokens_per_expert = counts.detach()
        # Sums over this rank's tokens, and over the other parts of its sequences under
        # context parallelism: the loss is that of whole sequences.
        sums = sequence_total(self, torch.cat([
            counts.to(probs.dtype), probs.sum(dim=0), probs.new_tensor([flat.shape[0]])]))
        slots, prob_sums, rows = sums[:num_experts], sums[num_experts:-1], sums[-1]
        fraction = slots / (rows * index.shape[-1])
        aux_loss = num_experts * (fraction * prob_sums / rows).sum()
        # Kept for aux_loss() (moe_loss) outside a training step, unless activation
        # checkpointing recomputes this forward inside backward (which must still
        # compute it: recomputation saves what the forward saved): that loss was taken
        # already, and a loss kept past the step keeps the model alive (see
        # MoELlama.aux_loss). torch's own checkpoint asks autograd the same way. Inside a
        # step, add_aux_loss hands it to the step and nothing is kept.
        if not in_step() and not torch_private.in_backward():
            self.aux_loss = aux_loss
        out = self.experts(flat, index, weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        return add_aux_loss(out.reshape(shape), self.aux_loss_coef * aux_loss)


class MoEDecoderLayer(nn.Module):
    def __init__(self, cfg: MoELlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe = MoE(cfg)
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), self.rotary, positions=positions)
        return x + self.moe(self.ffn_norm(x))


class MoELlama(nn.Module):
    def __init__(self, cfg: MoELlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(MoEDecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Logits of ``tokens`` (batch, seq); ``positions`` as :class:`Rotary` takes them
        (context parallelism gives each rank's global positions)."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h) if positions is None else layer(h, positions)
        return self.output(self.norm(h))

    def aux_loss(self) -> torch.Tensor:
        """The sum over blocks of the last forward's load-balancing loss, handed out once:
        the blocks let go of theirs. Kept on a block past the step, a loss's autograd
        graph would hold the model's backward hooks (FSDP2's hold the model) in a
        reference cycle through autograd's C++ nodes, which Python's collector cannot
        break: the model and its process groups would outlive the run."""
        if in_step():
            raise RuntimeError(
                "aux_loss() inside plan.training_step: the step adds the load-balancing "
                "loss itself (a side gradient on every pipeline stage); give the step the "
                "next-token loss alone (composer_par.models.llama.next_token_loss)")
        blocks = [m for m in self.modules() if isinstance(m, MoE) and m.aux_loss is not None]
        if not blocks:
            raise RuntimeError("aux_loss() with no router run since the last aux_loss() "
                               "(call it once after each forward)")
        losses = [m.aux_loss for m in blocks]
        for block in blocks:
            block.aux_loss = None
        return torch.stack(losses).sum()  # type: ignore[arg-type]


def moe_loss(model: MoELlama, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token loss plus the config's coefficient times the load-balancing loss."""
    loss = next_token_loss(model(tokens), tokens)
    return loss + model.config.aux_loss_coef * model.aux_loss()


__all__ = ["GroupedExperts", "MoE", "MoELlama", "MoELlamaConfig", "Router", "moe_loss"]
