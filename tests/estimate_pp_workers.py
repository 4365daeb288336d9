"""Rank-side functions for tests/test_estimate_pp.py: real pipeline steps on gloo ranks,
with every collective and point-to-point send counted per mesh dim by
:class:`composer_par.testing.comm_count.CommCounter`."""

from __future__ import annotations

from typing import Any

TASK = "tests.pp_workers:llama8_b16"


def measure_pipeline_steps(plans: list[str], task: str = TASK) -> list[dict[str, Any]]:
    """For each plan (plan-file TOML): build the task's model on meta, apply the plan, run
    one training step (shape inference included), then count a second one; return its
    per-mesh-dim summary and every send (kind, bytes, peer group)."""
    import torch
    import torch.distributed as dist

    from composer_par.plan import ParallelPlan
    from composer_par.testing.comm_count import CommCounter
    from composer_par.testing.parity import _resolve, apply_to_built
    from tests.pp_workers import loss_fn_for, split_batch

    the_task = _resolve(task)
    out = []
    for text in plans:
        plan = ParallelPlan.from_toml(text)
        model, index, count = apply_to_built(the_task, plan)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        step = plan.training_step(model, loss_fn_for(the_task))
        inputs, targets = split_batch(the_task, the_task.batch(0).chunk(count)[index])
        # The first step also exchanges the stages' tensor shapes: not a step's traffic.
        step.step(inputs, targets)
        optimizer.step()
        optimizer.zero_grad()
        inputs, targets = split_batch(the_task, the_task.batch(1).chunk(count)[index])
        with CommCounter() as counter:
            step.step(inputs, targets)
        optimizer.step()
        optimizer.zero_grad()
        mesh = plan.mesh.resolve(dist.get_world_size())
        rank = dist.get_rank()
        out.append({"rank": rank, "coordinate": mesh.coordinate(rank),
                    "summary": counter.summary(mesh, rank),
                    "sends": [c.to_dict() for c in counter.calls if c.kind == "send"]})
    return out
