"""The few collectives checkpointing needs, which degrade to no-ops on one process."""

from __future__ import annotations

from typing import Any


def active() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if active() else 0


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if active() else 1


def agree(ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank. Unlike a barrier, a rank that failed
    still takes part, so its peers learn of the failure instead of waiting forever."""
    if not active():
        return ok
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (a small picklable object made by this code, never
    read from a file)."""
    if not active():
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank (small objects only)."""
    if not active():
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def gather_to_root(value: Any) -> list[Any] | None:
    """Every rank's ``value`` in rank order on rank 0 (None elsewhere): for records only
    rank 0 needs, which need not travel to every rank."""
    if not active():
        return [value]
    import torch.distributed as dist

    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, out, dst=0)
    return out


def barrier() -> None:
    if active():
        import torch.distributed as dist

        dist.barrier()
