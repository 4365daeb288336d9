"""Rank-side functions of tests/test_ep_tp.py (the tasks are tests/ep_workers.py's)."""

from __future__ import annotations

from typing import Any


def apply_plan(plan_toml: str, task: str = "moe_llama") -> None:
    """Apply ``plan_toml`` to the task's model on this rank (for the errors it raises)."""
    from composer_par.testing.parity import apply_to_built, build_plan
    from tests import ep_workers

    apply_to_built(getattr(ep_workers, task), build_plan(plan_toml))


def layouts(plan_toml: str, task: str = "moe_llama") -> dict[str, Any]:
    """After apply on this rank: (mesh dim names, placements, local shape) of each expert
    parameter of the first block."""
    from torch.distributed.tensor import DTensor

    from composer_par.testing.parity import apply_to_built, build_plan
    from tests import ep_workers

    model, _, _ = apply_to_built(getattr(ep_workers, task), build_plan(plan_toml))
    out = {}
    for name, param in model.named_parameters():
        if ".0." in name and ".experts." in name:
            assert isinstance(param, DTensor), (name, type(param))
            out[name.rsplit(".", 1)[-1]] = (
                param.device_mesh.mesh_dim_names, tuple(map(str, param.placements)),
                tuple(param.to_local().shape))
    return out
