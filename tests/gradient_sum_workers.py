"""Rank-side function of tests/test_gradient_sum.py."""

from __future__ import annotations

from typing import Any


def summed_over_the_mesh() -> dict[str, Any]:
    """sum_gradient on a 1-D mesh of every rank: the forward value, the gradient of an
    input used once (rank r's part is r + 1), and of one that an add also hands straight
    to another input (the same gradient tensor for both: summing it in place would change
    the other's)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from composer_par.plugin import sum_gradient

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    x = torch.ones(3, requires_grad=True)
    y = sum_gradient(x, mesh)
    (y * (rank + 1)).sum().backward()
    a = torch.ones(3, requires_grad=True)
    b = torch.ones(3, requires_grad=True)
    weights = torch.tensor([1.0, 2.0, 3.0])  # a contiguous gradient for the add's output
    scaled = b * 1.0  # made first: its backward runs after sum_gradient's
    ((sum_gradient(a, mesh) + scaled) * weights).sum().backward()
    with torch.no_grad():
        untouched = sum_gradient(x, mesh) is x
    return {"value": y.detach().tolist(), "x_grad": x.grad.tolist(),
            "a_grad": a.grad.tolist(), "b_grad": b.grad.tolist(), "untouched": untouched}
