"""FT: fault-tolerant replica groups over the replicate mesh dim, with torchft.

Each coordinate of the fault-tolerant dim (HSDP's replicate dim, outermost) is a replica
group: its own launch of the plan (its own ``torchrun``) over the other dims (FSDP2, TP,
PP, EP, CP as usual). The groups meet through torchft's lighthouse: every step they form
a quorum, average their gradients through torchft's managed all-reduce, and apply the
step only if the quorum held. A group that dies is dropped from the next quorum while
the others keep training; restarted, it takes a live group's model and optimizer state
through torchft's checkpoint transport (not from disk) and trains on::

    plan = (ParallelPlan(MeshSpec(dp_replicate=4, dp_shard=8))
            .use(HSDP()).use(FSDP2()).use(FaultTolerance(min_replicas=2)).use(MetaInit()))
    model = plan.apply(model)  # each group's launch: REPLICA_GROUP_ID, TORCHFT_LIGHTHOUSE
    step = plan.training_step(model, loss_fn)
    replicas = replica_group_of(model)  # also plan.notes["ft"]
    while replicas.step < steps:
        step.begin()                    # the quorum: a healing group takes its peers' step
        inputs, targets = batch(replicas.step)     # this rank's shard: plan.data_shard()
        step.step(inputs, targets)
        step.optimizer_step(optimizer)  # False: discarded (a group died); the same batch again

The plugin claims no mesh dim: HSDP owns the fault-tolerant dim, and this plugin hooks
its all-reduce (``composer_par_comm_hooks``), so FSDP2 / HSDP need not know torchft.
Through ``composer_par_launch_dims`` it tells the plan that the dim spans launches: each
launch builds its mesh with the dim at size 1. docs/fault-tolerance.md says what
survives what, the cost of the quorum, and how to launch the groups.

Modules: ``findings`` (rule codes CP971-CP977), ``lighthouse`` (its address, and whether
it answers), ``runtime`` (torchft's Manager and the step protocol), ``state`` (what a
healing group takes), ``transport`` (torchft's HTTP transport, read weights-only),
``estimate`` (the cost per step). torch and torchft are imported only at apply.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from composer_par.plugin import (
    CodeRange,
    CommHook,
    CommSetup,
    EstimatePart,
    Finding,
    GradReducer,
    LaunchDim,
    Plugin,
    Role,
    Rule,
    bool_option,
    dim_option,
    hookimpl,
    int_option,
    ordering_option,
)

from .estimate import in_place_of, plan_estimate
from .findings import CATALOG, plan_findings
from .lighthouse import LIGHTHOUSE_ENV, LighthouseUnreachable, lighthouse_address, normalize
from .runtime import (
    GROUP_ENV,
    FaultToleranceError,
    ReplicaGroup,
    ReplicaSettings,
    StepRecord,
    group_index,
    replica_group_of,
)
from .state import ReplicaLayoutError

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.plugin import ApplyContext, MeshSpec, PlanView

METHODS = ("ddp", "local_sgd", "diloco")
NOTE = "ft"


def _method(value: Any) -> str:
    if not isinstance(value, str) or value not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}; got {value!r}")
    return value


def _optional_group(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 0):
        raise ValueError(f"group must be an int >= 0 or unset; got {value!r}")


def _optional_address(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"lighthouse must be host:port or http://host:port; got {value!r}")
    return normalize(value)


def _optional_text(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ValueError(f"{attribute.name} must be a non-empty string or unset; got "
                         f"{value!r}")


def _number(*, above: float | None = None, at_least: float | None = None,
            below: float | None = None, optional: bool = False) -> Any:
    """A finite number option within the bounds given (None allowed with ``optional``)."""
    bounds = [f"> {above:g}" if above is not None else "",
              f">= {at_least:g}" if at_least is not None else "",
              f"< {below:g}" if below is not None else ""]
    wanted = " and ".join(b for b in bounds if b)

    def check(instance: Any, attribute: Any, value: Any) -> None:
        if optional and value is None:
            return
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or (above is not None and value <= above)
                or (at_least is not None and value < at_least)
                or (below is not None and value >= below)):
            raise ValueError(f"{attribute.name} must be a number {wanted}; got {value!r}")
    return check


def _env_group() -> int | None:
    value = os.environ.get(GROUP_ENV, "").strip()
    return int(value) if value.isdigit() else None


@attrs.frozen
class FaultTolerance(Plugin):
    """Fault-tolerant replica groups over ``dim`` (HSDP's replicate dim) with torchft.

    Options:

    * ``dim``: the fault-tolerant mesh dim (default ``dp_replicate``), the outermost; its
      size in ``[mesh]`` is the number of replica groups;
    * ``group``: this launch's replica group index (default ``$REPLICA_GROUP_ID``);
    * ``lighthouse``: the lighthouse's address, ``host:port`` (default
      ``$TORCHFT_LIGHTHOUSE``);
    * ``min_replicas``: the fewest groups a step may commit with (1);
    * ``method``: ``"ddp"`` (average gradients every step), ``"local_sgd"`` (average the
      parameters every ``sync_every`` steps) or ``"diloco"`` (an outer SGD step on the
      averaged pseudo-gradients every ``sync_every`` steps: ``outer_lr`` 0.7,
      ``outer_momentum`` 0.9, ``outer_nesterov`` true);
    * ``sync_every``: steps between syncs (1; ``ddp`` takes 1 only);
    * ``init_sync``: at step 0 every group takes the first group's weights (true);
    * ``timeout``: seconds for the quorum, collectives and heals (default: the plan's);
    * ``store``: this launch's TCPStore, ``host:port`` (default torchrun's MASTER_ADDR and
      MASTER_PORT); ``hostname``: the name other groups reach this group's manager and
      checkpoint server by (default this host's name).
    """

    name: ClassVar[str] = "ft"
    requires: ClassVar[frozenset[str]] = frozenset({"data_parallel"})
    rules: ClassVar[tuple[Rule, ...]] = CATALOG
    code_ranges: ClassVar[tuple[CodeRange, ...]] = (
        CodeRange("CP", 971, 979, "fault-tolerant replica groups"),)

    dim: str = dim_option("dp_replicate")
    group: int | None = attrs.field(default=None, validator=_optional_group)
    lighthouse: str | None = attrs.field(default=None, converter=_optional_address)
    min_replicas: int = int_option(1, low=1)
    method: str = attrs.field(default="ddp", converter=_method)
    sync_every: int = int_option(1, low=1)
    outer_lr: float = attrs.field(default=0.7, validator=_number(above=0.0))
    outer_momentum: float = attrs.field(default=0.9, validator=_number(at_least=0.0, below=1.0))
    outer_nesterov: bool = bool_option(True)
    init_sync: bool = bool_option(True)
    timeout: float | None = attrs.field(default=None,
                                        validator=_number(above=0.0, optional=True))
    store: str | None = attrs.field(default=None, validator=_optional_text)
    hostname: str | None = attrs.field(default=None, validator=_optional_text)
    after: tuple[str, ...] = ordering_option()
    before: tuple[str, ...] = ordering_option()

    # -- composition ---------------------------------------------------------------------

    @hookimpl
    def composer_par_launch_dims(self) -> list[LaunchDim]:
        return [LaunchDim(self.dim, self.group if self.group is not None else _env_group())]

    @hookimpl
    def composer_par_comm_hooks(self) -> list[CommHook]:
        return [CommHook(self.dim, all_reduce=self._reducer, description=self._summary())]

    def _reducer(self, setup: CommSetup) -> GradReducer:
        """The all-reduce across replica groups (called by the owner of ``dim`` at apply);
        makes this launch's :class:`ReplicaGroup` the first time."""
        ctx = setup.ctx
        runtime = ctx.notes.get(NOTE)
        if runtime is None:
            settings = attrs.evolve(self._settings(ctx.plan), mesh=ctx.mesh.dims)
            runtime = ctx.notes[NOTE] = ReplicaGroup(settings, setup.device)
        return runtime.reduce  # type: ignore[no-any-return]

    def _settings(self, plan: PlanView) -> ReplicaSettings:
        groups = plan.mesh.size(self.dim)
        index = group_index(self.group)
        if not 0 <= index < groups:
            raise FaultToleranceError(f"replica group {index} is outside {self.dim}({groups})"
                                      f": give each launch 0 to {groups - 1}")
        timeout = (timedelta(seconds=self.timeout) if self.timeout is not None
                   else plan.timeout)
        return ReplicaSettings(
            dim=self.dim, index=index, groups=groups,
            lighthouse=lighthouse_address(self.lighthouse), min_replicas=self.min_replicas,
            method=self.method, sync_every=self.sync_every, outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum, outer_nesterov=self.outer_nesterov,
            init_sync=self.init_sync, timeout=timeout, store=self.store,
            hostname=self.hostname)

    def _summary(self) -> str:
        if self.method == "ddp":
            return (f"torchft's managed all-reduce across replica groups, every step "
                    f"(commit needs >= {self.min_replicas} group(s))")
        return (f"{self.method}: gradients stay in each group; torchft averages the "
                f"{'parameters' if self.method == 'local_sgd' else 'pseudo-gradients'} "
                f"every {self.sync_every} step(s)")

    # -- validation ----------------------------------------------------------------------

    @hookimpl
    def composer_par_validate_plan(self, plan: PlanView, mesh: MeshSpec) -> list[Finding]:
        # The mesh as the plan states it: ``mesh`` is resolved on the world size where it
        # fits, and a -1 there (CP973) would be gone.
        return plan_findings(self.dim, plan.mesh, plan.declarations(),
                             min_replicas=self.min_replicas,
                             group=self.group if self.group is not None else _env_group(),
                             method=self.method, sync_every=self.sync_every)

    # -- explain and estimate ------------------------------------------------------------

    @hookimpl
    def composer_par_describe(self, plan: PlanView) -> list[tuple[str, str]]:
        size = plan.mesh.size(self.dim) if self.dim in plan.mesh else "?"
        where = self.lighthouse or f"${LIGHTHOUSE_ENV}"
        group = self.group if self.group is not None else f"${GROUP_ENV}"
        return [
            ("data_parallel", f"{self.dim}({size}) spans {size} replica group(s), one launch "
             f"each (this one: group {group}); all-reduce over it: {self._summary()}"),
            ("finalize", f"join the quorum at the lighthouse {where}; a restarted group "
             "heals from a live one (torchft's checkpoint transport)"),
        ]

    @hookimpl
    def composer_par_estimate(self, layout: Any, model: Any) -> EstimatePart:
        return plan_estimate(self.dim, self.method, self.sync_every, layout, model)

    @hookimpl
    def composer_par_estimate_comm_hook(self, collective: Any) -> tuple[Any, ...] | None:
        return in_place_of(self.method, collective)

    # -- apply and the training step -----------------------------------------------------

    @hookimpl
    def composer_par_finalize(self, ctx: ApplyContext) -> str:
        runtime = ctx.notes.get(NOTE)
        if not isinstance(runtime, ReplicaGroup):
            owners = [d.plugin for d in ctx.hooks.declarations() for c in d.claims
                      if c.dim == self.dim and c.role is Role.REPLICATE]
            raise FaultToleranceError(
                f"the all-reduce over {self.dim} was not handed to the ft plugin"
                + (f" ({owners[0]} did not install its comm hook)" if owners else
                   f": no data-parallel plugin replicates over {self.dim} (add HSDP)"))
        runtime.add_model(ctx.model)
        settings = runtime.settings
        return (f"replica group {settings.index} of {settings.groups} over {settings.dim}; "
                f"lighthouse {settings.lighthouse}; {self._summary()}")

    @hookimpl
    def composer_par_step_begin(self, model: nn.Module) -> None:
        _runtime(model).begin()

    @hookimpl
    def composer_par_step_commit(self, model: nn.Module, optimizer: Any) -> bool:
        return _runtime(model).commit(optimizer)


def _runtime(model: nn.Module) -> ReplicaGroup:
    runtime = replica_group_of(model)
    if runtime is None:
        raise FaultToleranceError(
            "this model was not applied by a plan with the ft plugin: pass the model "
            "plan.apply() returned to plan.training_step")
    return runtime


__all__ = ["METHODS", "FaultTolerance", "FaultToleranceError", "LighthouseUnreachable",
           "ReplicaGroup", "ReplicaLayoutError", "StepRecord", "replica_group_of"]
