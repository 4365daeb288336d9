"""EP: expert parallelism over the ``ep`` mesh dim.

Each ep rank holds ``num_experts / ep`` whole experts of every experts module (its
parameters become DTensors ``Shard(0)`` over ep, so checkpoints and ``full_tensor()`` see
whole expert tensors). The model's router runs untouched; the experts module's forward
becomes: the routed (token, slot) pairs to the ranks of their experts by
``all_to_all_single`` with uneven splits, the module's own forward on the local experts,
the results back by all-to-all, combined with the router weights. Dropless.

The dense parameters are equal on every ep rank, and each ep rank reads its own samples:
EP answers ``composer_par_folded_dims`` with its dim, so data parallelism folds it in.
With no data-parallel plugin in the plan, EP itself averages the dense gradients over
ep and divides the experts' (which sum every shard's tokens) by the ep size.

With ``expert_tp``, each expert is also split over the tp mesh dim (expert tensor
parallelism): gate and up column-wise, down row-wise, the partial outputs summed over tp.

Modules: ``discovery`` (which modules are experts, no torch), ``findings`` (the rule
catalog and checks, no torch), ``expert_tp`` (how an expert splits over tp, no torch),
``dispatch`` (the all-to-all forward) and ``apply`` (the changes to the model). The
plugin class is here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from composer_par.plugin import (
    OVERLAP_MARKS,
    Claim,
    CodeRange,
    EstimatePart,
    Finding,
    FoldedDim,
    OptionError,
    Plugin,
    Role,
    Rule,
    ShardApart,
    average_gradients,
    dim_option,
    expert_parallel_plan,
    has_data_parallel,
    hookimpl,
    ordering_option,
)

from .discovery import ExpertsSite, experts_site, find_experts
from .findings import (
    RULES,
    capacity_finding,
    crossing_finding,
    divisibility_findings,
    expert_tp_findings,
    no_experts_finding,
)

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.plugin import ApplyContext, MeshSpec, PlanView


def _capacity_factor(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise OptionError(f"capacity_factor must be a number > 0, or None for dropless; "
                          f"got {value!r}")
    return float(value)


def _expert_tp(value: Any) -> str | None:
    if value is None or value is False:
        return None
    if value is True:
        return "tp"
    if isinstance(value, str) and value.isidentifier():
        return value
    raise OptionError(f"expert_tp must be true (the tp mesh dim), a mesh dim name, or "
                      f"false; got {value!r}")


@attrs.frozen
class EP(Plugin):
    """Expert parallelism: whole experts per rank, tokens moved by all-to-all.

    Options: ``dim`` (default ``ep``); ``capacity_factor`` (None: dropless, the
    default; a number > 0: each rank sends each expert at most ``ceil(capacity_factor *
    routed pairs / num_experts)`` pairs, dropping the rest: CP804); ``expert_tp``
    (None, the default: each ep rank's experts whole on every rank of the other dims;
    ``True`` or a mesh dim name (``True`` is ``"tp"``): expert tensor parallelism, each
    expert's gate and up projections split column-wise and its down projection row-wise
    over that dim, the partial outputs summed over it: CP805, CP806); ``after`` /
    ``before``.
    """

    name: ClassVar[str] = "ep"
    # FSDP2 reads this capability (not EP's options) to know the _ep_plan is applied.
    # overlap_marks: every collective its blocks call is marked for a pipeline's overlap
    provides: ClassVar[frozenset[str]] = frozenset({"expert_parallel", OVERLAP_MARKS})
    rules: ClassVar[tuple[Rule, ...]] = RULES
    code_ranges: ClassVar[tuple[CodeRange, ...]] = (
        CodeRange("CP", 801, 819, "expert parallelism"),)

    dim: str = dim_option("ep")
    capacity_factor: float | None = attrs.field(default=None, converter=_capacity_factor)
    expert_tp: str | None = attrs.field(default=None, converter=_expert_tp)
    after: tuple[str, ...] = ordering_option()
    before: tuple[str, ...] = ordering_option()

    def claims(self) -> tuple[Claim, ...]:
        return (Claim(self.dim, Role.MODEL_PARALLEL),)

    @hookimpl
    def composer_par_validate_plan(self) -> list[Finding]:
        if self.capacity_factor is None:
            return []
        return [capacity_finding(self.capacity_factor)]

    @hookimpl
    def composer_par_folded_dims(self) -> list[FoldedDim]:
        return [FoldedDim(self.dim, distinct_samples=True)]

    @hookimpl
    def composer_par_shard_apart(self, model: nn.Module) -> list[ShardApart]:
        """The experts: a data-parallel plugin shards them over its dims without ep."""
        from .apply import dispatched_sites

        sites = dispatched_sites(model)
        if not sites:
            return []
        return [ShardApart(modules=tuple(s.module for s in sites),
                           paths=tuple(s.path for s in sites), without=(self.dim,))]

    @hookimpl
    def composer_par_estimate_shape(self, layout: Any, model: Any) -> Any:
        """Each rank's num_experts / ep experts of every MoE block, set apart from ep."""
        from .estimate import experts_apart

        size = layout.mesh.size(self.dim) if self.dim in layout.mesh else 1
        if size < 2 or not model.experts_params:
            return None
        split = (layout.mesh.size(self.expert_tp)
                 if self.expert_tp is not None and self.expert_tp in layout.mesh else 1)
        return experts_apart(model, self.dim, size, split)

    @hookimpl
    def composer_par_estimate(self, plan: PlanView, layout: Any, model: Any, workload: Any,
                              stage: Any) -> EstimatePart:
        from .estimate import estimate_part

        return estimate_part(self, layout, model, workload, stage, has_data_parallel(plan))

    @hookimpl
    def composer_par_suggest(self, model: Any, topology: Any) -> Any:
        from .suggest import suggest_axes

        return suggest_axes(self, model, topology)

    @hookimpl
    def composer_par_describe(self, plan: PlanView) -> list[tuple[str, str]]:
        size = plan.mesh.size(self.dim) if self.dim in plan.mesh else "?"
        steps = [("tensor_parallel", f"each experts module keeps num_experts / {self.dim}"
                  f"({size}) whole experts (DTensor Shard(0) over {self.dim}); tokens to "
                  "their experts' ranks and back by all-to-all ("
                  + ("dropless" if self.capacity_factor is None else
                     f"capacity factor {self.capacity_factor:g}: pairs beyond it dropped")
                  + ")" + ("" if self.expert_tp is None else
                           f"; each expert split over {self.expert_tp} (gate/up column-wise,"
                           f" down row-wise), partial outputs summed over {self.expert_tp}"))]
        if not has_data_parallel(plan):
            steps.append(("finalize", f"average the dense gradients over {self.dim}; divide "
                          f"the experts' by {self.dim}'s size"))
        return steps

    # -- model-aware validation ------------------------------------------------------

    @hookimpl
    def composer_par_validate_model(self, plan: PlanView, model: nn.Module,
                                    mesh: MeshSpec) -> list[Finding]:
        if self.dim not in mesh:
            return []  # CP203
        size = mesh.size(self.dim)
        sites = find_experts(model)
        if not sites:
            named = list(expert_parallel_plan(model))
            return [no_experts_finding(type(model).__name__, self.dim, named)]
        if size < 1:
            return []  # not known without a world size
        found = divisibility_findings(sites, size, self.dim)
        if self.expert_tp is not None:
            found += expert_tp_findings(sites, mesh, self.expert_tp)
        topology = plan.topology
        if topology is not None and size > 1:
            crossing = crossing_finding(mesh, topology, self.dim, sites)
            if crossing is not None:
                found.append(crossing)
        return found

    # -- apply -----------------------------------------------------------------------

    @hookimpl
    def composer_par_tensor_parallel(self, ctx: ApplyContext) -> str:
        from .apply import install_dispatch, shard_experts, split_experts

        size = ctx.mesh.size(self.dim)
        sites = find_experts(ctx.model)
        tp = self.expert_tp if self.expert_tp is not None and \
            ctx.mesh.size(self.expert_tp) > 1 else None
        if size == 1 and tp is None:
            return f"{self.dim}(1): every rank holds all experts of {len(sites)} module(s)"
        errors = divisibility_findings(sites, size, self.dim)
        if self.expert_tp is not None:
            errors += expert_tp_findings(sites, ctx.mesh, self.expert_tp)
        if errors:  # validate() ran already; the model changed since (a convert stage)
            raise RuntimeError("EP no longer fits the model:\n" +
                               "\n".join(f.format() for f in errors))
        mesh = ctx.submesh(self.dim)
        group = mesh.get_group()
        tp_mesh = ctx.submesh(tp) if tp is not None else None
        for site in sites:
            if tp is None:
                shard_experts(site, mesh)
            else:
                # Both dims in the mesh's order (outermost first), as DeviceMesh slices.
                dims = tuple(d for d in ctx.mesh.names if d in (self.dim, tp))
                split_experts(site, ctx.submesh(*dims), self.dim, tp)
            install_dispatch(site, group, self.capacity_factor, tp_mesh)
        ctx.notes["ep_experts"] = [(s.path, s.num_experts) for s in sites]
        from .stats import routing_summary

        # For trainers that read the routing without importing EP (the demo).
        ctx.notes["ep_routing"] = routing_summary
        if not sites:
            # A pipeline stage of dense blocks, or the embedding or head alone.
            return f"no experts module in this part: nothing to place over {self.dim}({size})"
        counts = sorted({s.num_experts for s in sites})
        return (f"{len(sites)} experts module(s) of {'/'.join(map(str, counts))} experts: "
                f"{counts[0] // size} per rank over {self.dim}({size}); token all-to-all "
                + ("(dropless)" if self.capacity_factor is None else
                   f"(capacity factor {self.capacity_factor:g})")
                + ("" if tp is None else
                   f"; each expert split over {tp}({ctx.mesh.size(tp)})"))

    @hookimpl
    def composer_par_finalize(self, ctx: ApplyContext) -> str | None:
        from .apply import dispatched_sites, divide_gradients

        size = ctx.mesh.size(self.dim)
        if size == 1 or has_data_parallel(ctx.plan):
            return None
        sites = dispatched_sites(ctx.model)
        expert_ids = {id(getattr(s.module, n)) for s in sites for n in s.names}
        experts = [p for p in ctx.model.parameters() if id(p) in expert_ids]
        dense = [p for p in ctx.model.parameters() if id(p) not in expert_ids]
        group = ctx.submesh(self.dim).get_group()
        averaged = average_gradients(dense, group)
        divided = divide_gradients(experts, size)
        return (f"no data-parallel plugin: {averaged} dense gradient(s) averaged over "
                f"{self.dim}({size}), {divided} expert gradient(s) divided by {size}")


__all__ = ["EP", "RULES", "ExpertsSite", "experts_site", "find_experts"]
