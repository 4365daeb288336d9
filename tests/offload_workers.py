"""Rank functions for tests/test_offload.py: FSDP2 training with and without NVMe
offload of the optimizer state, and a checkpoint round trip of the offloaded optimizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from composer_par.testing.parity import ParityCase, full_parameters, start_rank


def _train(case: ParityCase, *, offload: bool, steps: range) -> tuple[list[float], Any, Any, Any]:
    task, plan, model, index, count, optimizer = start_rank(case)
    if offload:
        plugin = plan.plugin("offload")
        assert plugin is not None
        optimizer = plugin.wrap(optimizer, model)
    losses = _steps(task, model, optimizer, index, count, steps)
    return losses, model, optimizer, (task, index, count)


def _steps(task: Any, model: Any, optimizer: Any, index: int, count: int,
           steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = task.loss(model, task.batch(step).chunk(count)[index])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return losses


def train_both(plain: ParityCase, offloaded: ParityCase) -> dict[str, Any]:
    """The same plan trained twice on this rank: plain AdamW, then offloaded AdamW."""
    losses, model, _, _ = _train(plain, offload=False, steps=range(plain.steps))
    off_losses, off_model, optimizer, _ = _train(offloaded, offload=True,
                                                 steps=range(offloaded.steps))
    files = sorted(p.name for p in Path(optimizer.directory).iterdir()
                   if p.name.startswith("unit-"))
    return {"losses": losses, "params": full_parameters(model),
            "offload_losses": off_losses, "offload_params": full_parameters(off_model),
            "units": [u.label for u in optimizer.units], "files": files,
            "held_in_memory": len(optimizer.inner.state)}


def checkpoint_round_trip(case: ParityCase, root: str) -> dict[str, Any]:
    """Train 3 steps offloaded, save model + optimizer, load both into a fresh model and
    offloaded optimizer, train 2 more steps on each: the two must stay equal."""
    from composer_par import checkpoint

    _, model, optimizer, (task, index, count) = _train(case, offload=True, steps=range(3))
    saved = optimizer.state_dict()
    checkpoint.save(root, model, optimizer, step=3)
    _, _, fresh_model, _, _, fresh = start_rank(case)
    plugin = start_rank(case)[1].plugin("offload")
    assert plugin is not None
    fresh = plugin.wrap(fresh, fresh_model)
    checkpoint.load(root, fresh_model, fresh)
    loaded = fresh.state_dict()
    same_state = all(
        torch.equal(torch.as_tensor(saved["state"][k][name]),
                    torch.as_tensor(loaded["state"][k][name]))
        for k in saved["state"] for name in saved["state"][k])
    same_keys = saved["state"].keys() == loaded["state"].keys()
    held = len(fresh.inner.state)
    after = _steps(task, model, optimizer, index, count, range(3, 5))
    fresh_after = _steps(task, fresh_model, fresh, index, count, range(3, 5))
    return {"same_state": same_state and same_keys, "held_in_memory": held,
            "after": after, "fresh_after": fresh_after,
            "params": full_parameters(model), "fresh_params": full_parameters(fresh_model)}
