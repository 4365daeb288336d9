"""The optimizer guard: an optimizer holding FSDP2's unsharded parameters fails its first step.

FSDP2 registers each module's sharded parameters on the module. A forward swaps in the
unsharded ones, and the root module (like any module built with
``reshard_after_forward=False``) keeps them registered until its backward, so that the
backward need not all-gather them again. An optimizer built from ``model.parameters()``
in that window -- after a warm-up forward, an evaluation, a shape probe -- holds those
unsharded tensors. Gradients are reduced into the sharded parameters, so the optimizer
sees no gradient there and those parameters never train, without any error.

:func:`guard_optimizers` (called by ``ParallelPlan.apply`` on every model it shards)
makes that an error. It notes the sharded parameters ``apply`` returned, and at the
model's first forward which registered tensors are not among them (FSDP2 makes each
unsharded parameter once and reuses it, so the first forward shows all there will be).
The first ``step()`` of every optimizer then checks that it holds none of them and
raises :class:`UnshardedParameterError` before anything is updated. Each optimizer is
checked once: later steps cost one weak-set lookup.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.nn as nn
    from torch.utils.hooks import RemovableHandle


class UnshardedParameterError(RuntimeError):
    """An optimizer holds the unsharded stand-ins of sharded parameters (see the module)."""


class _Guard:
    def __init__(self, model: nn.Module) -> None:
        self.model = weakref.ref(model)
        self.sharded = {id(p) for p in model.parameters()}
        # id -> (the unsharded tensor, weakly, and the parameter's name)
        self.unsharded: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        self.handle: RemovableHandle | None = model.register_forward_hook(self._after_forward)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        from composer_par.blocks import clean_name

        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        for name, param in module.named_parameters():
            if id(param) not in self.sharded:
                self.unsharded[id(param)] = (weakref.ref(param), clean_name(name))

    def held_by(self, optimizer: torch.optim.Optimizer) -> list[str]:
        names = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                entry = self.unsharded.get(id(param))
                if entry is not None and entry[0]() is param:
                    names.append(entry[1])
        return names


_GUARDS: list[_Guard] = []
_CHECKED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_HOOK: RemovableHandle | None = None


def guard_optimizers(model: nn.Module) -> None:
    """Make any optimizer that holds ``model``'s unsharded parameters fail its first step."""
    global _HOOK
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    # Guards of models gone are dropped here too: a process that applies plans and never
    # steps an optimizer (a sweep, a test) would otherwise keep one per apply.
    _GUARDS[:] = [g for g in _GUARDS if g.model() is not None]
    _GUARDS.append(_Guard(model))
    if _HOOK is None:
        # torch has no per-model optimizer hook: one process-wide hook, checking each
        # optimizer once and removing itself once no guarded model is left.
        _HOOK = register_optimizer_step_pre_hook(_before_step)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    global _HOOK
    if optimizer in _CHECKED:
        return
    _CHECKED.add(optimizer)
    _GUARDS[:] = [g for g in _GUARDS if g.model() is not None]
    if not _GUARDS and _HOOK is not None:
        _HOOK.remove()
        _HOOK = None
    for guard in _GUARDS:
        names = guard.held_by(optimizer)
        if names:
            # Not checked again: a caller that catches this and steps anyway chose to.
            shown = ", ".join(repr(n) for n in names[:4])
            more = f" and {len(names) - 4} more" if len(names) > 4 else ""
            raise UnshardedParameterError(
                f"{type(optimizer).__name__} holds {shown}{more} as the unsharded tensor FSDP2 "
                "registers during a forward, not the sharded parameter its gradients go to: "
                "this step would leave it untrained. Create the optimizer from "
                "model.parameters() right after plan.apply(), before any forward (or call "
                "reshard() on every module in plan.data_parallel_modules before creating it)"
            )
