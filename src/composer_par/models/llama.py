"""A small Llama-style decoder: RMSNorm, RoPE (a non-persistent buffer), grouped-query
attention, SwiGLU. Used by the demo, the tests and the benchmarks.

Every module that owns tensors has ``reset_parameters()``, which is what MetaInit calls;
the rotary table is recomputed there, since ``to_empty`` leaves buffers uninitialized.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn as nn
import torch.nn.functional as F


@attrs.frozen
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 128
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed * self.weight


class Rotary(nn.Module):
    """Holds the RoPE cos/sin table as a non-persistent buffer (never in checkpoints)."""

    table: torch.Tensor

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.register_buffer("table", torch.empty(max_seq_len, head_dim // 2, 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.table.is_meta:
            return
        freqs = 1.0 / (
            self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        )
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float32), freqs)
        with torch.no_grad():
            self.table.copy_(torch.stack([angles.cos(), angles.sin()], dim=-1))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        # x: (batch, seq, heads, head_dim); positions: (seq,) or (batch, seq), the tokens'
        # places in their sequence (default 0..seq-1). A rank holding part of a sequence
        # (context parallelism) gives the global places of its tokens.
        if positions is None:
            angles = self.table[: x.shape[1]][None]
        else:
            angles = self.table[positions]
            angles = angles if angles.dim() == 4 else angles[None]
        cos, sin = angles[..., 0][:, :, None, :], angles[..., 1][:, :, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return out.flatten(-2).type_as(x)


class CausalAttention(nn.Module):
    """The attention math alone: causal ``scaled_dot_product_attention`` on
    ``(batch, heads, seq, head_dim)`` queries, keys and values. A module of its own so
    that context parallelism can put its cross-rank version in its place."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.core = CausalAttention()

    # positions is keyword-only: tensor-parallel input layouts are given per positional
    # argument (x, rotary), and positions is never sharded.
    def forward(self, x: torch.Tensor, rotary: Rotary, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 instead of the configured head counts: under tensor parallelism each rank
        # holds only its share of the heads.
        q = rotary(self.wq(x).view(bsz, seq, -1, self.head_dim), positions)
        k = rotary(self.wk(x).view(bsz, seq, -1, self.head_dim), positions)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        repeat = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), self.rotary, positions=positions)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Logits of ``tokens`` (batch, seq); ``positions`` as :class:`Rotary` takes them."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h) if positions is None else layer(h, positions)
        return self.output(self.norm(h))


def next_token_loss(outputs: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting tokens[1:] from logits[:-1]; ``outputs`` is what
    the model returned (the logits, or a Hugging Face output with ``.logits``)."""
    from composer_par.outputs import logits_of

    logits = logits_of(outputs)
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)
    )


def parameter_count(cfg: LlamaConfig) -> int:
    per_layer = 2 * cfg.dim + cfg.dim * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    per_layer += 3 * cfg.dim * cfg.ffn_hidden
    return 2 * cfg.vocab_size * cfg.dim + cfg.dim + cfg.n_layers * per_layer


__all__ = ["CausalAttention", "Llama", "LlamaConfig", "next_token_loss", "parameter_count"]
