"""Rank-side functions of tests/test_ep_checkpoint.py: the MoE Llama (8 experts, a shared
expert) trained with AdamW under expert-parallel layouts, saved and loaded with
composer_par.checkpoint (DCP), and trained on after the load.

Every layout trains on the same micro-batches: the global batch of a step is cut into
:data:`MICRO_BATCHES` (the data shards of the widest layout, dp_shard 2 x ep 4), and a
layout with fewer data shards accumulates its share of them. The router's auxiliary loss
is computed per micro-batch, so this is what makes a step under one layout the same
training as under another, up to the order of the sums.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.ep_workers import MoELlamaTask

TASK = MoELlamaTask(num_experts=8, shared_expert=True, global_batch=16)
MICRO_BATCHES = 8
SAVE_LAYOUT = "fsdp2_ep_2x4"
# Steps trained before the save; the uninterrupted run goes on for CONTINUED more.
SAVED_AT = 2
CONTINUED = 2

#: name -> (mesh, plugins other than the materializer).
LAYOUTS: dict[str, tuple[dict[str, int], tuple[str, ...]]] = {
    "fsdp2_ep_2x4": ({"dp_shard": 2, "ep": 4}, ("fsdp2", "ep")),
    "fsdp2_ep_2x2": ({"dp_shard": 2, "ep": 2}, ("fsdp2", "ep")),
    "fsdp2_4": ({"dp_shard": 4}, ("fsdp2",)),
    "ep_4": ({"ep": 4}, ("ep",)),
    "ep_2": ({"ep": 2}, ("ep",)),
    "one_process": ({}, ()),
}


def build(layout: str, seed: int) -> tuple[Any, Any, Any]:
    """(plan, model, AdamW) of ``layout``, materialized by MetaInit(seed)."""
    import torch

    from composer_par import MeshSpec, MetaInit, ParallelPlan
    from tests.checkpoint_io_workers import plugin

    mesh, names = LAYOUTS[layout]
    plan = ParallelPlan(MeshSpec(**mesh))
    for name in names:
        plan.use(plugin(name))
    plan.use(MetaInit(seed=seed))
    with torch.device("meta"):
        model = TASK.build()
    model = plan.apply(model)
    return plan, model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def train_step(plan: Any, model: Any, optimizer: Any, step: int) -> float:
    """One AdamW step on this rank's share of the step's micro-batches (accumulated);
    the mean loss over all micro-batches, the same on every rank."""
    import torch.distributed as dist

    index, count = plan.data_shard()
    assert MICRO_BATCHES % count == 0, (MICRO_BATCHES, count)
    share = MICRO_BATCHES // count
    micro = TASK.batch(step).chunk(MICRO_BATCHES)[index * share:(index + 1) * share]
    total = 0.0
    for batch in micro:
        loss = TASK.loss(model, batch) / share
        loss.backward()
        total += float(loss.detach())
    optimizer.step()
    optimizer.zero_grad()
    if not dist.is_initialized():
        return total
    # Each data shard's ranks hold the same value; the mean over ranks is over shards.
    summed = [0.0] * dist.get_world_size()
    dist.all_gather_object(summed, total)
    return sum(summed) / len(summed)


def _continued(plan: Any, model: Any, optimizer: Any, steps: range) -> list[dict[str, Any]]:
    from composer_par.testing.parity import full_parameters

    return [{"step": step, "loss": train_step(plan, model, optimizer, step),
             "params": full_parameters(model)} for step in steps]


def save_and_continue(root: str) -> dict[str, Any]:
    """The run that never stopped: :data:`SAVED_AT` steps under :data:`SAVE_LAYOUT`, a
    save to ``root/<layout>``, then :data:`CONTINUED` more steps. This rank's view of the
    full state saved, and each continued step's loss and full parameters."""
    from composer_par.checkpoint import save
    from tests.checkpoint_io_workers import full_state

    plan, model, optimizer = build(SAVE_LAYOUT, 11)
    for step in range(SAVED_AT):
        train_step(plan, model, optimizer, step)
    save(Path(root) / SAVE_LAYOUT, model, optimizer, step=SAVED_AT, plan=plan)
    saved = full_state(model, optimizer)
    steps = range(SAVED_AT, SAVED_AT + CONTINUED)
    return {"saved": saved, "continued": _continued(plan, model, optimizer, steps)}


def load_and_continue(loads: list[tuple[str, str, bool]], root: str) -> dict[str, Any]:
    """For each ``(source, layout, resave)``: a fresh ``layout`` model (another seed, a
    fresh optimizer) loads ``root/<source>``, then trains from the step it was saved at
    up to the end of the uninterrupted run. With ``resave`` it saves again to
    ``root/<layout>`` after its first step (a checkpoint of that layout for a later
    entry). This rank's view of each: the state loaded, each step's loss and parameters,
    and the state it resaved."""
    from composer_par.checkpoint import load, save
    from tests.checkpoint_io_workers import full_state

    out: dict[str, Any] = {}
    for source, layout, resave in loads:
        plan, model, optimizer = build(layout, 99)
        start = load(Path(root) / source, model, optimizer).step
        entry: dict[str, Any] = {"loaded": full_state(model, optimizer), "continued": []}
        for step in range(start, SAVED_AT + CONTINUED):
            entry["continued"] += _continued(plan, model, optimizer, range(step, step + 1))
            if resave and step == start:
                save(Path(root) / layout, model, optimizer, step=step + 1, plan=plan)
                entry["resaved"] = full_state(model, optimizer)
        out[f"{source}->{layout}"] = entry
    return out
