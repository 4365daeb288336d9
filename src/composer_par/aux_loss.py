"""Auxiliary losses a model makes inside its forward (a mixture-of-experts router's
load-balancing loss), delivered to backward as a side gradient and added to the loss the
training step reports.

Such a loss is made in a block, and under a pipeline the block may run on a stage that
never sees the loss function (only the last stage calls it). So the block hands its
weighted auxiliary loss to :func:`add_aux_loss` together with its output: the output
goes on unchanged, and in backward the auxiliary loss receives the gradient the step's
loss would have given it, the step's *scale*: 1 for one backward (and for each of a
pipeline schedule's microbatches: torch divides the gradients by the microbatch count
after the pass, as for the main loss), ``1/k`` for each of ``k`` accumulated
microbatches. That is Megatron-LM's and torchtitan's "auxiliary loss as a side
gradient": every stage adds its own blocks' part to the backward of its own output, and
the gradients equal those of ``main loss + auxiliary losses`` on one process (over the
same microbatches: a load-balancing loss of a batch is not the mean of its halves').

The training step (:mod:`composer_par.training`) opens :func:`collect_aux_losses` around
each step's forwards and backwards and adds what the forwards recorded to the loss it
reports. Outside that scope :func:`add_aux_loss` returns the output as it is and records
nothing: a model's own way of adding its auxiliary loss (a ``loss + coef * aux``
written by hand) keeps working, and :func:`in_step` tells a model which one applies.

What runs outside the step's microbatches, inside its scope (torch's shape inference of
a pipeline's first step, on placeholder inputs) is run under :func:`aux_losses_paused`:
its auxiliary losses reach neither the report nor a gradient. The recomputation of an
activation-checkpointed block runs inside backward: it records nothing again, and the
gradient reaches the auxiliary loss once, through whichever graph backward runs.

Some auxiliary losses do not split into per-block parts: a Hugging Face router loss
pools every layer's routing before multiplying. Under a pipeline such a model carries
its running statistics from stage to stage as one more tensor: a stage runs its
forward inside :func:`stage_carry` (what the previous stage sent, and whether this is
the last stage), the model adds its layers to what came in and leaves the sum in
``outgoing`` for the next stage, and the last stage turns it into the loss. Backward
then returns each stage its share of the gradient through the pipeline's own sends. A
model marks itself with :func:`mark_carrying` so that the stages know to carry.

No torch import at module level: composer_par.plugin.pipeline re-exports from here.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch


@attrs.define
class AuxLossRecord:
    """The auxiliary losses of one step: ``scale`` is the gradient each receives in
    backward, ``values`` the (detached) losses the step's forwards made."""

    scale: float
    values: list[torch.Tensor] = attrs.Factory(list)
    paused: bool = False

    def total(self) -> torch.Tensor | None:
        """The sum of the recorded losses (float32), or None when none was made."""
        import torch

        if not self.values:
            return None
        return torch.stack([v.float() for v in self.values]).sum()


# A module global, not a context variable: activation checkpointing recomputes blocks in
# the autograd engine's threads, which a context variable does not reach.
_active: AuxLossRecord | None = None


@contextlib.contextmanager
def collect_aux_losses(scale: float) -> Iterator[AuxLossRecord]:
    """The scope of one training step: :func:`add_aux_loss` attaches its losses to
    backward with gradient ``scale`` and records them in the record yielded."""
    global _active
    if _active is not None:
        raise RuntimeError("collect_aux_losses inside another: one training step at a time")
    _active = AuxLossRecord(scale)
    try:
        yield _active
    finally:
        _active = None


@contextlib.contextmanager
def aux_losses_paused() -> Iterator[None]:
    """Forwards that are no microbatch of the step (a pipeline's shape inference): their
    auxiliary losses are neither recorded nor given a gradient."""
    record = _active
    if record is None:
        yield
        return
    before, record.paused = record.paused, True
    try:
        yield
    finally:
        record.paused = before


def in_step() -> bool:
    """Whether a training step collects auxiliary losses now: a model then leaves its
    auxiliary loss to :func:`add_aux_loss` and must not add it to the main loss too."""
    return _active is not None


def add_aux_loss(output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``output`` unchanged; inside a training step, ``loss`` (a scalar, already weighted
    by its coefficient) receives the step's scale as its gradient when backward reaches
    ``output``, and is added to the step's reported loss."""
    import torch

    from composer_par.plugin import torch_private

    record = _active
    if record is None or record.paused:
        return output
    # Recomputation of a checkpointed block runs inside backward: recorded once already.
    if not torch_private.in_backward():
        record.values.append(loss.detach())
    if not (torch.is_grad_enabled() and loss.requires_grad):
        return output
    return _side_gradient().apply(output, loss, record.scale)  # type: ignore[no-any-return]


@attrs.define
class StageCarry:
    """One pipeline stage's forward: ``incoming`` is what the previous stage carried
    (None on the first), ``last`` whether no stage follows; the model sets ``outgoing``
    to what the next stage is to receive."""

    incoming: torch.Tensor | None
    last: bool
    outgoing: torch.Tensor | None = None


_carry: StageCarry | None = None
CARRY_MARK = "_composer_par_carries"


def mark_carrying(model: Any) -> None:
    """Say that ``model``'s forward carries statistics between pipeline stages."""
    setattr(model, CARRY_MARK, True)


def carries(module: Any) -> bool:
    """Whether ``module`` (a pipeline stage's root) carries statistics between stages."""
    return bool(getattr(module, CARRY_MARK, False))


@contextlib.contextmanager
def stage_carry(incoming: torch.Tensor | None, last: bool) -> Iterator[StageCarry]:
    """The scope of one pipeline stage's forward of a carrying model."""
    global _carry
    before, _carry = _carry, StageCarry(incoming, last)
    try:
        yield _carry
    finally:
        _carry = before


def current_carry() -> StageCarry | None:
    """The running stage's carry, or None outside a pipeline stage's forward."""
    return _carry


SEQUENCE_MARK = "_composer_par_sequence_group"


def split_sequence(model: Any, group: Any) -> None:
    """Say that the ranks of ``group`` (a process group) each hold a part of every
    sequence ``model`` reads: :func:`sequence_total` in any of its modules then sums
    over ``group``."""
    for module in model.modules():
        setattr(module, SEQUENCE_MARK, group)


def sequence_total(module: Any, sums: torch.Tensor) -> torch.Tensor:
    """``sums`` (sums over the tokens this rank holds) totalled over the ranks holding
    the other parts of the same sequences, or as they are when ``module`` reads whole
    sequences. Backward sums the gradients over those ranks: averaged over them, as data
    parallelism averages, each rank's tokens get the gradient of the whole sequences'
    loss."""
    group = getattr(module, SEQUENCE_MARK, None)
    if group is None:
        return sums
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(sums, group=group)  # type: ignore[no-any-return]


@functools.cache
def _side_gradient() -> Any:
    import torch

    class SideGradient(torch.autograd.Function):
        """Identity on ``output``; backward gives ``loss`` the gradient ``scale``."""

        @staticmethod
        def forward(ctx: Any, output: torch.Tensor, loss: torch.Tensor, scale: float
                    ) -> torch.Tensor:
            ctx.scale = scale
            ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
            return output.view_as(output)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
            shape, dtype, device = ctx.loss_meta
            return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None

    return SideGradient


__all__ = ["AuxLossRecord", "StageCarry", "add_aux_loss", "aux_losses_paused", "carries",
           "collect_aux_losses", "current_carry", "in_step", "mark_carrying",
           "sequence_total", "split_sequence", "stage_carry"]
