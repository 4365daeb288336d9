"""The float8 weights' scales under FSDP2's float8 all-gather: computed once per optimizer
step, in one all-reduce of every weight's amax, and never used after the weight changed.

torchao casts each weight to float8 before FSDP2 all-gathers it, with a scale from the
weight's amax over all its shards. Left alone it all-reduces that amax for every weight
at every all-gather (forward, and again in backward after a reshard).
``precompute_float8_dynamic_scale_for_fsdp`` computes all of them in one all-reduce and
leaves each on its weight, where every later all-gather uses it until it is replaced.

Precomputing is also what makes the scale that of the whole weight: without it torchao
reduces each amax over FSDP2's mesh alone, so under FSDP2 x TP every tp rank would cast
its part of a weight with a scale of its own, not the one process's scale.

A precomputed scale is only right until the weight changes. The plugin keeps, on the
model, a :class:`Scales` object that computes every scale in one all-reduce before the
model's first forward, and again before the first forward after the weights changed:
when the ``composer_par_parameters_changed`` hook said they may (``plan.training_step``
at the start and end of every step, the trainer adapters after every optimizer step;
the hook also forgets every scale at once, with no collective, so an all-gather before
that forward computes its own), or when their version counters moved (a loop that
changed them without the hook: its own optimizer step, a checkpoint load). Every rank's
weights change at the same points, so every rank joins the all-reduce.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import torchao_api

if TYPE_CHECKING:
    import torch.nn as nn

#: Where the model keeps its :class:`Scales`.
ATTRIBUTE = "_composer_par_float8_scales"


class Scales:
    """The float8 all-gather weights of one model (or pipeline part) and whether their
    precomputed scales are those of the weights as they are."""

    def __init__(self, model: nn.Module) -> None:
        self.weights = [p for p in model.parameters() if torchao_api.gathers_in_float8(p)]
        self.model = model
        # Told that the weights may change: refresh before the next forward.
        self.pending = False
        # The weights' version counters when the scales were computed (None: no scale
        # precomputed, every all-gather computes its own).
        self.versions: tuple[int, ...] | None = None
        self.refreshes = 0  # how many times the scales were computed (one all-reduce each)

    def _versions(self) -> tuple[int, ...]:
        from composer_par.plugin import torch_private

        return tuple(torch_private.tensor_version(w) for w in self.weights)

    def forget(self) -> None:
        """The weights may change: no all-gather uses a precomputed scale until the next
        forward computes them again."""
        for weight in self.weights:
            torchao_api.clear_scale(weight)
        self.versions = None
        self.pending = True

    def refresh(self) -> None:
        """Compute every scale in one all-reduce (a collective: every rank calls it)."""
        torchao_api.precompute_scales(self.model)
        self.versions = self._versions()
        self.pending = False
        self.refreshes += 1

    def before_forward(self, module: nn.Module, args: Any) -> None:
        # The first forward; one after the hook said the weights may change; or one after
        # their version counters moved (a loop that changed them without saying so: an
        # optimizer step outside plan.training_step and the trainer adapters, a checkpoint
        # load). Every rank's weights change at the same points (optimizer steps and loads
        # run on every rank), so every rank refreshes together.
        if self.pending or self.versions is None or self._versions() != self.versions:
            self.refresh()


def install(model: nn.Module) -> Scales | None:
    """Keep a :class:`Scales` on ``model`` and refresh stale scales before its forward;
    None if no weight of it gathers in float8. Runs before FSDP2's own pre-forward (which
    all-gathers the root's weights)."""
    scales = Scales(model)
    if not scales.weights:
        return None
    setattr(model, ATTRIBUTE, scales)
    model.register_forward_pre_hook(scales.before_forward, prepend=True)
    return scales


def forget_all(model: nn.Module) -> int:
    """Forget the scales of every :class:`Scales` in ``model``; how many there were."""
    found = [getattr(m, ATTRIBUTE) for m in model.modules() if hasattr(m, ATTRIBUTE)]
    for scales in found:
        scales.forget()
    return len(found)


def scales_of(model: nn.Module) -> list[Scales]:
    """The :class:`Scales` objects in ``model`` (one per pipeline part it holds)."""
    return [getattr(m, ATTRIBUTE) for m in model.modules() if hasattr(m, ATTRIBUTE)]


__all__ = ["ATTRIBUTE", "Scales", "forget_all", "install", "scales_of"]
