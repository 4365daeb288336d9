"""The mesh as the estimator sees it: each mesh dim's size, role, owning plugin and the
nodes its groups span, with the plan options that change the estimate."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.estimate.errors import EstimateError
from composer_par.estimate.units import optional_dtype
from composer_par.mesh import MeshSpec
from composer_par.plugin import Role, Stage
from composer_par.topology import Topology

if TYPE_CHECKING:
    from composer_par.plan import ParallelPlan


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
    activation_checkpoint: str | None = None
    checkpoint_every: int = 1
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
        """The layout a plan makes: roles from the plugins' claims, FSDP options from the
        plugin with the shard role, sequence/loss parallel from the model-parallel one,
        activation checkpointing from the plugin that implements that stage."""
        world = world_size if world_size is not None else plan.world_size()
        if world is None:
            raise EstimateError(f"{plan.mesh.equation()}: the world size is unknown; give "
                                "--world-size or --nodes/--devices-per-node")
        problem = plan.mesh.check_world_size(world)
        if problem:
            raise EstimateError(problem)
        mesh = plan.mesh.resolve(world)
        hooks = plan.hooks
        by_name = {hooks.name_of(p): p for p in plan.plugins}
        roles: dict[str, Role] = {}
        owners: dict[str, str] = {}
        for decl in hooks.declarations():
            for claim in decl.claims:
                if claim.dim in mesh and claim.dim not in roles:
                    roles[claim.dim] = claim.role
                    owners[claim.dim] = decl.plugin
        options: dict[str, Any] = {"plugins": tuple(by_name)}
        for dim, role in roles.items():
            plugin = by_name.get(owners[dim])
            if role is Role.SHARD and plugin is not None:
                options["reshard_after_forward"] = getattr(plugin, "reshard_after_forward", None)
                mp = getattr(plugin, "mixed_precision", None)
                options["param_dtype"] = optional_dtype(getattr(mp, "param_dtype", None))
                options["reduce_dtype"] = optional_dtype(getattr(mp, "reduce_dtype", None))
            if role is Role.MODEL_PARALLEL and plugin is not None:
                options["sequence_parallel"] = bool(getattr(plugin, "sequence_parallel", False))
                options["loss_parallel"] = bool(getattr(plugin, "loss_parallel", False))
        for plugin in plan.plugins:
            if Stage.ACTIVATION_CHECKPOINT in plugin.stages():
                mode = str(getattr(plugin, "mode", "full"))
                options["activation_checkpoint"] = "selective" if "selective" in mode else "full"
                every = getattr(plugin, "every", 1)
                options["checkpoint_every"] = every if isinstance(every, int) and every > 0 else 1
        return cls.build(mesh, plan.effective_topology(), roles, owners, **options)

    def dims_with(self, role: Role) -> list[DimInfo]:
        return [d for d in self.dims if d.role is role and d.size > 1]

    def size_of(self, role: Role) -> int:
        return math.prod(d.size for d in self.dims_with(role))

    def describe(self) -> str:
        return self.mesh.equation() + (f" on {self.topology.describe()}" if self.topology else "")


def run_nodes(layout: Layout, dim: str, run: int) -> int:
    """Nodes spanned by FSDP2's post-forward groups: runs of ``run`` consecutive members
    of each group of ``dim``."""
    if layout.topology is None:
        return 1
    widest = 1
    for group in layout.mesh.rank_groups(dim):
        for i in range(0, len(group), run):
            widest = max(widest, len({layout.topology.node_of(r) for r in group[i:i + run]}))
    return widest
