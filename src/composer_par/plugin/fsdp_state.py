"""FSDP2's comm hooks and gradient divide factors, installed on FSDP modules.

FSDP2 (``fully_shard``) and torch's composable ``replicate`` expose a public setter API
(``set_all_reduce_hook``, ``set_gradient_divide_factor``, ...), but some things this
project does need their internals: the flat reduce output's per-parameter layout, the
process group a replicate module all-reduces over, whether a module reduce-scatters.
Those reads and writes go through :mod:`composer_par.plugin.torch_private`, which
checks the torch release they were verified on.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from composer_par.findings import Finding, Rule, Severity
from composer_par.plugin import torch_private
from composer_par.plugin.capabilities import provided
from composer_par.plugin.comm import CommHook, CommSetup, GradBucket, GradReducer, InstalledCommHook

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from composer_par.plugin.context import ApplyContext
    from composer_par.plugin.view import PlanView


# -- validation: the FSDP2 internals a plan will read, on the torch it runs on ---------

UNCHECKED_TORCH_RULE = Rule(
    "CP230", Severity.ERROR,
    "the plan reads FSDP2 internals of a torch release they were not checked on",
    "use a torch release the README's support table lists as checked "
    "(composer_par.plugin.torch_private.CHECKED_TORCH); or set "
    "COMPOSER_PAR_UNCHECKED_TORCH=1 to run them unchecked, then compare a few steps with "
    "one process (composer-par selfcheck)",
    "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2(gradient_divide_factor=1.0)).use(MetaInit())"
    ".validate(llama)  # on a torch release newer than the checked ones")


def internals_read(plan: PlanView, dims: Sequence[str], factor: float | None, *,
                   apart: bool = True) -> list[str]:
    """What of a data-parallel plugin's work over ``dims`` reads FSDP2 internals: a
    gradient divide factor, a comm hook's all-reduce on one of ``dims``, and with
    ``apart`` the experts that expert parallelism shards apart (their divide factor)."""
    uses = []
    if factor is not None:
        uses.append(f"gradient_divide_factor={factor:g}")
    uses += [f"{hook.plugin}'s comm hook on {hook.dim}" for hook in plan.comm_hooks()
             if hook.all_reduce is not None and hook.dim in dims]
    if apart and provided(plan, "expert_parallel"):
        uses.append("the experts expert parallelism shards apart")
    return uses


def unchecked_torch_findings(uses: Sequence[str], version: str | None = None) -> list[Finding]:
    """CP230 when ``uses`` (:func:`internals_read`) is not empty and torch ``version``
    (the installed one by default) is not a checked release; nothing when
    COMPOSER_PAR_UNCHECKED_TORCH=1 (the reads then warn when they run)."""
    if version is None:
        import torch

        version = torch.__version__
    if (not uses or torch_private.torch_release(version) in torch_private.CHECKED_TORCH
            or os.environ.get(torch_private.UNCHECKED_ENV) == "1"):
        return []
    checked = ", ".join(f"{a}.{b}" for a, b in torch_private.CHECKED_TORCH)
    return [Finding(
        UNCHECKED_TORCH_RULE.code,
        f"torch {version} is not a release composer_par's FSDP2 internals were checked on "
        f"({checked}), and this plan reads them: {'; '.join(uses)} (FSDP2's reduced-gradient "
        "layout and divide factors, which a new torch release may change)",
        fix=UNCHECKED_TORCH_RULE.fix)]


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
        for param_group in torch_private.fsdp_param_groups(module):
            if solo is not None:
                torch_private.replace_replicate_group(param_group, solo)
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
        factor = torch_private.divide_factor(self.param_group)
        divisor = float(self.size) if factor is None else 1.0
        bucket = GradBucket(self.key, output, self._views(output), self.group, divisor)
        self.reducer(bucket)

    def _views(self, output: torch.Tensor) -> tuple[tuple[str, torch.Tensor], ...] | None:
        """Per-parameter views of FSDP's reduce output, as FSDP itself lays them out."""
        import torch

        from composer_par.blocks import clean_name

        layout = torch_private.reduce_output_layout(self.param_group)
        if sum(numel for _, numel, _, _ in layout) != output.numel():
            return None  # some parameters had no gradient this step
        views: list[tuple[str, torch.Tensor]] = []
        offset = 0
        for fqn, numel, size, stride in layout:
            view = torch.as_strided(output, size=size, stride=stride,
                                    storage_offset=output.storage_offset() + offset)
            views.append((clean_name(fqn or f"{self.key}.param{len(views)}"), view))
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
    return any(torch_private.reduce_scatters(group)
               for group in torch_private.fsdp_param_groups(module))


def apart_divide_factor(ctx: ApplyContext) -> int:
    """What the gradients of modules sharded or replicated apart (expert parallelism's
    experts) divide by: they sum the loss terms of every rank whose tokens reach them,
    each data shard's and each cp rank's part of its sequences, so the number of those
    ranks (``plan.averaged_dims()``: the data-parallel and the folded dims)."""
    factor = 1
    for name in ctx.plan.averaged_dims():
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
        factors = {torch_private.divide_factor(group)
                   for group in torch_private.fsdp_param_groups(module)}
        other = sorted(f for f in factors if f is not None and f != factor)
        if other:
            raise ValueError(
                f"{owner or 'a plugin'}: gradient_divide_factor={factor:g}, but the FSDP "
                f"modules already divide by {other[0]:g} (set by another plugin: "
                "fsdp2's or hsdp's gradient_divide_factor): give the factor on one plugin "
                "only")
    forced = 0
    for module in modules:
        module.set_gradient_divide_factor(factor)
        if sum_only and reduce_scatters(module):
            module.set_force_sum_reduction_for_comms(True)
            forced += 1
    return forced
