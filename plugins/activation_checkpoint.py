"""ActivationCheckpoint: recompute the shared blocks' activations in backward.

``mode="full"`` saves nothing inside a checkpointed block (its inputs only) and
recomputes its whole forward in backward; ``mode="selective"`` saves the outputs of the
matrix multiplications (the expensive ops) and recomputes the rest (norms, activations,
elementwise ops), through ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.
``every=N`` checkpoints the N-th, 2N-th, ... block (1-based, as torchtitan counts).

Why no wrapper module: ``checkpoint_wrapper`` inserts ``_checkpoint_wrapped_module.``
into every parameter name under the block, which then reaches ``named_parameters()``,
optimizer state, TP patterns and anything keyed by name. torch's composable
``checkpoint`` keeps names but works through forward hooks, which ``torch.compile`` of the
block would trace into. Instead each checkpointed block gets an instance-level
``forward`` that calls its class's forward under ``torch.utils.checkpoint.checkpoint``:
the module tree, the names and the module objects FSDP groups stay exactly the model's,
and ``torch.compile`` traces the checkpoint as one region (measured on torch 2.13 with
the eager, aot_eager and inductor backends, full and selective).
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import attrs

from composer_par.plugin import (
    ALREADY_WRAPPED,
    Declaration,
    EstimateSettings,
    Finding,
    Plugin,
    Rule,
    Severity,
    already_wrapped,
    blocks_option,
    hookimpl,
    int_option,
    ordering_option,
    wrapped_block_findings,
)
from composer_par.plugin.wrapping import CHECKPOINT_MARK

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.plugin import Block
    from composer_par.plugin.context import ApplyContext

# The instance attribute that marks a block this plugin checkpointed (and in which mode);
# the shared already-wrapped check knows it.
MARK = CHECKPOINT_MARK

# aten ops whose outputs selective mode saves: the matrix multiplications, which are what
# a recompute would spend its time on. nn.Linear reaches the dispatcher as mm/addmm.
MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm")


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if _is_matmul(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@functools.cache
def _matmul_overloads() -> frozenset[Any]:
    import torch

    aten = torch.ops.aten
    found: set[Any] = set()
    for name in MATMUL_OPS:
        packet = getattr(aten, name, None)
        if packet is not None:
            found.update(getattr(packet, o) for o in packet.overloads())
    return frozenset(found)


def _is_matmul(op: Any) -> bool:
    return op in _matmul_overloads()


def selective_context_fn() -> Any:
    """The ``context_fn`` of selective mode: save matmul outputs, recompute the rest."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_selective_policy)


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a checkpointed block: its class's forward under checkpoint.

    Module-level (not a closure) and bound with ``types.MethodType`` so that a deepcopy
    of the block is bound to the copy, never to the original.
    """
    from torch.utils.checkpoint import checkpoint

    if self.__dict__[MARK] == "selective":
        return checkpoint(
            type(self).forward, self, *args, use_reentrant=False,
            context_fn=selective_context_fn, **kwargs,
        )
    # No context_fn at all for full mode: dynamo (torch 2.13) refuses to trace
    # checkpoint(..., context_fn=noop_context_fn) ("checkpoint not implemented for
    # LazyVariableTracker context_fn"), although noop is the default.
    return checkpoint(type(self).forward, self, *args, use_reentrant=False, **kwargs)


def checkpoint_block(block: nn.Module, mode: str) -> None:
    """Make ``block`` recompute its activations in backward; names and module unchanged."""
    why = already_wrapped(block)
    if why:
        raise RuntimeError(f"cannot checkpoint {type(block).__name__}: it {why}")
    object.__setattr__(block, MARK, mode)
    object.__setattr__(block, "forward", types.MethodType(_checkpointed_forward, block))


def chosen(count: int, every: int) -> list[int]:
    """Indices of the blocks ``every`` selects: the N-th, 2N-th, ... (1-based)."""
    return [i for i in range(count) if (i + 1) % every == 0]


RULES = (
    Rule("CP422", Severity.INFO, "the generation cache is off in checkpointed training",
         "nothing to do; generate() and evaluation still use the cache",
         "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(ActivationCheckpoint())"
         ".use(MetaInit()).validate(llama_for_causal_lm)"),
    Rule("CP423", Severity.WARNING,
         "the model says it does not support gradient checkpointing",
         "check that the model trains the same with and without the plugin, or drop it",
         "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(ActivationCheckpoint())"
         ".use(MetaInit()).validate(model_with_supports_gradient_checkpointing_false)"),
)


def caches_in_training(model: Any) -> bool:
    """Whether ``model`` (a Hugging Face model) would build a generation cache in a
    training forward: its config says ``use_cache`` and its forward takes the argument."""
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        return False
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "use_cache" in params


def _no_cache_in_training(module: Any, args: Any, kwargs: Any) -> Any:
    """A training forward of a checkpointed model runs without a generation cache: the
    recomputation in backward would append every block's keys and values to it again
    (transformers' own gradient checkpointing turns it off the same way)."""
    if module.training:
        kwargs = {**kwargs, "use_cache": False}
    return args, kwargs


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


@attrs.frozen
class ActivationCheckpoint(Plugin):
    """Activation checkpointing on the shared blocks (stage ``activation_checkpoint``).

    Options: ``mode`` (``"full"``: recompute each checkpointed block entirely;
    ``"selective"``: keep matmul outputs, recompute the rest); ``every`` (checkpoint every
    N-th block; 1 = all); ``blocks`` (a module path or block class names; else the blocks
    another plugin names, else detected).
    """

    name: ClassVar[str] = "activation_checkpoint"
    needs_blocks: ClassVar[bool] = True
    rules: ClassVar[tuple[Rule, ...]] = (ALREADY_WRAPPED, *RULES)

    mode: Literal["full", "selective"] = attrs.field(
        default="full", validator=attrs.validators.in_(("full", "selective"))
    )
    every: int = int_option(1, low=1)
    blocks: str | tuple[str, ...] | None = blocks_option()
    after: tuple[str, ...] = ordering_option()
    before: tuple[str, ...] = ordering_option()

    def declare(self) -> Declaration:
        # Compile (or any plugin) learns how the blocks are wrapped from this.
        return attrs.evolve(super().declare(), checkpointing=self.mode)

    @hookimpl
    def composer_par_estimate_settings(self) -> EstimateSettings:
        return EstimateSettings(activation_checkpoint=self.mode, checkpoint_every=self.every)

    @hookimpl
    def composer_par_validate_model(self, model: nn.Module, blocks: list[Block]
                                    ) -> list[Finding]:
        found = wrapped_block_findings(blocks)
        name = type(model).__name__
        if getattr(model, "supports_gradient_checkpointing", True) is False:
            found.append(Finding(
                "CP423",
                f"{name}.supports_gradient_checkpointing is False: transformers does not "
                "checkpoint this model's layers (their forward may keep state between calls, "
                "which a recomputation in backward would change); the plugin checkpoints "
                "its blocks anyway",
                fix="check that the model trains the same with and without the plugin "
                "(parity), or drop the plugin"))
        if caches_in_training(model):
            found.append(Finding(
                "CP422",
                f"{name}.config.use_cache is True: its training forwards run with "
                "use_cache=False, as transformers' own gradient checkpointing does (a block "
                "recomputed in backward would append its keys and values to the generation "
                "cache a second time: a size mismatch in the first step)",
                fix="nothing to do; generate() and evaluation (model.eval()) still use the "
                "cache"))
        if blocks and not chosen(len(blocks), self.every):
            found.append(Finding(
                "CP210",
                f"every={self.every} selects none of the {len(blocks)} block(s): nothing would "
                "be checkpointed",
                fix=f"use every <= {len(blocks)} (1 checkpoints every block), or drop the plugin",
            ))
        return found

    @hookimpl
    def composer_par_describe(self) -> list[tuple[str, str]]:
        which = "every block" if self.every == 1 else f"every {_ordinal(self.every)} block"
        how = ("recompute the whole block in backward" if self.mode == "full"
               else "save matmul outputs, recompute the rest")
        return [("activation_checkpoint", f"{self.mode} checkpointing of {which}: {how}")]

    @hookimpl
    def composer_par_activation_checkpoint(self, ctx: ApplyContext) -> str:
        picked = chosen(len(ctx.blocks), self.every)
        for index in picked:
            checkpoint_block(ctx.blocks[index][1], self.mode)
        ctx.notes["checkpointed_blocks"] = [ctx.blocks[i][0] for i in picked]
        detail = f"{self.mode} checkpointing on {len(picked)} of {len(ctx.blocks)} block(s)"
        if picked and caches_in_training(ctx.model):
            ctx.model.register_forward_pre_hook(_no_cache_in_training, with_kwargs=True)
            detail += "; generation cache off in training forwards"
        return detail


__all__ = ["ActivationCheckpoint", "checkpoint_block", "selective_context_fn"]
