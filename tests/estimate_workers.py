"""Rank-side functions for tests/test_estimate.py: real training steps on gloo ranks, with
every collective counted per mesh dim by :class:`composer_par.testing.comm_count.CommCounter`."""

from __future__ import annotations

import contextlib
from typing import Any


def measure_steps(plans: list[str], task: str = "composer_par.testing.tasks:llama",
                  steps: int = 1) -> list[dict[str, Any]]:
    """For each plan (plan-file TOML): build the task's model on meta, apply the plan,
    run ``steps`` training steps (forward, backward, AdamW step) of this rank's share of
    the global batch under a CommCounter; return each plan's per-mesh-dim summary."""
    import torch
    import torch.distributed as dist
    from composer_par.plugins.tp import loss_parallel

    from composer_par.plan import ParallelPlan
    from composer_par.testing.comm_count import CommCounter
    from composer_par.testing.parity import _resolve, apply_to_built

    the_task = _resolve(task)
    out = []
    for text in plans:
        plan = ParallelPlan.from_toml(text)
        model, index, count = apply_to_built(the_task, plan)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        # A loss-parallel plan's loss (and its backward) runs inside loss_parallel().
        sharded_loss = any(getattr(p, "loss_parallel", False) for p in plan.plugins)
        with CommCounter() as counter:
            for step in range(steps):
                with loss_parallel() if sharded_loss else contextlib.nullcontext():
                    loss = the_task.loss(model, the_task.batch(step).chunk(count)[index])
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        mesh = plan.mesh.resolve(dist.get_world_size())
        out.append({"summary": counter.summary(mesh, dist.get_rank()),
                    "calls": [c.to_dict() for c in counter.calls]})
    return out
