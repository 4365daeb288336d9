"""The part of a plan a hook may read: :class:`PlanView`.

Hooks that take a ``plan`` argument get this view, not the ``ParallelPlan``: it shows the
mesh, the topology, the world size and what the plugins declared and answered, and no
plugin objects, so no plugin can read another's options. Facts pass between plugins only
through declared hook answers (claims, replicate dims, comm hooks) and the typed fields
of the apply context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datetime import timedelta

    import torch
    import torch.nn as nn

    from composer_par.mesh import MeshSpec
    from composer_par.plan import ParallelPlan
    from composer_par.plugin.base import Declaration, FoldedDim, LaunchDim, Stage
    from composer_par.plugin.caller import HookCaller
    from composer_par.plugin.comm import CommHook
    from composer_par.topology import Topology


class PlanView:
    """A read-only view of one plan, bound to the plan's hook caller."""

    __slots__ = ("_caller", "_plan")

    def __init__(self, plan: ParallelPlan, caller: HookCaller) -> None:
        self._plan = plan
        self._caller = caller

    @property
    def mesh(self) -> MeshSpec:
        """The mesh as the plan states it (a ``-1`` size may be unresolved)."""
        return self._plan.mesh

    @property
    def topology(self) -> Topology | None:
        """How ranks lie on nodes: the plan's, else torchrun's environment, else None."""
        return self._plan.effective_topology()

    @property
    def device(self) -> str | torch.device | None:
        """The materialization device the plan was given (None: the mesh's default)."""
        return self._plan.device

    @property
    def timeout(self) -> timedelta:
        """How long the plan's collectives wait before giving up (its ``timeout``)."""
        return self._plan.timeout

    def world_size(self) -> int | None:
        """The number of ranks, if anything says it (mesh, process group, topology)."""
        return self._plan.world_size()

    @property
    def plugin_names(self) -> tuple[str, ...]:
        """The names the plan's plugins declared, in the plan's order."""
        return tuple(self._caller.name_of(p) for p in self._caller.ordered())

    def stage_plugins(self, stage: Stage) -> tuple[str, ...]:
        """The names of the plugins that act in ``stage`` of the apply order, in the order
        they run there (e.g. whether anything compiles, before anything is compiled)."""
        return tuple(self._caller.name_of(p) for p in self._caller.implementers(stage))

    def declarations(self) -> list[Declaration]:
        """Every plugin's declaration (claims, capabilities, ordering, block use)."""
        return self._caller.declarations()

    def selective_checkpointing(self) -> list[Declaration]:
        """The declarations of the plugins that checkpoint the blocks selectively (any
        way but full): torch allows such a block one recompute, which must call no op
        more often than its forward did."""
        return [d for d in self.declarations() if d.checkpointing not in (None, "full")]

    def replicate_dims(self) -> list[str]:
        """The mesh dims plugins contribute for data-parallel replication (HSDP's)."""
        return self._caller.replicate_dims()

    def folded_dims(self) -> list[FoldedDim]:
        """The model-parallel dims data parallelism folds in (context and expert
        parallelism's), in mesh order."""
        return self._plan.folded_dims()

    def data_parallel_dims(self) -> list[str]:
        """Mesh dims over which ranks read different samples, outermost first."""
        return self._plan.data_parallel_dims()

    def averaged_dims(self) -> list[str]:
        """Mesh dims over which gradients are averaged (data-parallel and folded dims)."""
        return self._plan.averaged_dims()

    def launch_dims(self) -> list[LaunchDim]:
        """The mesh dims whose coordinates are separate launches (fault-tolerant replica
        groups), in mesh order."""
        return self._plan.launch_dims()

    def comm_hooks(self) -> list[CommHook]:
        """Every plugin's comm hooks, each naming the plugin that gave it."""
        return self._caller.comm_hooks()

    def state_dict_adapters(self, model: nn.Module) -> list[Any]:
        """The name-mapping adapters plugins contribute, in the plan's order."""
        return self._caller.state_dict_adapters(model)

    def __repr__(self) -> str:
        return f"PlanView({self.mesh!r}, plugins={list(self.plugin_names)})"


__all__ = ["PlanView"]
