"""The loop Ray Train's workers run in tests/test_integration_ray.py: a plan from
composer_par.integrations.ray, trained as the parity harness trains it, each worker's
losses and view of every full parameter written for the test to compare."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from composer_par.testing.tasks import LlamaTask

TASK = LlamaTask()
PLAN = """\
[mesh]
dp_shard = 2

[topology]
nodes = 1
devices_per_node = 2

[[plugins]]
name = "fsdp2"

[[plugins]]
name = "meta_init"
seed = 0
"""


def train_loop(config: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from composer_par.integrations.ray import save_checkpoint, worker_plan
    from composer_par.testing.parity import apply_to_built, full_parameters

    torch.set_num_threads(1)
    plan = worker_plan(config)
    task = TASK
    model, index, count = apply_to_built(task, plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    losses = []
    for step in range(config["steps"]):
        loss = task.loss(model, task.batch(step).chunk(count)[index])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    params = full_parameters(model)
    saved = save_checkpoint(model, optimizer, plan, step=config["steps"],
                            metrics={"loss": losses[-1]})
    out = Path(config["out"])
    torch.save({"losses": losses, "params": params, "checkpoint": str(saved),
                "world_size": dist.get_world_size()}, out / f"rank{dist.get_rank()}.pt")
