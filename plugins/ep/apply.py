"""EP's changes to the model: each experts module keeps this rank's experts as DTensors
``Shard(0)`` over the ep mesh dim (so checkpoints and ``full_tensor()`` see the whole
expert tensor), its forward is replaced by the all-to-all dispatch, and, without a
data-parallel plugin, gradients are averaged over the ep ranks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

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
        _refuse_distributed(site, name, param)
        local = param.detach()[rank * per_rank:(rank + 1) * per_rank].clone()
        sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                     shape=param.shape, stride=param.stride())
        site.module.register_parameter(
            name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def split_experts(site: ExpertsSite, mesh: DeviceMesh, ep_dim: str, tp_dim: str) -> None:
    """Expert tensor parallelism: replace the site's expert parameters by DTensors over
    ``mesh`` (its dims ``ep_dim`` and ``tp_dim``), ``Shard(0)`` over ep and each one's
    :func:`~.expert_tp.expert_splits` over tp (the output projection's bias whole)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    from composer_par.plugin import torch_private

    from .expert_tp import expert_splits

    splits = expert_splits(site)
    assert splits is not None, site.path  # CP806 refused it
    names = mesh.mesh_dim_names or ()
    assert set(names) == {ep_dim, tp_dim}, names
    for split in splits:
        param = getattr(site.module, split.name)
        _refuse_distributed(site, split.name, param)
        over_tp: Any = Replicate()
        if split.tensor_dim is not None:
            # [gate; up] concatenated: each rank keeps its part of both halves.
            over_tp = (torch_private.strided_shard()(split.tensor_dim, split_factor=2)
                       if split.packed
                       else Shard(split.tensor_dim))
        placements = [Shard(0) if name == ep_dim else over_tp for name in names]
        site.module.register_parameter(split.name, nn.Parameter(
            distribute_tensor(param.detach(), mesh, placements, src_data_rank=None),
            requires_grad=param.requires_grad))


def _refuse_distributed(site: ExpertsSite, name: str, param: torch.Tensor) -> None:
    if isinstance(param, DTensor):
        raise RuntimeError(
            f"{site.path}.{name} is a DTensor over {param.device_mesh.mesh_dim_names} "
            "already: a plugin earlier in the tensor_parallel stage distributed it. List "
            "ep before the other model-parallel plugins in the plan (or give it before = "
            "[...] naming them): EP places the experts, and TP leaves them as they are")


def install_dispatch(site: ExpertsSite, group: dist.ProcessGroup,
                     capacity_factor: float | None = None,
                     tp_mesh: DeviceMesh | None = None) -> ExpertDispatch:
    """Make the site's forward the all-to-all dispatch around its own forward; with
    ``tp_mesh`` (expert tensor parallelism), partial outputs summed over it."""
    from .expert_tp import expert_splits

    module = site.module
    whole: tuple[str, ...] = ()
    if tp_mesh is not None:
        whole = tuple(s.name for s in expert_splits(site) or () if s.tensor_dim is None)
    dispatch = ExpertDispatch(module, type(module).forward, site.names, site.num_experts,
                              group, capacity_factor, tp_mesh, whole)
    module.forward = dispatch  # type: ignore[method-assign]
    return dispatch


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
