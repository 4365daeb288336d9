"""Exact causal attention of one chunk of queries over the keys up to the chunk's end,
without a mask tensor: the keys before the chunk (all visible) and the chunk's own keys
(causal, a square block) are attended separately by the fused CPU kernel and merged by
their log-sum-exps, as ring attention merges its blocks.

Why: ``scaled_dot_product_attention`` with a boolean mask turns it into a float mask of
queries x keys and keeps it for backward in every layer, which is as large as the
attention scores that the fused kernels exist to avoid. The merge needs each block's
log-sum-exp, which only the kernel ops return (``_scaled_dot_product_flash_attention_for_cpu``
and its backward); the backward uses the merged output and log-sum-exp for both blocks,
which gives each block's exact share of the gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from composer_par.plugin import torch_private

_FORWARD, _BACKWARD = torch_private.cpu_flash_attention()


def supported(q: torch.Tensor) -> bool:
    """Whether the fused CPU kernel can run these queries (a CPU float tensor)."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64,
                                                  torch.bfloat16, torch.float16)


class _ChunkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                scale: float | None) -> torch.Tensor:
        # q: (batch, heads, L, dim), global positions start..start+L-1; k, v: keys
        # 0..start+L-1, as many heads as q.
        length = q.shape[2]
        diag_k, diag_v = k[:, :, start:start + length], v[:, :, start:start + length]
        out, lse = _FORWARD(q, diag_k, diag_v, 0.0, True, scale=scale)
        if start:
            before, lse_before = _FORWARD(q, k[:, :, :start], v[:, :, :start], 0.0, False,
                                          scale=scale)
            merged = torch.logaddexp(lse, lse_before)
            out = (out * (lse - merged).exp()[..., None]
                   + before * (lse_before - merged).exp()[..., None]).to(q.dtype)
            lse = merged
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.start, ctx.scale = start, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        start, scale, length = ctx.start, ctx.scale, q.shape[2]
        grad = grad.contiguous()
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        dq, dk_diag, dv_diag = _BACKWARD(grad, q, k[:, :, start:start + length].contiguous(),
                                         v[:, :, start:start + length].contiguous(), out,
                                         lse, 0.0, True, scale=scale)
        dk[:, :, start:start + length], dv[:, :, start:start + length] = dk_diag, dv_diag
        if start:
            dq_before, dk_before, dv_before = _BACKWARD(
                grad, q, k[:, :, :start].contiguous(), v[:, :, :start].contiguous(), out,
                lse, 0.0, False, scale=scale)
            dq = dq + dq_before
            dk[:, :, :start], dv[:, :, :start] = dk_before, dv_before
        return dq, dk, dv, None, None


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                    scale: float | None = None) -> torch.Tensor:
    """Causal attention of queries at global positions ``start..start+L-1`` over keys
    and values of positions ``0..start+L-1`` (heads equal: repeat grouped K/V first)."""
    out: torch.Tensor = _ChunkAttention.apply(q, k, v, start, scale)
    return out


__all__ = ["chunk_attention", "supported"]
