"""Rank-side functions for tests/test_replicas.py (importable by rank processes)."""

from __future__ import annotations

from typing import Any


def _plan(layout: str) -> Any:
    from composer_par import FSDP2, HSDP, TP, MeshSpec, MetaInit, ParallelPlan

    if layout == "fsdp2_tp":
        plan = ParallelPlan(MeshSpec(dp_shard=2, tp=2)).use(TP()).use(FSDP2())
    elif layout == "hsdp":
        plan = ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2)).use(HSDP()).use(FSDP2())
    elif layout == "replicate":
        plan = ParallelPlan(MeshSpec(dp_replicate=4)).use(HSDP())
    else:
        raise ValueError(layout)
    return plan.use(MetaInit(seed=0))


def _model(plan: Any) -> Any:
    import torch

    from composer_par.testing.tasks import llama

    with torch.device("meta"):
        model = llama.build()
    return plan.apply(model)


def _nudge(model: Any, name: str, rank: int) -> None:
    """Add 1e-3 to one element of ``name``'s local tensor on ``rank`` only."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if dist.get_rank() != rank:
        return
    param = dict(model.named_parameters())[name]
    local = param.to_local() if isinstance(param, DTensor) else param
    with torch.no_grad():
        local.view(-1)[0] += 1e-3


def _check(model: Any) -> Any:
    from composer_par import ReplicaDriftError, check_replicas

    try:
        check_replicas(model)
    except ReplicaDriftError as exc:
        return {"drifts": exc.drifts, "message": str(exc)}
    return "ok"


def drift(layout: str, name: str, rank: int) -> dict[str, Any]:
    """The check on a clean model, then after ``name`` is nudged on ``rank``; ``plain``:
    a model no plan touched, the same on every rank."""
    import torch
    from torch.distributed.tensor import DTensor

    if layout == "plain":
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    else:
        model = _model(_plan(layout))
    param = dict(model.named_parameters())[name]
    placements = str(tuple(param.placements)) if isinstance(param, DTensor) else "plain"
    clean = _check(model)
    _nudge(model, name, rank)
    return {"placements": placements, "clean": clean, "nudged": _check(model)}


def through_the_step(every: int, steps: int, nudge_after: int | None) -> dict[str, Any]:
    """``steps`` steps of FSDP2 x TP with ``check_replicas_every=every``: before which
    steps the check ran, and the error of the step that raised, if one did."""
    import torch

    import composer_par.replicas as replicas
    from composer_par import ReplicaDriftError
    from composer_par.models.llama import next_token_loss
    from composer_par.testing.tasks import llama

    plan = _plan("fsdp2_tp")
    model = _model(plan)
    step = plan.training_step(model, lambda logits, batch: next_token_loss(logits, batch),
                              check_replicas_every=every)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    checked: list[int] = []
    real = replicas.check_replicas

    def counting(*args: Any, **kwargs: Any) -> None:
        checked.append(step.steps)
        real(*args, **kwargs)

    replicas.check_replicas = counting
    index, count = plan.data_shard()
    raised = None
    try:
        for i in range(steps):
            if i == nudge_after:
                _nudge(model, "norm.weight", 1)
            local = llama.batch(i).chunk(count)[index]
            step.step(local, local)
            optimizer.step()
            optimizer.zero_grad()
    except ReplicaDriftError as exc:
        raised = {"at_step": step.steps, "drifts": exc.drifts}
    finally:
        replicas.check_replicas = real
    return {"checked": checked, "raised": raised}
