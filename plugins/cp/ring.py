"""``ring``: torch's own context-parallel attention, over the CUDA SDPA kernels.

torch's ring attention (``torch.distributed.tensor.experimental``) runs when
``scaled_dot_product_attention`` is called on DTensors sharded on the sequence dim with
its context-parallel dispatcher on: it passes K/V around the cp ranks and merges each
block's output by log-sum-exp, inside the flash, memory-efficient and cuDNN kernels.
Those are CUDA's kernels only (the CPU's SDPA op has no ring handler), so this mode needs
CUDA devices (rule CP826).

torch's ring assumes the head-tail split that :mod:`.layout` makes when it balances
causal work (rank r holds chunks r and 2 * cp - 1 - r), so CP's inputs, positions and
labels are what the ring expects. It masks causally and nothing else: no sliding window
(CP823 names such layers), and no grouped K/V heads, which are repeated to the query
heads first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

_SEQ_DIM = 2  # (batch, heads, seq, head_dim), the dim torch's ring attention splits


def enable_ring_attention(group: Any) -> None:
    """Turn on torch's context-parallel SDPA dispatch for DTensors (process-wide, as
    torchtitan does; SDPA on plain tensors is unaffected) with the head-tail balance CP's
    layout makes. Over gloo (CUDA tensors through gloo, e.g. ranks sharing a GPU) K/V
    rotate by all-to-all: gloo's asynchronous all-gather of CUDA tensors, torch's default
    rotation, crashes the process."""
    import torch.distributed as dist

    from composer_par.plugin import torch_private

    rotate = "alltoall" if "gloo" in str(dist.get_backend(group)) else None
    torch_private.enable_ring_dispatch(load_balance=True, rotate=rotate)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mesh: Any,
                   scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries ``(batch, heads, local_seq, head_dim)``
    over the whole sequence, by torch's ring over the 1-D cp ``mesh``."""
    from torch.distributed.tensor import DTensor, Shard

    chunk = q.shape[_SEQ_DIM] // 2
    if q.dtype == torch.float32 and chunk % 32:
        # fp32 runs the memory-efficient kernel, whose log-sum-exp is padded to 32 rows:
        # torch's ring cannot merge a chunk of another length.
        raise ValueError(
            f"mode = \"ring\" in float32 needs chunks of a multiple of 32 tokens; this "
            f"rank's chunks have {chunk} (sequence = 2 * cp * chunk): use a sequence "
            "length divisible by 64 * cp, bf16/fp16, or mode = \"allgather\"")
    if k.shape[1] != q.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    placements = [Shard(_SEQ_DIM)]
    q, k, v = (DTensor.from_local(t.contiguous(), mesh, placements, run_check=False)
               for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    assert isinstance(out, DTensor)  # the dispatcher's result, sharded as the inputs
    return out.to_local()


__all__ = ["enable_ring_attention", "ring_attention"]
