"""HSDP: replicate over one mesh dim (the one that crosses nodes), shard over another.

With a plugin that shards (FSDP2), HSDP contributes its dim through the composition hook
``composer_par_replicate_dims``; FSDP2 then builds one 2-D ``fully_shard`` mesh
(replicate outer, shard inner): parameters are ``(Replicate(), Shard(0))`` DTensors,
gradients are reduce-scattered inside a replica group and all-reduced across them.

Alone, HSDP replicates the whole model DDP-style over its dim, block by block, in the
data_parallel stage. The mechanism, chosen by measurement on torch 2.13 (4 gloo ranks,
4-block Llama, see docs/hsdp.md):

* ``torch.distributed._composable.replicate_with_fsdp.replicate`` -- FSDP2's machinery
  with a replicate-only mesh (``DDPMeshInfo``): per-block gradient all-reduce (one per
  block + root, the same count as the others), no all-gathers, no copies of parameters
  into and out of an unsharded buffer, names unchanged, parameters ``(Replicate(),)``
  DTensors, the same FSDPModule API (setters, hooks, mixed precision) as FSDP2. Chosen.
* ``fully_shard`` on a 2-D mesh whose shard dim has size 1: the same collectives, but it
  needs a second (size-1) mesh dim that the user's mesh does not have, and it still runs
  FSDP's unshard/reshard copies per block.
* ``fully_shard(..., dp_mesh_dims=DataParallelMeshDims(replicate=...))``: refuses plain
  tensors (it wants every parameter already a DTensor on the full SPMD mesh).
* ``DistributedDataParallel``: a wrapper, so every name gains ``module.``.

Replicate-only together with tensor parallelism works: parameters that TP made DTensors
over the tp dim become 2-D ``(Replicate(), <tp placement>)`` DTensors over (replicate,
tp), and their gradients are all-reduced over the replicate dim only (measured at parity
on 4 gloo ranks, dp_replicate=2 x tp=2, with and without sequence parallelism, with and
without TP's ``replicate_rest``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from composer_par.plugin import (
    Claim,
    Finding,
    Plugin,
    Role,
    Rule,
    SuggestAxis,
    SuggestChoice,
    SuggestContext,
    blocks_option,
    dim_option,
    hookimpl,
    ordering_option,
    positive_number_option,
)
from composer_par.plugin.fsdp_state import (
    UNCHECKED_TORCH_RULE,
    apart_divide_factor,
    install_all_reduce,
    internals_read,
    premul_sum_supported,
    set_gradient_divide_factor,
    unchecked_torch_findings,
)

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.plugin import ApplyContext, Declaration, MeshSpec, PlanView


def _declarations(plan: PlanView) -> list[Declaration]:
    return plan.declarations()


def _claimed(decls: Iterable[Declaration], role: Role, mesh: MeshSpec) -> list[tuple[str, str]]:
    """(plugin, dim) of every claim with ``role`` on a dim the mesh has."""
    return [(d.plugin, c.dim) for d in decls for c in d.claims if c.role is role and c.dim in mesh]


@attrs.frozen
class HSDP(Plugin):
    """Hybrid sharded data parallel: the replicate half (``dp_replicate`` by default).

    Options: ``dim``; ``gradient_divide_factor`` (divide the gradients summed over all
    data-parallel ranks by this instead of their number, e.g. 1.0 when the loss is
    already normalized globally; applied to every FSDP module of the plan, FSDP2's too);
    ``blocks`` (used when HSDP replicates alone).
    """

    name: ClassVar[str] = "hsdp"
    provides: ClassVar[frozenset[str]] = frozenset({"data_parallel"})
    rules: ClassVar[tuple[Rule, ...]] = (UNCHECKED_TORCH_RULE,)

    dim: str = dim_option("dp_replicate")
    gradient_divide_factor: float | None = positive_number_option()
    blocks: str | tuple[str, ...] | None = blocks_option()
    after: tuple[str, ...] = ordering_option()
    before: tuple[str, ...] = ordering_option()

    def claims(self) -> tuple[Claim, ...]:
        return (Claim(self.dim, Role.REPLICATE),)

    # -- composition ---------------------------------------------------------------------

    @hookimpl
    def composer_par_replicate_dims(self) -> list[str]:
        return [self.dim]

    @hookimpl
    def composer_par_estimate(self, layout: Any, model: Any, workload: Any,
                              stage: Any) -> Any:
        from .hsdp_estimate import estimate_part

        return estimate_part(self, layout, model, workload, stage)

    @hookimpl
    def composer_par_suggest(self, topology: Any) -> list[SuggestAxis]:
        """Its replicate dim at every size that divides the world (outermost but a
        pipeline's, so that it is the dim crossing nodes)."""
        world = topology.world_size
        own = self.options()

        def choices(ctx: SuggestContext) -> list[SuggestChoice]:
            size = ctx.size(self.dim)
            return [SuggestChoice(f"replicate {size}", own)] if size > 1 else [SuggestChoice()]

        sizes = tuple(d for d in range(1, world + 1) if world % d == 0)
        return [SuggestAxis(self.name, self.dim, 10, sizes, choices, role=Role.REPLICATE,
                            samples=True)]

    @hookimpl
    def composer_par_describe(self, plan: PlanView) -> list[tuple[str, str]]:
        sharders = _claimed(_declarations(plan), Role.SHARD, plan.mesh)
        hooked = [h.plugin for h in plan.comm_hooks()
                  if h.dim == self.dim and h.all_reduce]
        if sharders and hooked:
            steps = [("data_parallel", f"replicate over {self.dim}: gradient all-reduce by "
                      f"{hooked[0]}'s comm hook ({sharders[0][0]} shards over "
                      f"{sharders[0][1]})")]
        elif sharders:
            steps = [("data_parallel", f"contribute {self.dim} to {sharders[0][0]}'s mesh: "
                      f"replicate over {self.dim}, shard over {sharders[0][1]}")]
        else:
            steps = [("data_parallel", f"replicate each block, then the root, over {self.dim} "
                      "(gradients all-reduced per block)")]
        if self.gradient_divide_factor is not None:
            steps.append(("finalize", f"divide gradients by {self.gradient_divide_factor:g} on "
                          "every FSDP module"))
        return steps

    @hookimpl
    def composer_par_validate_model(self, plan: PlanView, model: Any,
                                    blocks: list[Any]) -> list[Finding]:
        # Beside a sharding plugin, that plugin installs the comm hooks and shards the
        # experts apart (and says so); HSDP's own divide factor is HSDP's to report.
        alone = not _claimed(_declarations(plan), Role.SHARD, plan.mesh)
        return unchecked_torch_findings(internals_read(
            plan, [self.dim] if alone else [], self.gradient_divide_factor, apart=alone))

    # -- stages --------------------------------------------------------------------------

    @hookimpl
    def composer_par_data_parallel(self, ctx: ApplyContext) -> str:
        size = f"{self.dim}({ctx.mesh.size(self.dim)})"
        sharders = _claimed(ctx.hooks.declarations(), Role.SHARD, ctx.mesh)
        hook = ctx.comm_hooks().get(self.dim)
        if sharders:
            if hook is not None and hook.all_reduce:
                return f"replicate over {size}: all-reduce by {hook.plugin}'s comm hook"
            return f"replicate over {size} through {sharders[0][0]}'s 2-D mesh"
        from composer_par.plugin import torch_private

        replicate = torch_private.replicate()

        # Alone, HSDP also averages over the dims model-parallel plugins fold in (cp, ep).
        folded = {f.dim for f in ctx.folded_dims()}
        over = [d for d in ctx.mesh.names if d == self.dim or d in folded]
        if hook is not None and hook.all_reduce and len(over) > 1:
            # The hook reduces over its own dim only: the folded dims would go unreduced.
            raise NotImplementedError(
                f"{hook.plugin}'s all-reduce hook on {self.dim} cannot also reduce over "
                f"{', '.join(d for d in over if d != self.dim)}: add FSDP2 (it "
                "shards over those dims and leaves the hook the replicate all-reduce)")
        size = " x ".join(f"{d}({ctx.mesh.size(d)})" for d in over)
        mesh = ctx.data_parallel_mesh([], over)
        replicated: list[nn.Module] = []
        # Modules other plugins ask to keep apart (expert parallelism's experts): each
        # replicated over the dims without the answer's, before the blocks holding them;
        # their gradients already sum over those dims, so they divide by all data shards
        # (and cp ranks: apart_divide_factor).
        apart: list[nn.Module] = []
        for answer in ctx.shard_apart():
            apart_mesh = ctx.data_parallel_mesh([], [d for d in over
                                                     if d not in answer.without])
            for module in answer.modules:
                replicate(module, mesh=apart_mesh)
                apart.append(module)
        if apart:
            set_gradient_divide_factor(apart, apart_divide_factor(ctx),
                                       sum_only=not premul_sum_supported(ctx),
                                       owner=self.name)
            replicated.extend(apart)
        for _, block in ctx.blocks:
            replicate(block, mesh=mesh)
            replicated.append(block)
        replicate(ctx.model, mesh=mesh)
        replicated.append(ctx.model)
        # The same list FSDP2 keeps: these are FSDPModules too, with the same setters.
        ctx.data_parallel_modules.extend(replicated)
        if hook is not None and hook.all_reduce:
            # torch's replicate all-reduces before its all-reduce hook runs: its own
            # all-reduce goes to a 1-rank group, and the hook reduces (composer_par.plugin.comm).
            install_all_reduce(ctx, replicated, hook, owner=self.name, replace_native=True)
            return (f"replicate on {len(ctx.blocks)} block(s) + root over {size}; all-reduce "
                    f"by {hook.plugin}'s comm hook")
        return f"replicate on {len(ctx.blocks)} block(s) + root over {size}"

    @hookimpl
    def composer_par_finalize(self, ctx: ApplyContext) -> str | None:
        if self.gradient_divide_factor is None:
            return "gradients averaged over the data-parallel ranks (torch's default)"
        modules = ctx.data_parallel_modules
        sum_only = not premul_sum_supported(ctx)
        forced = set_gradient_divide_factor(modules, self.gradient_divide_factor,
                                            sum_only=sum_only, owner=self.name)
        note = f"; SUM reductions on {forced} (no PREMUL_SUM on this backend)" if forced else ""
        return (f"gradient divide factor {self.gradient_divide_factor:g} on "
                f"{len(modules)} FSDP module(s){note}")


__all__ = ["HSDP"]
