"""ParallelPlan: which plugins, over which mesh; validated, explained, then applied."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.allocation import (
    Allocation,
    AllocationConflict,
    allocation_findings,
    read_allocation,
    wanted_topology,
)
from composer_par.blocks import Block, BlockSpec, find_blocks
from composer_par.findings import Finding, PlanError, Report
from composer_par.logging import get_logger
from composer_par.mesh import DEFAULT_TIMEOUT_S, INFER, MeshError, MeshSpec, as_timeout
from composer_par.plugin import STAGES, FoldedDim, LaunchDim, Plugin, Role, Stage
from composer_par.plugin.caller import HookCaller, HookError
from composer_par.plugin.context import AppliedStep, ApplyContext
from composer_par.plugin.fsdp_state import check_installed
from composer_par.plugin.view import PlanView
from composer_par.replicas import EVERY as REPLICA_CHECK_EVERY
from composer_par.rules import (
    claim_rules,
    comm_hook_rules,
    mesh_rules,
    model_rules,
    plugin_rules,
    topology_rules,
)
from composer_par.topology import Topology

if TYPE_CHECKING:
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from composer_par.planfile import PlanParts
    from composer_par.plugin.comm import InstalledCommHook
    from composer_par.plugin.pipeline import Pipeline, Timeline
    from composer_par.plugin.registry import Registry
    from composer_par.training import TrainingStep

log = get_logger(__name__)

# What the allocation check at a job's start finds (composer_par.allocation).
ALLOCATION_CODES = frozenset({"CP306", "CP307", "CP308", "CP309"})


class ParallelPlan:
    """``ParallelPlan(MeshSpec(dp_shard=4)).use(FSDP2()).use(MetaInit(seed=0))``.

    ``mesh`` is a :class:`MeshSpec` or a live ``DeviceMesh`` with dim names.
    ``topology`` says how ranks lie on nodes; under torchrun it is read from the
    environment when not given. ``device`` overrides the materialization device
    (default: the current CUDA device when the mesh is on CUDA, else the CPU).
    ``timeout`` (seconds or a timedelta, default 300 s) bounds every wait in a collective
    on the process groups the plan creates; give ``init_process_group`` the same.
    """

    def __init__(
        self,
        mesh: MeshSpec | DeviceMesh,
        *,
        topology: Topology | None = None,
        device: str | torch.device | None = None,
        timeout: float | timedelta | None = None,
    ) -> None:
        self._device_mesh: DeviceMesh | None = None
        if isinstance(mesh, MeshSpec):
            self.mesh = mesh
        elif hasattr(mesh, "mesh_dim_names"):
            self.mesh = MeshSpec.from_device_mesh(mesh)
            self._device_mesh = mesh
        else:
            raise TypeError(f"mesh must be a MeshSpec or a DeviceMesh; got {type(mesh).__name__}")
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"topology must be a Topology; got {type(topology).__name__}")
        self.topology = topology
        self.device = device
        # Every process group the plan creates waits at most this long in a collective.
        self.timeout = as_timeout(DEFAULT_TIMEOUT_S if timeout is None else timeout)
        self.plugins: list[Plugin] = []
        self._caller: HookCaller | None = None
        self.applied: list[AppliedStep] = []
        # What the last apply left: plugins' own results by key (TP's resolved plan, a
        # loader's report), the FSDP modules made, and the comm hooks installed.
        self.notes: dict[str, Any] = {}
        self.data_parallel_modules: list[nn.Module] = []
        self.installed_comm_hooks: list[InstalledCommHook] = []
        # This rank's pipeline stages after apply, when a plugin split the model.
        self.pipeline: Pipeline | None = None

    def use(self, plugin: Plugin) -> ParallelPlan:
        """Add a plugin; returns the plan so calls chain."""
        if not isinstance(plugin, Plugin):
            raise TypeError(
                f"use() takes a Plugin instance; got {plugin!r}"
                + (" (a class: call it, e.g. FSDP2())" if isinstance(plugin, type) else "")
            )
        self.plugins.append(plugin)
        return self

    def share_hooks(self, other: ParallelPlan) -> None:
        """Call hooks through ``other``'s caller (:meth:`HookCaller.for_plan`) instead of
        building one: ``other`` holds these very plugin objects, in this order."""
        if [id(p) for p in other.plugins] != [id(p) for p in self.plugins]:
            raise ValueError("share_hooks: the plans hold different plugin objects")
        self._caller = other.hooks.for_plan(self)

    @property
    def hooks(self) -> HookCaller:
        """The plan's one hook caller: built on first use, again only when the plugins
        change. Raises HookError when a plugin implements a hook wrongly."""
        caller = self._caller
        if caller is None or len(caller.plugins) != len(self.plugins) or any(
            a is not b for a, b in zip(caller.plugins, self.plugins, strict=True)
        ):
            self._caller = None
            caller = HookCaller(self.plugins)
            caller.plan = PlanView(self, caller)
            self._caller = caller
        return caller

    @property
    def view(self) -> PlanView:
        """The read-only view of this plan that hooks receive as ``plan``."""
        view = self.hooks.plan
        assert view is not None
        return view

    def __repr__(self) -> str:
        inner = ", ".join(repr(p) for p in self.plugins)
        return f"ParallelPlan({self.mesh!r}, plugins=[{inner}])"

    # -- what the plan runs on -------------------------------------------------------

    def device_mesh(self, world_size: int | None = None, device_type: str | None = None
                    ) -> DeviceMesh:
        """The plan's DeviceMesh on the live process group: the one it was given or built
        by an earlier call, else built now (with the plan's timeout) and kept, so that
        every later apply shards over it. For code that needs the mesh before apply (a
        trainer's strategy or accelerator): it and the plan then share one set of process
        groups. Raises MeshError if a kept mesh has another number of ranks than
        ``world_size``."""
        if self._device_mesh is not None:
            size = int(self._device_mesh.size())
            if world_size is not None and size != world_size:
                raise MeshError(f"the plan's DeviceMesh has {size} ranks but {world_size} "
                                "were asked for")
            return self._device_mesh
        world = world_size if world_size is not None else self.world_size() or 1
        self.check_allocation()
        self._device_mesh = self.launch_mesh().resolve(world).build(
            device_type, timeout=as_timeout(self.timeout))
        return self._device_mesh

    def world_size(self) -> int | None:
        """The number of ranks, if anything says it (mesh, process group, topology)."""
        if self._device_mesh is not None:
            return int(self._device_mesh.size())
        # Only ask torch if the caller already imported it: the static path must not.
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
        topology = self.effective_topology()
        if topology is not None:
            return topology.world_size
        launch = self.launch_mesh()
        return launch.world_size if launch.is_resolved else None

    def effective_topology(self) -> Topology | None:
        return self.topology if self.topology is not None else Topology.from_env()

    def _allocation(self) -> tuple[Allocation | None, Topology | None, list[Finding]]:
        """The job's allocation, the layout it was written for, and the finding of an
        environment whose variables contradict each other (then no allocation)."""
        wanted = wanted_topology(self.topology)
        try:
            return read_allocation(), wanted, []
        except AllocationConflict as exc:
            return None, wanted, [exc.finding]

    def allocation_report(self) -> Report:
        """What this process's environment says of the job's allocation against the
        layout the plan asks for (CP306-CP309; empty outside a launcher, or when they
        agree). See :mod:`composer_par.allocation`."""
        report, _, _ = self._check(None, None, at_start=True)
        return Report.of(f for f in report.findings if f.code in ALLOCATION_CODES)

    def check_allocation(self) -> None:
        """Refuse (PlanError) a job whose allocation is not the layout the plan asks for,
        or whose launcher and scheduler disagree about it (CP306, CP308, CP309); the
        start of :meth:`apply` and of :meth:`device_mesh` do the same before a mesh is
        built."""
        report = self.allocation_report()
        if not report.ok:
            raise PlanError(Report.of(report.errors))

    def job_topology(self, mesh: MeshSpec | None = None) -> Topology | None:
        """The topology of the whole job over ``mesh`` (the plan's, resolved): one
        launch's (:meth:`effective_topology`) repeated for each coordinate of the dims
        that span launches, each launch on nodes of its own."""
        topology = self.effective_topology()
        launches = [d.dim for d in self.launch_dims()]
        if topology is None or not launches:
            return topology
        mesh = mesh if mesh is not None else self.mesh
        count = 1
        for name in launches:
            count *= mesh.size(name)
        if count < 1:  # an unresolved size
            return topology
        return attrs.evolve(topology, nodes=topology.nodes * count)

    def replicate_dims(self) -> list[str]:
        """The mesh dims plugins contribute for data-parallel replication (HSDP's)."""
        return self.hooks.replicate_dims()

    def launch_dims(self) -> list[LaunchDim]:
        """The mesh dims whose coordinates are separate launches of the plan
        (fault-tolerant replica groups), in mesh order; none when a plugin's hooks are
        broken (validation reports that)."""
        try:
            answered = {d.dim: d for d in self.hooks.launch_dims()}
        except HookError:
            return []
        return [answered[n] for n in self.mesh.names if n in answered]

    def launch_mesh(self) -> MeshSpec:
        """The mesh one launch of the plan lays out: the plan's mesh with each dim that
        spans launches (:meth:`launch_dims`) at size 1. A process's world size, rank
        coordinates and DeviceMesh are this mesh's; without launch dims it is the plan's."""
        spanning = {d.dim for d in self.launch_dims()}
        if not spanning:
            return self.mesh
        return MeshSpec.from_pairs((n, 1 if n in spanning else s) for n, s in self.mesh.dims)

    def resolved_mesh(self, world_size: int) -> MeshSpec:
        """The plan's whole mesh, a ``-1`` resolved against one launch's ``world_size``
        ranks (every launch's, without launch dims). Raises MeshError if it does not fit."""
        launch = self.launch_mesh().resolve(world_size)
        spanning = {d.dim for d in self.launch_dims()}
        if not spanning:
            return launch
        unsized = [n for n in spanning if self.mesh.size(n) == INFER]
        if unsized:
            raise MeshError(f"mesh dim {unsized[0]!r} spans launches: its size (the number "
                            "of launches) cannot be inferred from one launch's world size")
        return MeshSpec.from_pairs((n, self.mesh.size(n) if n in spanning else s)
                                   for n, s in launch.dims)

    def folded_dims(self) -> list[FoldedDim]:
        """The model-parallel mesh dims plugins ask data parallelism to fold in (context
        and expert parallelism's), in mesh order."""
        folded = {f.dim: f for f in self.hooks.folded_dims()}
        return [folded[n] for n in self.mesh.names if n in folded]

    def data_parallel_dims(self) -> list[str]:
        """Mesh dims over which ranks read different samples (sharded or replicated data
        parallelism, and folded dims whose ranks read their own samples, as expert
        parallelism's), outermost first. Ranks that differ only in other (model-parallel)
        mesh dims read the same samples."""
        dims = {c.dim for d in self.hooks.declarations() for c in d.claims
                if c.role in (Role.SHARD, Role.REPLICATE)}
        dims |= {f.dim for f in self.hooks.folded_dims() if f.distinct_samples}
        return [n for n in self.mesh.names if n in dims]

    def averaged_dims(self) -> list[str]:
        """Mesh dims over which gradients are averaged: the data-parallel dims and the
        folded ones (model-parallel dims whose ranks hold their own samples or their own
        parts of the same samples), outermost first."""
        dims = set(self.data_parallel_dims()) | {f.dim for f in self.folded_dims()}
        return [n for n in self.mesh.names if n in dims]

    def data_shard(self, rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
        """``(shard_index, num_shards)`` of the data this rank reads: the ``rank`` and
        ``num_replicas`` to give ``DistributedSampler``. Pure arithmetic, no collectives."""
        world = world_size if world_size is not None else (self.world_size() or 1)
        if rank is None:
            dist = sys.modules.get("torch.distributed")
            rank = dist.get_rank() if dist is not None and dist.is_initialized() else 0
        mesh = self.launch_mesh().resolve(world)
        coord = mesh.coordinate(rank)
        # A dim that spans launches counts with this launch's coordinate along it.
        launches = {d.dim: d for d in self.launch_dims()}
        index, count = 0, 1
        for name in self.data_parallel_dims():
            size, at = mesh.size(name), coord[name]
            if name in launches:
                launch = launches[name].index
                if launch is None:
                    raise MeshError(f"mesh dim {name!r} spans launches, and this process's "
                                    f"coordinate along it is not known: give the plugin "
                                    f"that owns the launches this launch's index")
                size, at = self.mesh.size(name), launch
            index = index * size + at
            count *= size
        return index, count

    def plugin(self, name: str) -> Plugin | None:
        return next((p for p in self.plugins if p.name == name), None)

    # -- validation -------------------------------------------------------------------

    def validate(self, model: nn.Module | None = None, *, world_size: int | None = None) -> Report:
        """Every finding about the plan (and the model, if given). Mutates nothing."""
        return self._check(model, world_size)[0]

    def _check(
        self, model: nn.Module | None, world_size: int | None, *, at_start: bool = False
    ) -> tuple[Report, HookCaller | None, list[Block]]:
        """The report, and the hooks and blocks it was made with (apply reuses them).

        ``at_start``: in the job, about to build the mesh: the allocation the job got is
        read from its environment and checked against the layout the plan asks for
        (:mod:`composer_par.allocation`); a plan that asks for none is checked on the
        job's own layout."""
        world = world_size if world_size is not None else self.world_size()
        allocation, wanted, found = self._allocation() if at_start else (None, None, [])
        if wanted is not None:
            topology: Topology | None = wanted
        elif allocation is not None:
            topology = allocation.topology()
        else:
            topology = None if found else self.effective_topology()
        launch = self.launch_mesh()
        findings = found + mesh_rules(launch, world, topology,
                                      [d.dim for d in self.launch_dims()])
        try:
            hooks = self.hooks
        except HookError as exc:
            # Without the plugins' hooks nothing else can be asked: report what the core
            # could check, and the broken plugin.
            findings.append(Finding(
                "CP211", str(exc), plugin=exc.plugin,
                fix="name the method after a hook in composer_par.plugin.hookspecs, with argument "
                "names from that hook's signature",
            ))
            return Report.of(findings), None, []
        mesh = self.mesh
        if world is not None and launch.check_world_size(world) is None:
            with contextlib.suppress(MeshError):  # a launch dim of size -1: its plugin says
                mesh = self.resolved_mesh(world)
                launch = launch.resolve(world)
        decls = hooks.declarations()
        block_specs = hooks.block_specs()
        materializers = [hooks.name_of(p) for p in hooks.implementers(Stage.MATERIALIZE)]
        findings += claim_rules(mesh, decls)
        splitters = [hooks.name_of(p) for p in hooks.implementers(Stage.PIPELINE_SPLIT)]
        if len(splitters) > 1:
            findings.append(Finding(
                "CP207", f"{' and '.join(splitters)} each split the model into pipeline "
                "stages (stage pipeline_split): a plan has one pipeline",
                fix=f"keep one of {', '.join(splitters)}"))
        findings += plugin_rules(materializers, decls, block_specs)
        folded = [f.dim for f in hooks.folded_dims()]
        # The topology is one launch's: which dims cross its nodes.
        findings += topology_rules(launch, topology, decls, folded)
        findings += comm_hook_rules(mesh, decls, hooks.comm_hooks())
        findings += hooks.validate_plan(mesh, topology)
        if allocation is not None:
            findings += allocation_findings(
                launch, wanted, allocation,
                lambda t: [*topology_rules(launch, t, decls, folded),
                           *hooks.validate_plan(mesh, t)])
        blocks: list[Block] = []
        if model is not None:
            spec = block_specs[0][1] if block_specs else None
            blocks = find_blocks(model, spec)
            findings += model_rules(model, blocks, decls, materializers, spec)
            findings += hooks.validate_model(model, blocks, mesh)
        return Report.of(findings), hooks, blocks

    # -- apply ------------------------------------------------------------------------

    def apply(self, model: nn.Module) -> nn.Module:
        """Validate, then run every stage in order. Raises PlanError, touching nothing."""
        report, hooks, blocks = self._check(model, None, at_start=True)
        if not report.ok or hooks is None:
            raise PlanError(report)
        for finding in report.warnings:
            log.warning("plan warning", code=finding.code, message=finding.message,
                        fix=finding.fix, plugin=finding.plugin)
        ctx = self._context(model, hooks, blocks)
        contexts = [ctx]
        for stage in STAGES:
            for each in contexts:
                self._run_stage(each, stage)
            if stage is Stage.PIPELINE_SPLIT and ctx.pipeline is not None:
                # Every later stage acts on each local pipeline stage: its own model and
                # blocks, everything else (applied steps, notes, FSDP modules) shared.
                contexts = [attrs.evolve(ctx, model=part.module, blocks=part.blocks)
                            for part in ctx.pipeline.parts]
        check_installed(ctx, hooks.comm_hooks())
        self._log_layout(ctx)
        self.applied, self.notes = ctx.applied, ctx.notes
        self.data_parallel_modules = ctx.data_parallel_modules
        self.installed_comm_hooks = ctx.installed_comm_hooks
        self.pipeline = ctx.pipeline
        if ctx.data_parallel_modules:
            from composer_par.guard import guard_optimizers

            # An optimizer built after a forward fails to step; with a pipeline the
            # forwards run on the parts.
            for each in contexts:
                guard_optimizers(each.model)
        return ctx.model

    def training_step(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], *,
                      check_replicas_every: int | None = REPLICA_CHECK_EVERY,
                      accumulate: int = 1, sync: str = "last",
                      items: Callable[[Any], Any] | None = None) -> TrainingStep:
        """The one training loop for every plan: ``step(inputs, targets)`` runs forward,
        loss and backward (through the pipeline schedule when the plan has one) and
        returns the global-batch mean loss; ``clip_grad_norm_`` clips across meshes and
        pipeline stages. ``model`` is what :meth:`apply` returned; ``loss_fn(outputs,
        targets)`` gives the mean loss of a batch; every ``check_replicas_every``-th step
        (the first included; by default every :data:`composer_par.replicas.EVERY`-th,
        ``None`` to opt out) checks that replicated parameters are equal on every rank
        holding them;
        ``accumulate=k`` runs each step as ``k`` microbatches, gradients reduced as
        ``sync`` says (``"last"``: once per step, unsharded gradients held between
        microbatches; ``"reduce_scatter"``: reduce-scatter per microbatch, replicate
        all-reduce once per step; ``"every"``: per microbatch; with a pipeline, ``k``
        times the schedule's microbatches in one pass, ``"last"`` only); ``items=count``:
        ``loss_fn`` returns the sum over its batch, ``count(targets)`` how many items it
        is over, and the step's loss is the mean over every item of the global batch
        (:mod:`composer_par.item_mean`). See :mod:`composer_par.training`."""
        from composer_par.training import TrainingStep

        return TrainingStep(self, model, loss_fn, check_replicas_every=check_replicas_every,
                            accumulate=accumulate, sync=sync, items=items)

    def _context(self, model: nn.Module, hooks: HookCaller, blocks: list[Block]
                 ) -> ApplyContext:
        import torch

        world = self.world_size() or 1
        mesh = self.launch_mesh().resolve(world)
        device_mesh = self._device_mesh
        if device_mesh is None and world > 1:
            device_mesh = mesh.build(timeout=as_timeout(self.timeout))
        elif device_mesh is None and "torch.distributed" in sys.modules:
            import torch.distributed as dist

            if dist.is_initialized() and mesh.dims:
                device_mesh = mesh.build(timeout=as_timeout(self.timeout))
        if self.device is not None:
            device = torch.device(self.device)
        elif (device_mesh.device_type == "cuda" if device_mesh is not None
              else torch.cuda.is_available()):
            # One process with no mesh takes the GPU a mesh would (mesh.build's default).
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        return ApplyContext(self.view, mesh, device_mesh, device, model, list(blocks), hooks)

    def _run_stage(self, ctx: ApplyContext, stage: Stage) -> None:
        """One stage through pluggy; one applied step (and log event) per plugin."""
        # A stage after the split acts on one pipeline stage: the detail says which.
        part = next((p.stage for p in ctx.pipeline.parts if p.module is ctx.model), None
                    ) if ctx.pipeline is not None else None
        for call in ctx.hooks.call_stage(stage, ctx):
            detail = stage.label if call.answer is None else str(call.answer)
            if part is not None:
                detail = f"pipeline stage {part}: {detail}"
            ctx.applied.append(AppliedStep(stage.label, call.plugin.name, detail))
            log.info("applied", stage=stage.label, plugin=call.plugin.name, detail=detail,
                     seconds=round(call.seconds, 4))

    def _log_layout(self, ctx: ApplyContext) -> None:
        for name in ctx.mesh.names:
            log.info("mesh dim", dim=name, size=ctx.mesh.size(name),
                     rank_groups=[list(g) for g in ctx.mesh.rank_groups(name)])
        if ctx.device_mesh is not None:
            from composer_par.logging import bind_mesh_coordinate

            bind_mesh_coordinate(ctx.mesh.coordinate(ctx.rank))

    # -- explain ----------------------------------------------------------------------

    def explain(self, *, world_size: int | None = None) -> Explanation:
        """The ordered steps each plugin will take and the rank groups of each mesh dim."""
        hooks = self.hooks
        world = world_size if world_size is not None else self.world_size()
        mesh = self.mesh
        if world is not None and self.launch_mesh().check_world_size(world) is None:
            with contextlib.suppress(MeshError):
                mesh = self.resolved_mesh(world)
        labels = [s.label for s in STAGES]
        steps = sorted(
            ((stage, p.name, text) for p, stage, text in hooks.describe()),
            key=lambda s: labels.index(s[0]) if s[0] in labels else len(labels),
        )
        topology = self.job_topology(mesh)
        groups: dict[str, list[tuple[int, ...]]] = {}
        crossing: dict[str, bool] = {}
        timelines: tuple[Timeline, ...] = ()
        if mesh.is_resolved:
            for name in mesh.names:
                groups[name] = mesh.rank_groups(name)
                if topology is not None and topology.world_size == mesh.world_size:
                    crossing[name] = topology.crosses_nodes(mesh, name)
            timelines = tuple(t for _, t in hooks.answers("composer_par_timeline", mesh=mesh))
        return Explanation(mesh, topology, tuple(steps), groups, crossing, timelines)

    # -- plan files -------------------------------------------------------------------

    @classmethod
    def from_toml(
        cls, source: str | Path, *, registry: Registry | None = None
    ) -> ParallelPlan:
        """A plan from TOML text or a ``.toml`` path; raises PlanFileError on bad input."""
        from composer_par.planfile import read_plan

        return cls.from_parts(read_plan(source, registry=registry))

    @classmethod
    def from_parts(cls, parts: PlanParts) -> ParallelPlan:
        """A plan from what a plan file says (:func:`composer_par.planfile.parts_from_data`)."""
        plan = cls(parts.mesh, topology=parts.topology, timeout=parts.timeout)
        for plugin in parts.plugins:
            plan.use(plugin)
        return plan

    def to_toml(self) -> str:
        from composer_par.planfile import dump_plan

        return dump_plan(self)

    def block_spec(self) -> BlockSpec | None:
        specs = self.hooks.block_specs()
        return specs[0][1] if specs else None


@attrs.frozen
class Explanation:
    mesh: MeshSpec
    topology: Topology | None
    steps: tuple[tuple[str, str, str], ...]  # (stage, plugin, what it does)
    groups: dict[str, list[tuple[int, ...]]]
    crossing: dict[str, bool]
    # What plugins' runtimes do tick by tick (a pipeline schedule), when they say.
    timelines: tuple[Timeline, ...] = ()

    def format(self) -> str:
        lines = [f"mesh: {self.mesh.equation()}"]
        if self.topology is not None:
            lines.append(f"topology: {self.topology.describe()}")
        lines.append("steps, in apply order:")
        for i, (stage, plugin, text) in enumerate(self.steps, 1):
            lines.append(f"  {i}. [{stage}] {plugin}: {text}")
        if self.groups:
            lines.append("rank groups per mesh dim:")
        for name, groups in self.groups.items():
            where = ""
            if name in self.crossing:
                where = " (crosses nodes)" if self.crossing[name] else " (inside a node)"
            shown = " ".join(str(list(g)) for g in groups[:8])
            more = f" ... +{len(groups) - 8} more" if len(groups) > 8 else ""
            lines.append(f"  {name}({self.mesh.size(name)}){where}: {shown}{more}")
        if self.timelines:
            from composer_par.tools.draw import render_timeline_text

            lines.extend(render_timeline_text(t) for t in self.timelines)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    def to_dict(self) -> dict[str, Any]:
        return {
            "mesh": self.mesh.to_dict(),
            "topology": self.topology.to_dict() if self.topology else None,
            "steps": [{"stage": s, "plugin": p, "action": t} for s, p, t in self.steps],
            "rank_groups": {n: [list(g) for g in gs] for n, gs in self.groups.items()},
            "crosses_nodes": self.crossing,
            "timelines": [t.to_dict() for t in self.timelines],
        }


__all__ = ["Explanation", "MeshError", "ParallelPlan", "PlanError"]
