"""CP: context parallelism over the cp mesh dim. Each cp rank holds a load-balanced part
of every sequence (:mod:`.layout`) and attention runs across the cp ranks
(:mod:`.attention`), calling the model's own ``scaled_dot_product_attention``, so a plan
trains as one process does.

    plan = ParallelPlan(MeshSpec(dp_shard=2, cp=2)).use(FSDP2()).use(CP()).use(MetaInit())
    model = plan.apply(model)
    cp = context_of(model)          # also plan.notes["cp"]
    logits = model(cp.shard(tokens), cp.positions(seq_len))

Parameters are equal on every cp rank: data parallelism averages their gradients over
cp as well (with no data-parallel plugin in the plan, CP does it itself, in a hook after
each gradient is accumulated).

This package imports torch only inside functions: the static path must not. Its modules:
``layout`` (the load-balanced split and its inverse), ``comm`` (autograd-aware
collectives), ``attention`` (the two modes), ``drivable`` (which attention a model has),
``hf`` (Hugging Face's attention interface), ``ring`` (torch's ring attention, on
CUDA), ``runtime`` (what a training loop uses), ``positions`` (a forward without its
tokens' positions, or with positions not cut to the layout, refused), ``labels``
(labels a model would shift within a rank's part refused), ``findings`` (rule codes).
Without a data-parallel plugin, gradients are averaged over cp by the author package's
``average_gradients``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from composer_par.plugin import (
    Claim,
    CodeRange,
    EstimatePart,
    EstimateSettings,
    Finding,
    FoldedDim,
    Plugin,
    Role,
    Rule,
    average_gradients,
    dim_option,
    has_data_parallel,
    hookimpl,
    ordering_option,
    split_sequence,
)

from .drivable import Drivable, find_attention
from .findings import (
    RULES,
    drive_findings,
    head_findings,
    kv_bytes_per_layer,
    node_findings,
    ring_findings,
    router_loss_findings,
    sequence_findings,
)
from .layout import (
    chunks_of_rank,
    gathered_positions,
    rank_positions,
    shard_sequence,
    unshard_sequence,
)
from .runtime import ATTRIBUTE, ContextShard, context_of, next_token_labels

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.plugin import ApplyContext, MeshSpec, PlanView, Topology

MODES = ("allgather", "alltoall", "ring")


def _seq_len(instance: object, attribute: attrs.Attribute[int | None], value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise ValueError(f"seq_len must be a positive int or None; got {value!r}")


@attrs.frozen
class CP(Plugin):
    """Context parallelism over one mesh dim.

    Options: ``dim`` (default ``cp``); ``mode`` (``"allgather"``: every rank gathers each
    layer's K/V, any head count; ``"alltoall"``: Ulysses, heads traded for sequence, head
    counts divisible by cp; ``"ring"``: torch's own ring attention, CUDA only, no sliding
    windows); ``seq_len`` (the training sequence length, checked against
    cp before launch, optional); ``after`` / ``before``.
    """

    name: ClassVar[str] = "cp"
    # Each rank needs its own part of every sequence and its positions: a trainer that
    # feeds whole sequences reads this capability to refuse the plan (CP720).
    provides: ClassVar[frozenset[str]] = frozenset({"sequence_split"})
    rules: ClassVar[tuple[Rule, ...]] = RULES
    code_ranges: ClassVar[tuple[CodeRange, ...]] = (
        CodeRange("CP", 821, 839, "context parallelism"),)

    dim: str = dim_option("cp")
    mode: str = attrs.field(default="allgather", validator=attrs.validators.in_(MODES))
    seq_len: int | None = attrs.field(default=None, validator=_seq_len)
    after: tuple[str, ...] = ordering_option()
    before: tuple[str, ...] = ordering_option()

    def claims(self) -> tuple[Claim, ...]:
        return (Claim(self.dim, Role.MODEL_PARALLEL),)

    @hookimpl
    def composer_par_folded_dims(self) -> list[FoldedDim]:
        # Parameters are equal on every cp rank; the ranks read the same samples, each
        # its own part of every sequence.
        return [FoldedDim(self.dim, distinct_samples=False)]

    def _size(self, mesh: MeshSpec) -> int:
        return mesh.size(self.dim) if self.dim in mesh else 1

    # -- validation ------------------------------------------------------------------

    @hookimpl
    def composer_par_validate_plan(self, mesh: MeshSpec, topology: Topology | None
                                   ) -> list[Finding]:
        size = self._size(mesh)
        if size < 2:
            return []
        return [*sequence_findings(self.seq_len, size),
                *node_findings(self.dim, mesh, topology, self.mode, self.seq_len)]

    @hookimpl
    def composer_par_validate_model(self, plan: PlanView, model: nn.Module, mesh: MeshSpec
                                    ) -> list[Finding]:
        size = self._size(mesh)
        if size < 2:
            return []
        found = find_attention(model)
        out = drive_findings(found) + router_loss_findings(model)
        if self.mode == "alltoall":
            out += head_findings(found, size, _tp_size(plan, mesh))
        if self.mode == "ring":
            out += ring_findings(found, _cuda_where_it_runs())
        return out

    @hookimpl
    def composer_par_estimate_settings(self, plan: PlanView) -> EstimateSettings:
        size = plan.mesh.size(self.dim) if self.dim in plan.mesh else 1
        return EstimateSettings(sequence_split=size if size > 1 else None)

    @hookimpl
    def composer_par_estimate(self, layout: Any, model: Any, workload: Any,
                              stage: Any) -> EstimatePart | None:
        from .estimate import estimate_part

        return estimate_part(self.dim, self.mode, layout, model, workload, stage)

    @hookimpl
    def composer_par_suggest(self, model: Any, topology: Any, workload: Any) -> Any:
        from .suggest import suggest_axes

        return suggest_axes(self, model, topology, workload, "mode" in self.options())

    @hookimpl
    def composer_par_describe(self, plan: PlanView) -> list[tuple[str, str]]:
        size = plan.mesh.size(self.dim) if self.dim in plan.mesh else "?"
        what = {"allgather": "each layer's K/V all-gathered",
                "alltoall": "heads traded for sequence by all-to-all (Ulysses)",
                "ring": "torch's ring attention (CUDA)"}[self.mode]
        return [("tensor_parallel", f"sequence split over {self.dim}({size}), load-balanced "
                 f"(rank r holds chunks r and 2*cp-1-r); attention across ranks: {what}")]

    # -- apply -----------------------------------------------------------------------

    @hookimpl
    def composer_par_tensor_parallel(self, ctx: ApplyContext) -> str:
        size = ctx.mesh.size(self.dim)
        if size == 1:
            return f"{self.dim}(1): nothing to split"
        found = find_attention(ctx.model)
        mesh = ctx.submesh(self.dim)
        group = mesh.get_group()
        import torch.distributed as dist

        if self.mode == "ring":
            from .ring import enable_ring_attention

            enable_ring_attention(group)
        shard = ContextShard(group, size, dist.get_rank(group), self.mode, mesh)
        if found.kind == "llama":
            driven = _swap_llama_cores(ctx.model, found, shard)
        else:
            from .hf import drive_hf_attention

            driven = drive_hf_attention(ctx.model, shard)
        setattr(ctx.model, ATTRIBUTE, shard)
        from .labels import refuse_local_shift
        from .positions import require_positions

        require_positions(ctx.model, shard)
        refuse_local_shift(ctx.model)
        # Load-balancing losses of whole sequences (aux_loss.sequence_total).
        split_sequence(ctx.model, group)
        ctx.notes["cp"] = shard
        return (f"sequence split over {self.dim}({size}); {self.mode} attention in "
                f"{driven} module(s)")

    @hookimpl
    def composer_par_finalize(self, ctx: ApplyContext) -> str | None:
        if ctx.mesh.size(self.dim) == 1 or has_data_parallel(ctx.plan):
            return None
        count = average_gradients(ctx.model.parameters(), ctx.submesh(self.dim).get_group())
        return (f"no data-parallel plugin: {count} parameter gradient(s) averaged over "
                f"{self.dim} after each backward")


def _cuda_where_it_runs() -> bool | None:
    """Whether this rank has CUDA; None off the ranks (no process group: the plan is
    validated on another machine than the one it will run on)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return torch.cuda.is_available()


def _tp_size(plan: PlanView, mesh: MeshSpec) -> int:
    """The size of the model-parallel dims that split tensors (what splits heads before
    CP sees them): those claimed as model parallel that data parallelism does not fold
    in (context and expert parallelism's own dims are folded)."""
    folded = {f.dim for f in plan.folded_dims()}
    size = 1
    for decl in plan.declarations():
        for claim in decl.claims:
            if (claim.role is Role.MODEL_PARALLEL and claim.dim not in folded
                    and claim.dim in mesh and mesh.size(claim.dim) > 0):
                size *= mesh.size(claim.dim)
    return size


def _swap_llama_cores(model: nn.Module, found: Drivable, shard: ContextShard) -> int:
    from .attention import ContextAttention

    for path in found.modules:
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        parent.register_module(attr, ContextAttention(shard.group, shard.mode,
                                                      mesh=shard.mesh))
    return len(found.modules)


__all__ = [
    "CP",
    "MODES",
    "RULES",
    "ContextShard",
    "chunks_of_rank",
    "context_of",
    "gathered_positions",
    "kv_bytes_per_layer",
    "next_token_labels",
    "rank_positions",
    "shard_sequence",
    "unshard_sequence",
]
