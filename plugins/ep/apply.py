"""EP's changes to the model: each experts module keeps this rank's experts as DTensors
``Shard(0)`` over the ep mesh dim (so checkpoints and ``full_tensor()`` see the whole
expert tensor), its forward is replaced by the all-to-all dispatch, and, without a
data-parallel plugin, gradients are averaged over the ep ranks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from .dispatch import ExpertDispatch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from .discovery import ExpertsSite


def shard_experts(site: ExpertsSite, mesh: DeviceMesh) -> None:
    """Replace the site's expert parameters by DTensors holding this rank's experts."""
    rank, size = mesh.get_local_rank(), mesh.size()
    per_rank = site.num_experts // size
    for name in site.names:
        param = getattr(site.module, name)
        if isinstance(param, DTensor):
            raise RuntimeError(
                f"{site.path}.{name} is a DTensor over {param.device_mesh.mesh_dim_names} "
                "already: a plugin earlier in the tensor_parallel stage distributed it. List "
                "ep before the other model-parallel plugins in the plan (or give it before = "
                "[...] naming them): EP places the experts, and TP leaves them as they are")
        local = param.detach()[rank * per_rank:(rank + 1) * per_rank].clone()
        sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                     shape=param.shape, stride=param.stride())
        site.module.register_parameter(
            name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def install_dispatch(site: ExpertsSite, group: dist.ProcessGroup,
                     capacity_factor: float | None = None) -> ExpertDispatch:
    """Make the site's forward the all-to-all dispatch around its own forward."""
    module = site.module
    dispatch = ExpertDispatch(module, type(module).forward, site.names, site.num_experts,
                              group, capacity_factor)
    module.forward = dispatch  # type: ignore[method-assign]
    return dispatch


def average_over(params: Iterable[nn.Parameter], group: dist.ProcessGroup,
                 size: int) -> int:
    """After each backward, average each parameter's gradient over ``group``: what data
    parallelism does for parameters equal on every rank of it. Returns the count."""

    def hook(param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        dist.all_reduce(local, group=group)  # SUM: gloo has no AVG
        local.div_(size)

    count = 0
    for param in params:
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(hook)
            count += 1
    return count


def divide_gradients(params: Iterable[nn.Parameter], factor: int) -> int:
    """Divide each gradient reaching each parameter by ``factor`` before it accumulates
    (so accumulation over micro-batches stays a plain sum): an expert's gradient sums the
    contributions of the tokens of every data shard; the mean over shards is what one
    process computes on the global batch."""
    count = 0
    for param in params:
        if param.requires_grad:
            param.register_hook(lambda grad: grad / factor)
            count += 1
    return count


def dispatched_sites(model: nn.Module) -> list[ExpertsSite]:
    """The experts modules whose forward EP replaced, as sites."""
    from .discovery import experts_site

    sites = []
    for path, module in model.named_modules():
        if isinstance(module.__dict__.get("forward"), ExpertDispatch):
            site = experts_site(path, module)
            if site is not None:
                sites.append(site)
    return sites
