"""Comm hooks: a plugin customizes the collectives of ONE mesh dim.

A plugin answers the composition hook ``composer_par_comm_hooks`` with :class:`CommHook`
values; the data-parallel plugin that owns the dim consults them when it shards or
replicates, and installs them on every FSDP module it made (FSDP2's setters act on the
module they are called on, not on its FSDP submodules). What can be customized depends
on the role of the dim:

* a **replicate** dim (HSDP's): the gradient **all-reduce**. The hook receives a
  :class:`GradBucket` -- one FSDP module's flat gradient buffer (already reduce-scattered
  over the shard dim, if any), per-parameter views into it, the process group of the
  dim and the divisor that turns the group's sum into the gradient the optimizer must
  see -- and reduces it in place.

  - With FSDP2 (HSDP): FSDP2 builds a 1-D ``fully_shard`` mesh over its shard dim only,
    so FSDP2 never all-reduces over the replicate dim; the hook runs through
    ``FSDPModule.set_all_reduce_hook``, which FSDP2 calls with the reduce-scatter
    output of each module.
  - Alone (replicate-only): torch's ``replicate`` all-reduces *before* its
    ``set_all_reduce_hook`` runs (measured: the hook sees the already-reduced gradient,
    and a compressing hook would add its bytes to the full fp32 all-reduce). So the
    replicate modules' own all-reduce is pointed at a 1-rank process group (it moves no
    bytes), and the hook does the reduction over the dim's group. Parameters keep the
    layout of the plan without the hook: ``(Replicate(),)`` DTensors over the dim.

* a **shard** dim (FSDP2's): the parameter **all-gather** and the gradient
  **reduce-scatter**, through FSDP2's custom comm classes (``set_custom_all_gather`` /
  ``set_custom_reduce_scatter``): the hook's factories return instances of
  ``torch.distributed.fsdp._fully_shard._fsdp_api.AllGather`` / ``ReduceScatter``.

Validation (static, no torch): a hook on a dim no data-parallel plugin owns is CP218,
two plugins hooking one dim CP219, a collective the dim does not run (an all-reduce on
a shard dim, an all-gather on a replicate dim) CP220.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from composer_par.plugin import Declaration, Role
from composer_par.validate import Finding, did_you_mean

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from composer_par.apply_context import ApplyContext
    from composer_par.mesh import MeshSpec

__all__ = [
    "COLLECTIVES",
    "CommHook",
    "CommSetup",
    "GradBucket",
    "GradReducer",
    "InstalledCommHook",
    "all_reduce_mean",
    "comm_hook_rules",
]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
# Which collectives the owner of a dim runs over it, by the owner's role.
RUNS: dict[Role, frozenset[str]] = {
    Role.REPLICATE: frozenset({"all_reduce"}),
    Role.SHARD: frozenset({"all_gather", "reduce_scatter"}),
}


@attrs.frozen
class CommSetup:
    """What a comm-hook factory is told at apply time, once per plan apply and dim."""

    dim: str
    size: int  # the size of the mesh dim (the group size)
    group: dist.ProcessGroup  # the dim's process group for this rank
    device: torch.device
    ctx: ApplyContext


@attrs.define(eq=False)
class GradBucket:
    """One FSDP module's gradients on their way over a replicate dim.

    Reduce ``buffer`` in place: afterwards it must hold the sum over ``group`` divided
    by ``divisor``, the same on every rank of the group.
    """

    key: str  # a stable name for per-bucket state (the FSDP module's path, "<root>")
    buffer: torch.Tensor  # flat, 1-D, in the reduce dtype (fp32 unless mixed precision)
    # (parameter name, view of this rank's gradient shard in ``buffer``) in buffer order;
    # None when the layout is not known (e.g. some parameters got no gradient).
    params: tuple[tuple[str, torch.Tensor], ...] | None
    group: dist.ProcessGroup
    divisor: float  # the group size, or 1.0 when a gradient divide factor already divided


class GradReducer(Protocol):
    """What an all-reduce factory returns: called once per FSDP module per backward."""

    def __call__(self, bucket: GradBucket) -> None: ...


AllReduceFactory = Callable[[CommSetup], GradReducer]
CommFactory = Callable[[CommSetup], Any]


@attrs.frozen
class CommHook:
    """A plugin's customization of the collectives over one mesh dim.

    Give ``all_reduce`` for a replicate dim; ``all_gather`` and/or ``reduce_scatter``
    for a shard dim. Each is a factory called once per apply with a :class:`CommSetup`
    (so creating state, and importing torch, waits until then); ``plugin`` is filled in
    with the name of the plugin that answered.
    """

    dim: str
    all_reduce: AllReduceFactory | None = None
    all_gather: CommFactory | None = None
    reduce_scatter: CommFactory | None = None
    description: str = ""
    plugin: str | None = None

    def collectives(self) -> tuple[str, ...]:
        return tuple(c for c in COLLECTIVES if getattr(self, c) is not None)


@attrs.frozen
class InstalledCommHook:
    """A record, in ``ctx.notes["comm_hooks"]``, of one hook an owner installed."""

    dim: str
    plugin: str
    collective: str
    modules: int
    owner: str


def all_reduce_mean(bucket: GradBucket) -> None:
    """The plain reduction: SUM over the group, then divide. A reference for hook authors."""
    import torch.distributed as dist

    dist.all_reduce(bucket.buffer, group=bucket.group)
    bucket.buffer.div_(bucket.divisor)


# -- validation ----------------------------------------------------------------------------


def comm_hook_rules(
    mesh: MeshSpec, decls: Sequence[Declaration], hooks: Sequence[CommHook]
) -> list[Finding]:
    """CP218 (no data-parallel owner), CP219 (two hooks, one dim), CP220 (wrong collective)."""
    found: list[Finding] = []
    owners: dict[str, list[tuple[str, Role]]] = {}
    for decl in decls:
        for claim in decl.claims:
            owners.setdefault(claim.dim, []).append((decl.plugin, claim.role))
    by_dim: dict[str, list[CommHook]] = {}
    for hook in hooks:
        by_dim.setdefault(hook.dim, []).append(hook)
        asked = hook.collectives()
        if hook.dim not in mesh:
            found.append(Finding(
                "CP218",
                f"comm hook on mesh dim {hook.dim!r}, which the mesh does not have"
                f"{did_you_mean(hook.dim, mesh.names)}; the mesh has {list(mesh.names)}",
                fix="point the hook at a data-parallel mesh dim (the plugin's `dim` option), "
                "e.g. the replicate dim HSDP owns",
                plugin=hook.plugin,
            ))
            continue
        data_parallel = [(p, r) for p, r in owners.get(hook.dim, []) if r in RUNS]
        if not data_parallel:
            who = owners.get(hook.dim)
            why = (f"{who[0][0]} claims it for {who[0][1].value}" if who
                   else "no plugin claims it")
            found.append(Finding(
                "CP218",
                f"comm hook on mesh dim {hook.dim!r}, which no data-parallel plugin owns "
                f"({why}): no gradient reduction runs over it for the hook to customize",
                fix=f"add the data-parallel plugin that owns {hook.dim!r} (HSDP for a replicate "
                "dim, FSDP2 for a shard dim), or point the hook at a dim one owns",
                plugin=hook.plugin,
            ))
            continue
        owner, role = data_parallel[0]
        runs = RUNS[role]
        wrong = [c for c in asked if c not in runs]
        if wrong or not asked:
            what = ", ".join(wrong) if wrong else "no collective"
            found.append(Finding(
                "CP220",
                f"comm hook customizes {what} on mesh dim {hook.dim!r}, which {owner} "
                f"{'replicates' if role is Role.REPLICATE else 'shards'} over: that dim runs "
                f"only {' and '.join(sorted(runs))}",
                fix="hook all_reduce on a replicate dim, all_gather / reduce_scatter on a "
                "shard dim",
                plugin=hook.plugin,
            ))
    for dim, hooked in by_dim.items():
        plugins = [h.plugin or "?" for h in hooked]
        if len(hooked) > 1:
            found.append(Finding(
                "CP219",
                f"mesh dim {dim!r} has comm hooks from {' and '.join(plugins)}: its "
                "collectives can run only one plugin's code",
                fix="keep one comm-hook plugin per mesh dim",
                plugin=plugins[1],
            ))
    return found


# -- installing (called by the data-parallel plugin that owns the dim) ---------------------


def module_names(model: nn.Module) -> dict[int, str]:
    """id(module) -> the model's own path of it ("<root>" for the model)."""
    from composer_par.blocks import clean_name

    return {id(m): clean_name(n) or "<root>" for n, m in model.named_modules()}


def _record(ctx: ApplyContext, hook: CommHook, collective: str, count: int, owner: str) -> None:
    ctx.notes.setdefault("comm_hooks", []).append(
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
        state = module._get_fsdp_state()  # type: ignore[operator]
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
    done = {(r.dim, r.collective) for r in ctx.notes.get("comm_hooks", [])}
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
            "the replicate-only comm-hook path needs torch 2.13 (see composer_par.comm)"
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
