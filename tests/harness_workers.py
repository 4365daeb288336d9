"""Rank functions for tests/test_harness.py; module-level so ranks can import them by name."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _all_reduce_rank() -> float:
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return t.item()


def describe_rank(tag: str) -> dict[str, Any]:
    return {
        "tag": tag,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "sum": _all_reduce_rank(),
        "threads": torch.get_num_threads(),
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "EXTRA")},
    }


def raise_on_rank(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from rank {bad_rank}")
    _all_reduce_rank()
    return dist.get_rank()


def exit_on_rank(bad_rank: int, code: int) -> None:
    if dist.get_rank() == bad_rank:
        os._exit(code)
    dist.barrier()


def segfault_on_rank(bad_rank: int) -> None:
    if dist.get_rank() == bad_rank:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()


def hang_on_rank(sleeper: int) -> None:
    if dist.get_rank() == sleeper:
        time.sleep(60)
    _all_reduce_rank()


def abort_after_report(marker_dir: str) -> int:
    """Return normally, then abort during teardown as gloo sometimes does."""
    rank = dist.get_rank()
    # Past this, no rank is still connecting to the others.
    dist.barrier()

    def abort(*args: Any, **kwargs: Any) -> None:
        Path(marker_dir, f"rank{rank}.aborted").touch()
        os.abort()

    # The harness's teardown starts with a barrier, once the rank has reported;
    # only this rank process sees the replacement.
    dist.barrier = abort  # type: ignore[assignment]
    if rank == 1:
        # Rank 0 aborts while the harness still waits for this rank.
        time.sleep(0.5)
    return rank


def rank_tensor() -> torch.Tensor:
    return torch.full((2,), float(dist.get_rank()))


def unpicklable_result() -> Any:
    return lambda: None


def train_then_drift(case: Any, name: str, on_rank: int, delta: float
                     ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``train_case``, then the Replicate parameter ``name`` moved by ``delta`` on
    ``on_rank`` alone after the last step: a replicated copy that drifted on one rank
    while the losses stayed at parity. Only that rank's view of the parameter shows it."""
    from torch.distributed.tensor import DTensor, Replicate

    from composer_par.testing.parity import full_parameters, train_model

    losses, model = train_model(case)
    param = model.get_parameter(name)
    assert isinstance(param, DTensor) and all(isinstance(p, Replicate)
                                              for p in param.placements), param
    if dist.get_rank() == on_rank:
        with torch.no_grad():
            param.to_local().add_(delta)
    return losses, full_parameters(model)
