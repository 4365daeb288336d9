"""Rank-side functions for tests/test_collective_counts.py."""

from __future__ import annotations

from typing import Any

# {mesh dim label: {collective kind: calls}} for one training step on one rank.
Counts = dict[str, dict[str, int]]


def count_steps(plans: dict[str, str], steps: int = 2, early_stop: bool = True,
                task: str = "composer_par.testing.tasks:llama") -> dict[str, list[Counts]]:
    """For each plan (plan-file TOML): build the task's model on meta, apply the plan and
    train ``steps`` steps (forward, backward, AdamW step, zero_grad) of this rank's share
    of the global batch, each step under its own CommCounter. Returns each plan's calls
    per step, per mesh dim label and kind. ``early_stop``: torch's
    ``set_checkpoint_early_stop`` during the steps (torch's default: True)."""
    import torch
    import torch.distributed as dist
    from torch.utils.checkpoint import set_checkpoint_early_stop

    from composer_par.plan import ParallelPlan
    from composer_par.testing.comm_count import CommCounter
    from composer_par.testing.parity import _resolve, apply_to_built

    the_task = _resolve(task)
    out: dict[str, list[Counts]] = {}
    for name, text in plans.items():
        plan = ParallelPlan.from_toml(text)
        model, index, count = apply_to_built(the_task, plan)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        mesh = plan.mesh.resolve(dist.get_world_size())
        per_step = []
        for step in range(steps):
            with set_checkpoint_early_stop(early_stop), CommCounter() as counter:
                loss = the_task.loss(model, the_task.batch(step).chunk(count)[index])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            summary = counter.summary(mesh, dist.get_rank())
            per_step.append({label: {kind: totals["calls"] for kind, totals in kinds.items()}
                             for label, kinds in summary.items()})
        out[name] = per_step
    return out


def calls_in_order(plan_text: str, task: str = "composer_par.testing.tasks:llama") -> Any:
    """Every collective of one training step in order (op, group), for debugging a count."""
    from composer_par.plan import ParallelPlan
    from composer_par.testing.comm_count import CommCounter
    from composer_par.testing.parity import _resolve, apply_to_built

    the_task = _resolve(task)
    plan = ParallelPlan.from_toml(plan_text)
    model, index, count = apply_to_built(the_task, plan)
    with CommCounter() as counter:
        the_task.loss(model, the_task.batch(0).chunk(count)[index]).backward()
    return [(c.kind, c.op, c.group, c.payload_bytes) for c in counter.calls]
