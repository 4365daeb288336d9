"""Rank-side functions for tests/test_reliability.py (imported by name in rank processes)."""

from __future__ import annotations

import time
from typing import Any


def group_timeouts(mesh: Any) -> dict[str, float]:
    """Seconds each mesh dim's process group waits in a collective (gloo's own setting)."""
    import torch

    return {name: mesh.get_group(name)._get_backend(torch.device("cpu")).options._timeout
            .total_seconds() for name in mesh.mesh_dim_names}


def frozen_peer_in_a_subgroup(timeout_s: float, freeze_s: float) -> dict[str, Any]:
    """A 2 x 2 mesh built with ``timeout_s``; rank 1 stays alive but joins nothing while
    rank 0 (its tp peer) and rank 3 (its dp_shard peer) all-reduce with it."""
    import torch
    import torch.distributed as dist

    from composer_par.mesh import MeshSpec

    mesh = MeshSpec(dp_shard=2, tp=2).build("cpu", timeout=timeout_s)
    rank = dist.get_rank()
    result: dict[str, Any] = {"timeouts": group_timeouts(mesh)}
    if rank == 1:
        time.sleep(freeze_s)
        return result
    dim = {0: "tp", 3: "dp_shard"}.get(rank)
    if dim is None:  # rank 2 shares no group with rank 1
        return result
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=mesh.get_group(dim))
        result["error"] = None
    except RuntimeError as exc:
        result["error"] = str(exc)
    result["waited_s"] = time.monotonic() - started
    return result


def whole_world_dim_keeps_the_default_group(timeout_s: float) -> dict[str, Any]:
    """A 1-D mesh over every rank: torch reuses the default process group for it."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_group

    from composer_par.mesh import MeshSpec

    mesh = MeshSpec(dp_shard=dist.get_world_size()).build("cpu", timeout=timeout_s)
    return {"is_default": mesh.get_group("dp_shard") is _get_default_group(),
            "timeouts": group_timeouts(mesh)}


def plan_groups_get_the_plan_timeout(timeout_s: float | None) -> dict[str, float]:
    """apply() of an HSDP x FSDP2 plan on 2 x 2: the timeouts of the mesh it built."""
    import torch.nn as nn

    from composer_par import FSDP2, HSDP, MeshSpec, ParallelPlan

    plan = ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2), timeout=timeout_s)
    model = plan.use(HSDP()).use(FSDP2()).apply(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    return group_timeouts(next(model.parameters()).device_mesh)


# -- the forward-before-optimizer trap ---------------------------------------------------


def optimizer_after_forward(when: str, no_grad: bool = False) -> dict[str, Any]:
    """FSDP2 on 2 ranks; the optimizer is built ``when`` = "before" or "after" a first
    forward (or "after-reshard": after it, with every FSDP module resharded first); one
    training step. Returns what the optimizer held, the step's error and the parameters."""
    import torch
    import torch.distributed as dist

    from composer_par import FSDP2, MeshSpec, MetaInit, ParallelPlan
    from composer_par.testing.parity import full_parameters
    from composer_par.testing.tasks import LlamaTask

    task = LlamaTask()
    with torch.device("meta"):
        model = task.build()
    plan = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(MetaInit(seed=0))
    model = plan.apply(model)
    initial = full_parameters(model)
    batch = task.batch(0).chunk(2)[dist.get_rank()]
    optimizer = None
    if when == "before":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with torch.no_grad() if no_grad else torch.enable_grad():
        model(batch)
    if when == "after-reshard":
        for module in plan.data_parallel_modules:
            module.reshard()  # type: ignore[operator]
    if optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    held = sorted({type(p).__name__ for g in optimizer.param_groups for p in g["params"]})
    task.loss(model, batch).backward()
    error = None
    try:
        optimizer.step()
    except RuntimeError as exc:
        error = f"{type(exc).__name__}: {exc}"
    full = full_parameters(model)
    first = dist.get_rank() == 0
    return {"held": held, "error": error, "full": full if first else None,
            "initial": initial if first else None}


# -- naming the rank that never joins ------------------------------------------------------


def frozen_rank_is_named(timeout_s: float, frozen: int, steps: int = 4) -> dict[str, Any]:
    """A 2 x 2 mesh: every step all-reduces over tp, then dp_shard; ``frozen`` stops
    (alive, joining nothing) at step 2. The other ranks report what ended their wait."""
    import torch
    import torch.distributed as dist

    from composer_par.hangs import StuckRankError, name_stuck_ranks
    from composer_par.mesh import MeshSpec

    mesh = MeshSpec(dp_shard=2, tp=2).build("cpu", timeout=timeout_s)
    rank = dist.get_rank()
    started = time.monotonic()
    try:
        with name_stuck_ranks(timeout_s):
            for step in range(steps):
                if rank == frozen and step == 2:
                    time.sleep(timeout_s + 12)
                    return {"frozen": True}
                for dim in ("tp", "dp_shard"):
                    dist.all_reduce(torch.ones(1), group=mesh.get_group(dim))
                if step == 1:
                    started = time.monotonic()
    except StuckRankError as exc:
        return {"error": str(exc), "stuck": exc.stuck, "waiting": exc.waiting,
                "seconds": time.monotonic() - started}
    return {"finished": True}


def everyone_waits_for_everyone(timeout_s: float) -> dict[str, Any]:
    """Both ranks receive from each other: each waits in a collective, none is stuck."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from composer_par.hangs import StuckRankError, name_stuck_ranks

    group = dist.new_group([0, 1], timeout=timedelta(seconds=timeout_s))
    try:
        with name_stuck_ranks():
            dist.recv(torch.zeros(1), src=1 - dist.get_rank(), group=group)
    except StuckRankError as exc:
        return {"error": str(exc), "stuck": exc.stuck, "waiting": exc.waiting}
    return {}


def lost_connections(roll_call_s: float) -> list[tuple[str, float]]:
    """On one rank: a lost connection before any roll call, a timeout, then a lost
    connection once the roll call is open. What each became, and how long it took."""
    from composer_par.hangs import name_stuck_ranks

    outcomes = []
    for error in ("[pair.cc:553] Connection closed by peer [127.0.0.1]:1",
                  "[unbound_buffer.cc:78] Timed out waiting 10ms for recv operation",
                  "[pair.cc:553] Connection closed by peer [127.0.0.1]:1"):
        started = time.monotonic()
        try:
            with name_stuck_ranks(roll_call_s=roll_call_s):
                raise RuntimeError(error)
        except RuntimeError as exc:
            outcomes.append((f"{type(exc).__name__}: {exc}", time.monotonic() - started))
    return outcomes
