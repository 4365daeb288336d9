"""The mesh as the estimator sees it: each mesh dim's size, role, owning plugin and the
nodes its groups span, with the settings that change the estimate (which the plugins
state through the ``composer_par_estimate_settings`` hook, so that one plugin's terms
can follow how another runs without reading its options)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.estimate.errors import EstimateError
from composer_par.estimate.units import compute_dtype, optional_dtype
from composer_par.mesh import MeshError, MeshSpec
from composer_par.plugin.base import EstimateSettings, Role
from composer_par.topology import Topology

if TYPE_CHECKING:
    from composer_par.estimate.workload import Workload
    from composer_par.plan import ParallelPlan

# What a checkpointed block's recomputation issues again (EstimateSettings'
# checkpoint_reissue): nothing, its collectives up to the last tensor backward needs, all.
REISSUE = ("none", "early_stop", "all")


@attrs.frozen
class DimInfo:
    """One mesh dim as the estimator sees it."""

    name: str
    size: int
    role: Role | None
    plugin: str | None
    nodes: int  # nodes its widest group spans (1 without a topology)
    known: bool  # whether a topology says where it lies

    @property
    def crosses_nodes(self) -> bool | None:
        return self.nodes > 1 if self.known else None


@attrs.frozen
class Layout:
    """The mesh with a role for each mesh dim, and the options that change the estimate."""

    mesh: MeshSpec
    topology: Topology | None
    dims: tuple[DimInfo, ...]
    reshard_after_forward: bool | int | None = None
    param_dtype: str | None = None  # the data-parallel plugin's mixed precision
    reduce_dtype: str | None = None
    sequence_parallel: bool = False
    loss_parallel: bool = False
    sequence_split: int = 1  # tokens per rank are seq / this (context parallelism)
    # The dtype the model's matrix multiplications compute in, when a plugin changes it
    # (float8 training); None: the parameters' dtype.
    matmul_dtype: str | None = None
    # Model-parallel dims data parallelism folds in (composer_par_folded_dims): they split
    # no tensor, and a sharding plugin shards over them too; ``distinct_sample_dims``:
    # those of them whose ranks read different samples.
    folded_dims: tuple[str, ...] = ()
    distinct_sample_dims: tuple[str, ...] = ()
    activation_checkpoint: str | None = None
    checkpoint_every: int = 1
    checkpoint_reissue: str | None = None  # see EstimateSettings; None: the mode's default
    # Selective checkpointing saves the outputs of every N-th matmul of a block (1: all).
    checkpoint_matmul_every: int = 1
    # ... and the attention kernel's outputs (see EstimateSettings).
    checkpoint_saves_attention: bool = False
    # ... and the collectives' outputs (see EstimateSettings).
    checkpoint_saves_collectives: bool = True
    # The mesh dim a plugin cuts the model into pipeline stages along (set by the
    # estimator once the plugin stated its pipeline): the plugins are then asked for each
    # stage's terms, and their whole-model answer serves the report only.
    pipeline_dim: str | None = None
    plugins: tuple[str, ...] = ()

    @classmethod
    def build(
        cls, mesh: MeshSpec, topology: Topology | None, roles: Mapping[str, Role],
        owners: Mapping[str, str] | None = None, **options: Any,
    ) -> Layout:
        """A layout from a resolved mesh and ``{dim: role}`` (what :func:`suggest` builds)."""
        if not mesh.is_resolved:
            raise EstimateError(f"{mesh.equation()}: give the world size to resolve the mesh")
        known = topology is not None and topology.world_size == mesh.world_size
        dims = []
        for name, size in mesh.dims:
            nodes = topology.nodes_spanned(mesh, name) if known and topology else 1
            dims.append(DimInfo(name, size, roles.get(name), (owners or {}).get(name), nodes,
                                known))
        return cls(mesh, topology if known else None, tuple(dims), **options)

    @classmethod
    def from_plan(cls, plan: ParallelPlan, world_size: int | None = None) -> Layout:
        """The layout a plan makes: roles from the plugins' claims, the settings from the
        plugins' answers to ``composer_par_estimate_settings`` (merged in plan order),
        activation checkpointing else from a declared ``checkpointing`` policy."""
        world = world_size if world_size is not None else plan.world_size()
        if world is None:
            raise EstimateError(f"{plan.mesh.equation()}: the world size is unknown; give "
                                "--world-size or --nodes/--devices-per-node")
        # The world size is one launch's (every process's, without launch dims).
        problem = plan.launch_mesh().check_world_size(world)
        if problem:
            spanning = [d.dim for d in plan.launch_dims()]
            if spanning:
                problem += (f" ({', '.join(spanning)}: separate launches; the world size is "
                            "one launch's)")
            raise EstimateError(problem)
        try:
            mesh = plan.resolved_mesh(world)
        except MeshError as exc:
            raise EstimateError(str(exc)) from None
        hooks = plan.hooks
        roles: dict[str, Role] = {}
        owners: dict[str, str] = {}
        declarations = hooks.declarations()
        for decl in declarations:
            for claim in decl.claims:
                if claim.dim in mesh and claim.dim not in roles:
                    roles[claim.dim] = claim.role
                    owners[claim.dim] = decl.plugin
        names = dict.fromkeys(hooks.name_of(p) for p in plan.plugins)
        options: dict[str, Any] = {"plugins": tuple(names)}
        policies = [d.checkpointing for d in declarations if d.checkpointing]
        if policies:
            options["activation_checkpoint"] = _policy(policies[-1])
        folded = plan.folded_dims()
        options["folded_dims"] = tuple(f.dim for f in folded)
        options["distinct_sample_dims"] = tuple(f.dim for f in folded if f.distinct_samples)
        options.update(merge_settings(hooks.estimate_settings()))
        return cls.build(mesh, plan.job_topology(mesh), roles, owners, **options)

    def reissue(self, mode: str) -> str:
        """What checkpointing ``mode`` issues again in backward: the plan's answer when
        the mode is the plan's own, else the mode's default (full: up to the last tensor
        backward needs; selective: nothing, its collective outputs saved)."""
        if mode == "none":
            return "none"
        if self.checkpoint_reissue is not None and mode == self.activation_checkpoint:
            return self.checkpoint_reissue
        return "early_stop" if mode == "full" else "none"

    def reissued_blocks(self, mode: str, blocks: int) -> int:
        """Of ``blocks`` blocks, those whose checkpointed recomputation in backward
        issues their forward's collectives again under checkpointing ``mode`` (every
        ``checkpoint_every``-th, unless :meth:`reissue` says nothing is issued)."""
        return blocks // self.checkpoint_every if self.reissue(mode) != "none" else 0

    def dims_with(self, role: Role) -> list[DimInfo]:
        """The mesh dims of size > 1 whose owner claims them with ``role``."""
        return [d for d in self.dims if d.role is role and d.size > 1]

    def claimed(self, role: Role) -> list[DimInfo]:
        """The mesh dims claimed with ``role``, of any size (a size-1 shard dim still
        shards over the dims data parallelism folds in)."""
        return [d for d in self.dims if d.role is role]

    def dim(self, name: str) -> DimInfo:
        """The mesh dim named ``name``."""
        for d in self.dims:
            if d.name == name:
                return d
        raise EstimateError(f"no mesh dim {name!r} in {self.mesh.equation()}")

    def size_of(self, role: Role) -> int:
        return math.prod(d.size for d in self.dims_with(role))

    def tensor_parallel_size(self) -> int:
        """The ranks each split tensor is cut over: the model-parallel dims not folded
        into data parallelism."""
        return math.prod(d.size for d in self.dims_with(Role.MODEL_PARALLEL)
                         if d.name not in self.folded_dims)

    def shard_size(self, without: tuple[str, ...] = ()) -> int:
        """The ranks a sharded parameter is cut over: the shard dims (of any size) and,
        with any, the folded dims (less ``without``: a group sharded apart)."""
        shards = self.claimed(Role.SHARD)
        if not shards:
            return 1
        folded = math.prod(d.size for d in self.dims
                           if d.name in self.folded_dims and d.name not in without)
        return math.prod(d.size for d in shards) * folded

    def data_shards(self) -> int:
        """The ranks that read different samples: the data-parallel dims and the folded
        dims whose ranks read their own samples."""
        dims = [d for d in self.dims if d.role in (Role.SHARD, Role.REPLICATE)
                or d.name in self.distinct_sample_dims]
        return math.prod(d.size for d in dims)

    def data_parallel_group(self, dim: DimInfo, without: tuple[str, ...] = ()
                            ) -> tuple[int, int | None]:
        """(ranks, nodes spanned) of the group data parallelism runs its collectives over
        on ``dim``: the folded dims flattened in (FSDP2's ``dp_shard x cp``; a replicate
        dim's only when no shard dim takes them, as HSDP alone), less ``without`` (a group
        sharded apart), else the dim's own group (nodes None: the dim's)."""
        folded = [d.name for d in self.dims if d.name in self.folded_dims and d.size > 1
                  and d.name not in without]
        takes = dim.role is Role.SHARD or (dim.role is Role.REPLICATE
                                           and not self.claimed(Role.SHARD))
        if not folded or not takes:
            return dim.size, None
        names = (dim.name, *folded)
        size = math.prod(self.mesh.size(n) for n in names)
        return size, nodes_spanned_by(self, names)

    def describe(self) -> str:
        return self.mesh.equation() + (f" on {self.topology.describe()}" if self.topology else "")


def _policy(name: str) -> str:
    # A plugin's own policy names ("selective_matmul", "offload_full") map onto the
    # estimator's three.
    name = str(name).lower()
    if name == "none":
        return "none"
    return "selective" if "selective" in name else "full"


def merge_settings(answers: list[tuple[str, Any]]) -> dict[str, Any]:
    """Layout fields from ``(plugin, EstimateSettings)`` answers in plan order: a later
    answer's set fields over an earlier one's. A wrong answer is an EstimateError."""
    merged: dict[str, Any] = {}
    for who, answer in answers:
        if not isinstance(answer, EstimateSettings):
            raise EstimateError(f"plugin {who!r}: composer_par_estimate_settings must return "
                                f"EstimateSettings or None; got {type(answer).__name__}")
        fields = answer.set_fields()
        try:
            for key in ("param_dtype", "reduce_dtype"):
                if key in fields:
                    fields[key] = optional_dtype(fields[key])
            if "matmul_dtype" in fields:
                fields["matmul_dtype"] = compute_dtype(fields["matmul_dtype"])
            if "activation_checkpoint" in fields:
                fields["activation_checkpoint"] = _policy(fields["activation_checkpoint"])
            reissue = fields.get("checkpoint_reissue")
            if reissue is not None and reissue not in REISSUE:
                raise EstimateError(f"checkpoint_reissue must be one of {list(REISSUE)}; got "
                                    f"{reissue!r}")
            for key in ("sequence_split", "checkpoint_every", "checkpoint_matmul_every"):
                value = fields.get(key)
                if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                          or value < 1):
                    raise EstimateError(f"{key} must be an int >= 1; got {value!r}")
        except EstimateError as exc:
            raise EstimateError(f"plugin {who!r}: composer_par_estimate_settings: {exc}"
                                ) from None
        for key in ("sequence_parallel", "loss_parallel", "checkpoint_saves_attention",
                    "checkpoint_saves_collectives"):
            if key in fields:
                fields[key] = bool(fields[key])
        merged.update(fields)
    return merged


def local_workload(layout: Layout, workload: Workload) -> Workload:
    """``workload`` as one rank's activations see it: a context-parallel rank holds
    ``seq / sequence_split`` tokens of every sequence."""
    if layout.sequence_split == 1:
        return workload
    return attrs.evolve(workload, seq=workload.seq // layout.sequence_split)


def run_nodes(layout: Layout, dim: str, run: int) -> int:
    """Nodes spanned by runs of ``run`` consecutive members of each group of ``dim`` (the
    sub-groups a sharding plugin regroups to, as FSDP2's post-forward groups)."""
    if layout.topology is None:
        return 1
    widest = 1
    for group in layout.topology.node_patterns(layout.mesh, (dim,)):
        for i in range(0, len(group), run):
            widest = max(widest, len({layout.topology.node_of(r) for r in group[i:i + run]}))
    return widest


def nodes_spanned_by(layout: Layout, names: tuple[str, ...]) -> int:
    """Nodes spanned by the widest group of the mesh dims ``names`` flattened together
    (the ranks that differ only on them)."""
    if layout.topology is None:
        return 1
    return layout.topology.nodes_spanned(layout.mesh, *names)
