"""Every read or write of torch-private FSDP state, behind one torch-version gate.

FSDP2 (``fully_shard``) and torch's composable ``replicate`` expose a public setter API
(``set_all_reduce_hook``, ``set_gradient_divide_factor``, ...), but some things this
project does need their internals: the flat reduce output's per-parameter layout, the
process group a replicate module all-reduces over, whether a module reduce-scatters.
Those reads and writes live here and nowhere else, so that a torch upgrade has one
module to re-check. :data:`CHECKED_TORCH` is the range they were checked against;
:func:`check_torch` refuses any other torch with the reason, and
``tests/test_fsdp_state.py`` fails loudly on an unchecked torch.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from composer_par.plugin.comm import CommHook, CommSetup, GradBucket, GradReducer, InstalledCommHook

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from composer_par.plugin.context import ApplyContext

# (major, minor) releases of torch whose FSDP internals the code below was checked on.
CHECKED_TORCH: tuple[tuple[int, int], ...] = ((2, 13),)


class UncheckedTorchError(RuntimeError):
    """The installed torch is not one this module's private FSDP accesses were checked on."""


def torch_release(version: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_torch(version: str | None = None) -> None:
    """Raise :class:`UncheckedTorchError` unless torch's release is in CHECKED_TORCH."""
    if version is None:
        import torch

        version = torch.__version__
    if torch_release(version) not in CHECKED_TORCH:
        checked = ", ".join(f"{a}.{b}" for a, b in CHECKED_TORCH)
        raise UncheckedTorchError(
            f"torch {version}: composer_par's comm hooks and gradient divide factors touch "
            f"FSDP2 internals checked only on torch {checked} "
            "(composer_par.plugin.fsdp_state); pin a checked torch, or re-check that module "
            "and add the release to CHECKED_TORCH"
        )


@functools.cache
def _checked() -> bool:
    check_torch()
    return True


def fsdp_state(module: Any) -> Any:
    """The FSDP state of an FSDP module (``fully_shard`` or ``replicate``)."""
    _checked()
    return module._get_fsdp_state()


# -- installing (called by the data-parallel plugin that owns the dim) ---------------------


def module_names(model: nn.Module) -> dict[int, str]:
    """id(module) -> the model's own path of it ("<root>" for the model)."""
    from composer_par.blocks import clean_name

    return {id(m): clean_name(n) or "<root>" for n, m in model.named_modules()}


def _record(ctx: ApplyContext, hook: CommHook, collective: str, count: int, owner: str) -> None:
    ctx.installed_comm_hooks.append(
        InstalledCommHook(hook.dim, hook.plugin or "?", collective, count, owner)
    )


def _setup(ctx: ApplyContext, dim: str) -> CommSetup:
    mesh = ctx.submesh(dim)
    return CommSetup(dim, int(mesh.size()), mesh.get_group(), ctx.device, ctx)


def install_all_reduce(
    ctx: ApplyContext,
    modules: Iterable[nn.Module],
    hook: CommHook,
    *,
    owner: str,
    replace_native: bool,
) -> int:
    """Run ``hook``'s gradient reduction over its dim on every FSDP module in ``modules``.

    ``replace_native``: the modules all-reduce over the dim themselves (torch's
    ``replicate``); their own all-reduce is re-pointed at a 1-rank group first, so that
    it moves nothing and the hook does the reduction. FSDP2 modules built on a mesh
    without the dim need no such step (they never all-reduce).
    """
    assert hook.all_reduce is not None
    setup = _setup(ctx, hook.dim)
    reducer = hook.all_reduce(setup)
    names = module_names(ctx.model)
    solo = _solo_group() if replace_native else None
    count = 0
    for module in modules:
        state = fsdp_state(module)
        for param_group in state._fsdp_param_groups:
            if solo is not None:
                _detach_native_all_reduce(param_group, solo)
            module.set_all_reduce_hook(  # type: ignore[operator]
                _BucketHook(reducer, names.get(id(module), "?"), param_group, setup.group)
            )
        count += 1
    _record(ctx, hook, "all_reduce", count, owner)
    return count


def install_shard_comms(
    ctx: ApplyContext, modules: Iterable[nn.Module], hook: CommHook, *, owner: str
) -> int:
    """Install ``hook``'s custom all-gather / reduce-scatter on every FSDP module."""
    setup = _setup(ctx, hook.dim)
    all_gather = hook.all_gather(setup) if hook.all_gather else None
    reduce_scatter = hook.reduce_scatter(setup) if hook.reduce_scatter else None
    count = 0
    for module in modules:
        if all_gather is not None:
            module.set_custom_all_gather(all_gather)  # type: ignore[operator]
        if reduce_scatter is not None:
            module.set_custom_reduce_scatter(reduce_scatter)  # type: ignore[operator]
        count += 1
    for name in hook.collectives():
        _record(ctx, hook, name, count, owner)
    return count


def check_installed(ctx: ApplyContext, hooks: Iterable[CommHook]) -> None:
    """Raise if a declared hook was installed by no owner (a plugin that ignores hooks)."""
    done = {(r.dim, r.collective) for r in ctx.installed_comm_hooks}
    for hook in hooks:
        missing = [c for c in hook.collectives() if (hook.dim, c) not in done]
        if missing:
            raise RuntimeError(
                f"comm hook of {hook.plugin!r} on mesh dim {hook.dim!r} ({', '.join(missing)}) "
                "was not installed: the plugin that owns the dim does not consult comm hooks "
                "(composer_par_comm_hooks); use FSDP2 / HSDP, or drop the hook"
            )


_SOLO: dict[str, Any] = {}


def _solo_group() -> Any:
    """A process group of this rank alone (made once per process and backend)."""
    import torch.distributed as dist

    backend = str(dist.get_backend())
    if backend not in _SOLO:
        _SOLO[backend] = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return _SOLO[backend]


def _detach_native_all_reduce(param_group: Any, solo: Any) -> None:
    """Point a replicate module's own all-reduce at a 1-rank group (torch 2.13 internals:
    ``FSDPParamGroup.mesh_info.replicate_process_group``, read only by that all-reduce)."""
    info = getattr(param_group, "mesh_info", None)
    if info is None or not hasattr(info, "replicate_process_group"):
        raise RuntimeError(
            "this torch's replicate modules have no mesh_info.replicate_process_group: "
            "the replicate-only comm-hook path needs torch 2.13 (see composer_par.plugin.comm)"
        )
    info.replicate_process_group = solo


class _BucketHook:
    """The ``set_all_reduce_hook`` callable: wraps FSDP's flat output in a GradBucket."""

    def __init__(self, reducer: GradReducer, key: str, param_group: Any, group: Any) -> None:
        self.reducer = reducer
        self.key = key
        self.param_group = param_group
        self.group = group
        self.size = int(group.size())

    def __call__(self, output: torch.Tensor) -> None:
        # FSDP divides by the shard size (or by the whole divide factor, when one is set)
        # around its reduce-scatter; the replicate dim's share is the hook's to divide.
        factor = self.param_group.gradient_divide_factor
        divisor = float(self.size) if factor is None else 1.0
        bucket = GradBucket(self.key, output, self._views(output), self.group, divisor)
        self.reducer(bucket)

    def _views(self, output: torch.Tensor) -> tuple[tuple[str, torch.Tensor], ...] | None:
        """Per-parameter views of FSDP's reduce output, as FSDP itself lays them out."""
        import torch

        from composer_par.blocks import clean_name

        params = self.param_group.fsdp_params
        sizes = [torch.Size(p.padded_sharded_param_size).numel() for p in params]
        if sum(sizes) != output.numel():  # some parameters had no gradient this step
            return None
        views: list[tuple[str, torch.Tensor]] = []
        offset = 0
        for param, numel in zip(params, sizes, strict=True):
            view = torch.as_strided(output, size=param.sharded_size,
                                    stride=param.contiguous_sharded_stride,
                                    storage_offset=output.storage_offset() + offset)
            name = clean_name(param._param_fqn or f"{self.key}.param{len(views)}")
            views.append((name, view))
            offset += numel
        return tuple(views)


def premul_sum_supported(ctx: ApplyContext) -> bool:
    """Whether the data-parallel collectives can use ``ReduceOp.PREMUL_SUM`` (NCCL only).

    Measured: gloo raises ``RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo`` in
    both all_reduce and reduce_scatter, i.e. in the first backward.
    """
    import torch.distributed as dist

    if ctx.device_mesh is None or not dist.is_initialized():
        return True  # one process: no collective runs
    backend = str(dist.get_backend(ctx.device_mesh.get_group(0)))
    return ctx.device_mesh.device_type == "cuda" and "nccl" in backend


def reduce_scatters(module: Any) -> bool:
    """Whether an FSDP module reduce-scatters its gradients (a shard group of size > 1)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    state = fsdp_state(module)
    return any(
        isinstance(group.mesh_info, FSDPMeshInfo) and group.mesh_info.shard_mesh_size > 1
        for group in state._fsdp_param_groups
    )


def apart_divide_factor(ctx: ApplyContext) -> int:
    """What the gradients of modules sharded or replicated apart (expert parallelism's
    experts) divide by: they sum the loss terms of every rank whose tokens reach them,
    each data shard's and each cp rank's part of its sequences, so the number of those
    ranks (``plan.data_parallel_dims()`` and the folded dims)."""
    dims = set(ctx.plan.data_parallel_dims()) | {f.dim for f in ctx.folded_dims()}
    factor = 1
    for name in dims:
        factor *= ctx.mesh.size(name)
    return factor


def set_gradient_divide_factor(modules: Iterable[Any], factor: float, *, sum_only: bool,
                               owner: str = "") -> int:
    """Set ``factor`` on every FSDP module; returns how many were switched to SUM-only.
    A module that another plugin gave a different factor already is refused (ValueError
    naming ``owner``): two factors would leave whichever was set last, silently.

    ``FSDPModule.set_gradient_divide_factor`` and ``set_force_sum_reduction_for_comms`` act
    on the module they are called on, not on its FSDP submodules, so each module gets the
    call. With a factor, FSDP2 reduce-scatters with ``PREMUL_SUM(1/factor)`` (unless the
    factor equals the shard size); backends without PREMUL_SUM (gloo) get SUM reductions
    and a division afterwards instead. Modules that do not reduce-scatter (replicate-only)
    keep torch's path: it divides locally before a SUM all-reduce, and forcing SUM there
    would divide twice (measured on torch 2.13).
    """
    modules = list(modules)
    for module in modules:
        other = {group.gradient_divide_factor
                 for group in fsdp_state(module)._fsdp_param_groups} - {None, factor}
        if other:
            raise ValueError(
                f"{owner or 'a plugin'}: gradient_divide_factor={factor:g}, but the FSDP "
                f"modules already divide by {sorted(other)[0]:g} (set by another plugin: "
                "fsdp2's or hsdp's gradient_divide_factor): give the factor on one plugin "
                "only")
    forced = 0
    for module in modules:
        module.set_gradient_divide_factor(factor)
        if sum_only and reduce_scatters(module):
            module.set_force_sum_reduction_for_comms(True)
            forced += 1
    return forced
