"""Blocks wrapped before the plan: the check every plugin that wraps blocks shares.

A plugin that checkpoints or compiles the shared blocks must refuse a block someone
already wrapped: a wrapper module puts its prefix into parameter names, and a second
checkpoint or compile on top of the first doubles the work silently. Both
ActivationCheckpoint and Compile report it, under one rule (:data:`ALREADY_WRAPPED`,
CP411), listed in each one's catalog.

No torch import at module level: plugin classes must load without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from composer_par.findings import Finding, Rule, Severity

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.blocks import Block

# The instance attribute that marks a block composer_par checkpointed (and in which mode).
CHECKPOINT_MARK = "_composer_par_checkpoint"

ALREADY_WRAPPED = Rule(
    "CP411", Severity.ERROR, "a block is already compiled or checkpoint-wrapped",
    "apply the plan to the model as built: let ActivationCheckpoint and Compile wrap the "
    "blocks (they keep the model's own parameter names)",
    "model.layers[0].compile()\n"
    "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(Compile(backend=\"eager\"))"
    ".use(MetaInit()).validate(model)",
)


def already_wrapped(module: nn.Module) -> str | None:
    """Why ``module`` cannot be checkpointed or compiled again, or None."""
    from composer_par.plugin import torch_private

    kind = torch_private.wrapper_kind(module)
    if kind == "compile":
        return "is a torch.compile wrapper (OptimizedModule: names gain '_orig_mod.')"
    if kind == "checkpoint":
        return "is a checkpoint_wrapper (names gain '_checkpoint_wrapped_module.')"
    if CHECKPOINT_MARK in module.__dict__:
        return "is already checkpointed by composer_par"
    if "forward" in module.__dict__:
        return "has an instance-level forward (already wrapped or patched)"
    if torch_private.has_composable(module, "checkpoint"):
        return "already has torch's composable checkpoint applied"
    if torch_private.compiled_in_place(module):
        return "is already compiled (Module.compile())"
    return None


def wrapped_block_findings(blocks: list[Block]) -> list[Finding]:
    """A CP411 finding for each block already wrapped (made in a hook, it names the
    plugin whose hook is running)."""
    found = []
    for path, block in blocks:
        why = already_wrapped(block)
        if why:
            found.append(Finding(ALREADY_WRAPPED.code, f"block {path} ({type(block).__name__}) "
                                 f"{why}", fix=ALREADY_WRAPPED.fix))
    return found


__all__ = ["ALREADY_WRAPPED", "CHECKPOINT_MARK", "already_wrapped", "wrapped_block_findings"]
