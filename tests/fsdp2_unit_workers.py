"""Rank-side functions for tests/test_fsdp2_units.py."""

from __future__ import annotations

from typing import Any


def train_every_rank(cases: dict[str, Any]) -> dict[str, tuple[list[float], dict[str, Any]]]:
    """For each :class:`~composer_par.testing.parity.ParityCase`: build its task on meta,
    apply its plan, train its steps on this rank's data shard; returns the mean loss of
    each step and this rank's view of every full parameter afterwards (each rank's, not
    only rank 0's: a rank whose shard went wrong shows it here)."""
    from composer_par.testing.parity import train_case

    return {name: train_case(case) for name, case in cases.items()}


def _after_one_step(plan_text: str, task: str) -> tuple[Any, Any]:
    """The plan and the task's model it applied (built on meta), after one forward and
    backward of this rank's share of step 0's batch."""
    from composer_par.plan import ParallelPlan
    from composer_par.testing.parity import _resolve, apply_to_built

    the_task = _resolve(task)
    plan = ParallelPlan.from_toml(plan_text)
    model, index, count = apply_to_built(the_task, plan)
    the_task.loss(model, the_task.batch(0).chunk(count)[index]).backward()
    return plan, model


def gradients(plans: dict[str, str], task: str = "composer_par.testing.tasks:llama"
              ) -> dict[str, dict[str, Any]]:
    """For each plan (plan-file TOML): one forward and backward of this rank's share of
    step 0's batch; returns every parameter's full gradient by name."""
    from torch.distributed.tensor import DTensor

    from composer_par.blocks import clean_name

    out = {}
    for name, text in plans.items():
        _plan, model = _after_one_step(text, task)
        grads = {}
        for pname, param in model.named_parameters():
            assert param.grad is not None, pname
            grad = param.grad
            grads[clean_name(pname)] = (grad.full_tensor() if isinstance(grad, DTensor)
                                        else grad).detach().clone()
        out[name] = grads
    return out


def unit_settings(plan_text: str, task: str = "composer_par.testing.tasks:llama"
                  ) -> dict[str, Any]:
    """What FSDP2 made of the task's model under ``plan_text``: each FSDP module's clean
    path ("" the root), whether it reshards after forward (True, False, or the int group
    size), its parameters' names, and its gradient divide factor; and the apply log."""
    from composer_par.blocks import clean_name
    from composer_par.plugin import torch_private

    # One forward: the root's lazy init decides torch's default for the root.
    plan, model = _after_one_step(plan_text, task)
    units = {}
    for raw, module in model.named_modules():
        state = getattr(module, "_get_fsdp_state", None)
        if state is None:
            continue
        groups = torch_private.fsdp_param_groups(module)
        if not groups:
            continue
        group = groups[0]
        info = group.post_forward_mesh_info
        if info is None:
            reshard: bool | int = False
        elif info.shard_mesh_size == group.mesh_info.shard_mesh_size:
            reshard = True
        else:
            reshard = int(info.shard_mesh_size)
        units[clean_name(raw)] = {
            "reshard": reshard,
            "params": sorted(clean_name(p._param_fqn or "") for p in group.fsdp_params),
            "factor": group.gradient_divide_factor,
        }
    return {"units": units, "log": [(s.stage, s.plugin, s.detail) for s in plan.applied]}


def apply_errors(plans: dict[str, str], task: str = "composer_par.testing.tasks:llama"
                 ) -> dict[str, str | None]:
    """For each plan (plan-file TOML): apply it to the task's model built on meta; the
    message of the error apply raised, or None."""
    import torch

    from composer_par.plan import ParallelPlan
    from composer_par.testing.parity import _resolve

    the_task = _resolve(task)
    out: dict[str, str | None] = {}
    for name, text in plans.items():
        plan = ParallelPlan.from_toml(text)
        with torch.device("meta"):
            model = the_task.build()
        try:
            plan.apply(model)
        except ValueError as exc:
            out[name] = str(exc)
        else:
            out[name] = None
    return out
