"""Rank-side functions for tests/test_accumulation.py (importable by rank processes)."""

from __future__ import annotations

from collections import Counter
from typing import Any

# Four microbatches of one sequence each on every rank of a 4-rank plan.
GLOBAL_BATCH = 16


def _plan(layout: str) -> Any:
    from composer_par import FSDP2, HSDP, MeshSpec, MetaInit, ParallelPlan

    if layout == "fsdp2":
        plan = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2())
    elif layout == "hsdp":
        plan = ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2)).use(HSDP()).use(FSDP2())
    else:
        raise ValueError(layout)
    return plan.use(MetaInit(seed=0))


def train(layout: str, accumulate: int, sync: str, steps: int = 3) -> dict[str, Any]:
    """``steps`` SGD steps with ``accumulate`` microbatches under ``sync``: the losses,
    this rank's view of every full parameter, and the collectives of each step by kind."""
    import attrs
    import torch
    from torch.distributed.tensor import DTensor

    from composer_par.models.llama import next_token_loss
    from composer_par.testing.comm_count import CommCounter
    from composer_par.testing.tasks import llama

    task = attrs.evolve(llama, global_batch=GLOBAL_BATCH)
    plan = _plan(layout)
    with torch.device("meta"):
        model = task.build()
    model = plan.apply(model)
    # The collectives counted are the training's own: the replica check left out.
    step = plan.training_step(model, next_token_loss, accumulate=accumulate, sync=sync,
                              check_replicas_every=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    index, count = plan.data_shard()
    losses: list[float] = []
    counts: list[dict[str, int]] = []
    for i in range(steps):
        local = task.batch(i).chunk(count)[index]
        with CommCounter() as counter:
            loss = step.step(local, local)
        counts.append(dict(Counter(call.kind for call in counter.calls)))
        losses.append(float(loss))
        optimizer.step()
        optimizer.zero_grad()
    params = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        params[name] = full.detach().cpu().clone()
    return {"losses": losses, "params": params, "counts": counts}


def fabric_train(accumulate: int, sync: str, steps: int = 3) -> dict[str, Any]:
    """:func:`train` of the FSDP2 plan through Lightning Fabric's
    ``fabric.strategy.training_step``."""
    import attrs
    import torch
    from lightning.fabric import Fabric
    from torch.distributed.tensor import DTensor

    from composer_par.integrations.lightning import FabricStrategy
    from composer_par.models.llama import next_token_loss
    from composer_par.testing.comm_count import CommCounter
    from composer_par.testing.tasks import llama

    task = attrs.evolve(llama, global_batch=GLOBAL_BATCH)
    plan = _plan("fsdp2")
    strategy = FabricStrategy(plan)
    fabric = Fabric(strategy=strategy, devices=2, accelerator="cpu")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = task.build()
    model = fabric.setup_module(model)
    optimizer: Any = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05))
    step = strategy.training_step(model, next_token_loss, accumulate=accumulate, sync=sync)
    index, count = plan.data_shard()
    losses: list[float] = []
    counts: list[dict[str, int]] = []
    for i in range(steps):
        local = task.batch(i).chunk(count)[index]
        with CommCounter() as counter:
            loss = step.step(local, local)
        counts.append(dict(Counter(call.kind for call in counter.calls)))
        losses.append(float(loss))
        optimizer.step()
        optimizer.zero_grad()
    params = {}
    for name, param in model._forward_module.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        params[name] = full.detach().cpu().clone()
    return {"losses": losses, "params": params, "counts": counts}


# Pipeline layouts: 1F1B with 2 microbatches over pp 2; accumulate=k runs 2k of them.
PP_PLANS = {
    "pp": '[mesh]\npp = 2\n\n[[plugins]]\nname = "pp"\nschedule = "1F1B"\nmicrobatches = 2\n',
    "pp_fsdp2": ('[mesh]\npp = 2\ndp_shard = 2\n\n[[plugins]]\nname = "pp"\n'
                 'schedule = "1F1B"\nmicrobatches = 2\n\n[[plugins]]\nname = "fsdp2"\n'),
}
PP_SEED = 3


def pp_plan_text(layout: str) -> str:
    return PP_PLANS[layout] + f'\n[[plugins]]\nname = "meta_init"\nseed = {PP_SEED}\n'


def pp_train(layout: str, accumulate: int, passes: int = 1, steps: int = 3
             ) -> dict[str, Any]:
    """``steps`` SGD steps of a pipeline plan: each step runs this rank's batch through
    ``passes`` calls of a step with ``accumulate`` (``passes`` > 1: the batch cut into
    as many pieces, one schedule pass each, as a loop over ``step`` would). The losses,
    this rank's own full parameters (its stage's) and the collectives of each step."""
    import torch

    from composer_par.models.llama import next_token_loss
    from composer_par.testing.comm_count import CommCounter
    from composer_par.testing.parity import build_plan, full_parameters
    from tests.pp_workers import llama4

    plan = build_plan(pp_plan_text(layout))
    with torch.device("meta"):
        model = llama4.build()
    model = plan.apply(model)
    step = plan.training_step(model, next_token_loss, accumulate=accumulate,
                              check_replicas_every=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    index, count = plan.data_shard()
    losses: list[float] = []
    counts: list[dict[str, int]] = []
    for i in range(steps):
        local = llama4.batch(i).chunk(count)[index]
        with CommCounter() as counter:
            pass_losses = [step.step(piece, piece) for piece in local.chunk(passes)]
        counts.append(dict(Counter(call.kind for call in counter.calls)))
        losses.append(float(torch.stack(pass_losses).mean()))
        if passes > 1:
            # Each pass's gradients are its own mean: the step's mean is their mean.
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.div_(passes)
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "params": full_parameters(model), "counts": counts}


def pp_reference(steps: int = 3) -> dict[str, Any]:
    """:func:`pp_train`'s training on one process: the whole global batch each step."""
    import torch

    from composer_par import MeshSpec, MetaInit, ParallelPlan
    from composer_par.models.llama import next_token_loss
    from composer_par.testing.parity import full_parameters
    from tests.pp_workers import llama4

    with torch.device("meta"):
        model = llama4.build()
    model = ParallelPlan(MeshSpec()).use(MetaInit(seed=PP_SEED, device="cpu")).apply(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for i in range(steps):
        batch = llama4.batch(i)
        loss = next_token_loss(model(batch), batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": full_parameters(model)}
