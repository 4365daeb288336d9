"""FSDP2: ``fully_shard`` each block, then the root, over the shard dim.

Replicate dims contributed by other plugins (HSDP) through the composition hook
``composer_par_replicate_dims`` make the mesh 2-D: (replicate, shard), replicate outer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

import attrs

from composer_par.plugin import (
    Claim,
    EstimateSettings,
    Finding,
    Plugin,
    Role,
    Rule,
    Severity,
    blocks_option,
    bool_option,
    dim_option,
    dtype_option,
    hookimpl,
    ordering_option,
)
from composer_par.plugin.fsdp_state import install_all_reduce, install_shard_comms

if TYPE_CHECKING:
    from composer_par.plugin import MeshSpec, PlanView, Topology
    from composer_par.plugin.context import ApplyContext

RULES = (
    Rule("CP216", Severity.WARNING, "reshard_after_forward=false under HSDP",
         "keep it if the model fits (it saves each block's all-gather in backward); else set "
         "reshard_after_forward = true, or an int divisor of the shard size",
         "[mesh]\ndp_replicate = 2\ndp_shard = 4\n\n[[plugins]]\nname = \"hsdp\"\n\n"
         "[[plugins]]\nname = \"fsdp2\"\nreshard_after_forward = false\n"),
    Rule("CP303", Severity.ERROR, "int reshard_after_forward does not divide the shard size",
         "use a divisor of the shard size (e.g. the devices per node), or true/false",
         "[mesh]\ndp_shard = 8\n\n[[plugins]]\nname = \"fsdp2\"\n"
         "reshard_after_forward = 3\n"),
    Rule("CP304", Severity.ERROR, "int reshard_after_forward regroups ranks across nodes",
         "use a divisor of the shard size whose runs of ranks fit in a node, or true/false",
         "[mesh]\ndp_replicate = 2\ndp_shard = 8\n\n[topology]\nnodes = 4\n"
         "devices_per_node = 4\n\n[[plugins]]\nname = \"hsdp\"\n\n[[plugins]]\n"
         "name = \"fsdp2\"\nreshard_after_forward = 8\n"),
    Rule("CP424", Severity.ERROR, "a block shares a parameter with a module outside it",
         "name blocks that hold both twins, or none (detected blocks leave such a module to "
         "its parent's group)",
         "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2(blocks=[\"BertEmbeddings\", "
         "\"BertLayer\"])).use(MetaInit()).validate(bert_for_masked_lm)"),
)


@attrs.frozen
class MixedPrecision:
    """FSDP2's MixedPrecisionPolicy by dtype names (so plan files can state it).

    ``output_dtype`` is applied on the root module only: set on every module, each
    block's outputs would be cast back and forth.
    """

    param_dtype: str | None = dtype_option()
    reduce_dtype: str | None = dtype_option()
    output_dtype: str | None = dtype_option()
    cast_forward_inputs: bool = bool_option(True)

    def policy(self, *, root: bool) -> Any:
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy

        def dt(name: str | None) -> Any:
            return getattr(torch, name) if name else None

        return MixedPrecisionPolicy(
            param_dtype=dt(self.param_dtype),
            reduce_dtype=dt(self.reduce_dtype),
            output_dtype=dt(self.output_dtype) if root else None,
            cast_forward_inputs=self.cast_forward_inputs,
        )


def _mixed_precision(value: Any) -> MixedPrecision | None:
    if value is None or isinstance(value, MixedPrecision):
        return value
    if isinstance(value, dict):
        return MixedPrecision(**value)
    if isinstance(value, str):  # "bf16": bf16 parameters, fp32 gradient reduction
        return MixedPrecision(param_dtype=value, reduce_dtype="float32")
    raise TypeError(f"mixed_precision must be a table of dtypes or a dtype name; got {value!r}")


def _reshard(instance: Any, attribute: Any, value: Any) -> None:
    if value is None or isinstance(value, bool):
        return
    if not isinstance(value, int) or value < 1:
        raise ValueError(
            f"reshard_after_forward must be true, false, or a positive int; got {value!r}"
        )


@attrs.frozen
class FSDP2(Plugin):
    """Fully sharded data parallel (``torch.distributed.fsdp.fully_shard``).

    Options: ``dim`` (default ``dp_shard``); ``reshard_after_forward`` (bool, an int
    world size to reshard to, or None for torch's default); ``mixed_precision``
    (:class:`MixedPrecision`, a table, or ``"bf16"``); ``offload`` (``"none"`` or
    ``"cpu"``); ``blocks`` (a module path or block class names; else detected).
    """

    name: ClassVar[str] = "fsdp2"
    provides: ClassVar[frozenset[str]] = frozenset({"data_parallel"})
    needs_blocks: ClassVar[bool] = True
    rules: ClassVar[tuple[Rule, ...]] = RULES

    dim: str = dim_option("dp_shard")
    reshard_after_forward: bool | int | None = attrs.field(default=None, validator=_reshard)
    mixed_precision: MixedPrecision | None = attrs.field(default=None, converter=_mixed_precision)
    offload: Literal["none", "cpu"] = attrs.field(
        default="none", validator=attrs.validators.in_(("none", "cpu"))
    )
    blocks: str | tuple[str, ...] | None = blocks_option()
    after: tuple[str, ...] = ordering_option()
    before: tuple[str, ...] = ordering_option()

    def claims(self) -> tuple[Claim, ...]:
        return (Claim(self.dim, Role.SHARD),)

    @hookimpl
    def composer_par_validate_plan(
        self, plan: PlanView, mesh: MeshSpec, topology: Topology | None
    ) -> list[Finding]:
        found = []
        replicated = [d for d in plan.replicate_dims() if d in mesh and d != self.dim]
        if self.reshard_after_forward is False and replicated and self.dim in mesh:
            found.append(Finding(
                "CP216",
                f"{self.name} keeps parameters unsharded from forward to backward "
                f"(reshard_after_forward=false) under HSDP (replicating over {replicated[0]}): "
                "at peak every rank holds every block's full parameters, as without sharding "
                f"over {self.dim}",
                fix="keep it if the model fits (it saves each block's all-gather in "
                "backward); else set reshard_after_forward = true, or an int divisor of "
                "the shard size",
            ))
        value = self.reshard_after_forward
        if value is None or isinstance(value, bool) or self.dim not in mesh:
            return found
        size = mesh.size(self.dim)
        if size > 0 and (size % value or value > size):
            found.append(Finding(
                "CP303",
                f"reshard_after_forward={value} does not divide the shard size "
                f"{self.dim}({size})",
                fix=f"use a divisor of {size} (e.g. the devices per node), or true/false",
            ))
        if topology is not None and mesh.is_resolved and mesh.world_size == topology.world_size:
            # After forward, each shard group keeps parameters gathered over runs of
            # `value` consecutive members; those runs must stay on one node.
            crossing = next(
                (run for group in mesh.rank_groups(self.dim)
                 for run in (group[i : i + value] for i in range(0, len(group), value))
                 if len({topology.node_of(r) for r in run}) > 1),
                None,
            )
            if crossing is not None:
                found.append(Finding(
                    "CP304",
                    f"reshard_after_forward={value} regroups {self.dim} into runs of {value} "
                    f"ranks, and run {list(crossing)} spans nodes on {topology.describe()}: "
                    "the backward all-gather would cross nodes",
                    fix=f"use a divisor of {size} whose runs fit in a node (at most "
                    f"{topology.devices_per_node} devices per node, counting inner mesh dims)",
                ))
        return found

    @hookimpl
    def composer_par_validate_model(self, model: Any, blocks: list[Any]) -> list[Finding]:
        from composer_par.plugin.initialize import tied_outside

        found = []
        for path, name, twin in tied_outside(model, blocks):
            found.append(Finding(
                "CP424",
                f"block {path} holds {name}, which is tied to {twin} outside it (one "
                "parameter in two modules): fully_shard would make it part of two FSDP "
                "groups and fail, or shard the two names apart",
                fix=f"give blocks that leave {path} out (its parent's group then holds both "
                "twins), or a block holding both; detected blocks do this themselves"))
        return found

    @hookimpl
    def composer_par_estimate_settings(self) -> EstimateSettings:
        mp = self.mixed_precision or MixedPrecision()
        return EstimateSettings(reshard_after_forward=self.reshard_after_forward,
                                param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype)

    @hookimpl
    def composer_par_describe(self, plan: PlanView) -> list[tuple[str, str]]:
        hooked = {h.dim for h in plan.comm_hooks() if h.all_reduce}
        dims = [*(d for d in plan.replicate_dims() if d in plan.mesh and d not in hooked),
                self.dim]
        opts = ", ".join(f"{k}={v}" for k, v in self.options().items() if k != "dim")
        return [(
            "data_parallel",
            f"fully_shard each block, then the root, over mesh ({', '.join(dims)})"
            + (f" with {opts}" if opts else ""),
        )]

    @hookimpl
    def composer_par_data_parallel(self, ctx: ApplyContext) -> str:
        import torch
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        replicate = [d for d in ctx.replicate_dims() if d in ctx.mesh and d != self.dim]
        if len(replicate) > 1:
            raise NotImplementedError(
                f"FSDP2 replicates over one mesh dim; plugins contributed {replicate}"
            )
        # A replicate dim whose all-reduce a comm hook claims stays out of the mesh: FSDP2
        # then shards over its own dim only and the hook reduces over the replicate dim.
        comm_hooks = ctx.comm_hooks()
        hooked = [d for d in replicate if d in comm_hooks and comm_hooks[d].all_reduce]
        replicate = [d for d in replicate if d not in hooked]
        mesh = ctx.submesh(*replicate, self.dim)
        if self.offload == "cpu":
            # Pinned host memory needs an accelerator; without one, pinning fails.
            offload: Any = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        else:
            offload = OffloadPolicy()
        mp = self.mixed_precision or MixedPrecision()
        common = {"mesh": mesh, "offload_policy": offload}
        if self.reshard_after_forward is not None:
            common["reshard_after_forward"] = self.reshard_after_forward
        sharded = []
        block_policy = mp.policy(root=False)
        for _, block in ctx.blocks:
            fully_shard(block, mp_policy=block_policy, **common)
            sharded.append(block)
        fully_shard(ctx.model, mp_policy=mp.policy(root=True), **common)
        sharded.append(ctx.model)
        ctx.data_parallel_modules.extend(sharded)
        dims = ", ".join(f"{d}({ctx.mesh.size(d)})" for d in (*replicate, self.dim))
        detail = f"fully_shard on {len(ctx.blocks)} block(s) + root over ({dims})"
        for dim in hooked:
            install_all_reduce(ctx, sharded, comm_hooks[dim], owner=self.name,
                               replace_native=False)
            detail += f"; {dim} all-reduce by {comm_hooks[dim].plugin}'s comm hook"
        if self.dim in comm_hooks:
            install_shard_comms(ctx, sharded, comm_hooks[self.dim], owner=self.name)
            detail += f"; {self.dim} comms by {comm_hooks[self.dim].plugin}'s comm hook"
        return detail

