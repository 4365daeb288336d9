"""bf16 / fp16 transfer of the replicate dim's gradients, summed in fp32.

A collective that sums 16-bit tensors sums them in 16 bits (gloo rounds after every
addition; NCCL's bf16 ring too), so the sum is not left to the collective:

1. each rank divides its gradient by the divisor, casts it to 16 bits and splits it into
   ``R`` chunks (``R`` = the group size);
2. an all-to-all sends chunk ``j`` to rank ``j``: every rank now holds all ranks' 16-bit
   copies of its own chunk (a reduce-scatter that does not reduce);
3. each rank sums its ``R`` copies in **fp32** (the only additions, in rank order);
4. an all-gather of the 16-bit sums gives every rank the same full result.

Bytes each rank sends (bandwidth-optimal algorithms): ``2 (R-1)/R * n * 2`` against
``2 (R-1)/R * n * 4`` for the fp32 all-reduce -- half, for every ``R``. Gathering every
rank's compressed gradient and summing locally instead sends ``(R-1) * n * 2``: as good
for ``R = 2``, ``R/2`` times worse beyond.

Each value is rounded to 16 bits twice (the input, the result), the same on every rank,
so replicas stay identical.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from composer_par.plugin import GradBucket


class LowPrecisionAllReduce:
    """A :class:`~composer_par.plugin.comm.GradReducer` sending ``dtype`` and summing in fp32."""

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be bfloat16 or float16; got {dtype}")
        self.dtype = dtype

    def __call__(self, bucket: GradBucket) -> None:
        reduce_mean(bucket.buffer, bucket.group, bucket.divisor, self.dtype)


def reduce_mean(buffer: torch.Tensor, group: dist.ProcessGroup, divisor: float,
                dtype: torch.dtype) -> None:
    """Replace ``buffer`` by the group's sum / ``divisor``, sent in ``dtype``, summed in fp32."""
    world = group.size()
    if world == 1:
        buffer.div_(divisor)
        return
    n = buffer.numel()
    chunk = -(-n // world)
    send = torch.zeros(world * chunk, dtype=dtype, device=buffer.device)
    # Dividing first keeps fp16 inside its range: the sum of R values is then a mean.
    send[:n].copy_(buffer.reshape(-1) / divisor)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    mine = received.view(world, chunk).to(torch.float32).sum(dim=0)
    gathered = torch.empty_like(send)
    dist.all_gather_into_tensor(gathered, mine.to(dtype), group=group)
    buffer.copy_(gathered[:n].view_as(buffer))
