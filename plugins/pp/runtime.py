"""The torch side of a step: ``PipelineStage`` per local part, the schedule over them.

Between stages torch sends tensors (:func:`stage_output`); the loss, on the last stage,
is given the model's own output instead (:func:`model_output_loss`), so that one loss
serves a plan with a pipeline and one without.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from composer_par.plugin import torch_private

from .boundary import StageBoundary


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    # The split-backward schedules detach a stage's outputs in place after the input
    # backward, which torch refuses for a view: a stage without the output head returns
    # what the head would have been given, e.g. Hugging Face's hidden_states[:, -k:, :].
    return tensor.clone() if torch_private.is_view(tensor) else tensor


def stage_output(out: Any) -> Any:
    """What a stage sends on: tensors. A model output object (a Hugging Face
    ``ModelOutput`` is a mapping) gives its first tensor: ``logits``, or on a stage
    without the output head, the hidden state standing in its place. (The loss is given
    the object itself.)"""
    if isinstance(out, torch.Tensor):
        return _owned(out)
    if isinstance(out, Mapping):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        tensors = [v for v in out if isinstance(v, torch.Tensor)]
        if not tensors:
            raise TypeError(f"a pipeline stage's forward returned no tensor: {type(out)}")
        if len(tensors) == len(out) and isinstance(out, tuple):
            return tuple(_owned(t) for t in tensors)
        return _owned(tensors[0])
    raise TypeError(
        f"a pipeline stage's forward must return tensors; it returned {type(out).__name__}")


def _with_carried(sent: Any, carried: torch.Tensor | None) -> Any:
    """What a stage sends, with a carrying model's statistics after it."""
    if carried is None:
        return sent
    return (*(sent if isinstance(sent, tuple) else (sent,)), carried)


class _Stage(PipelineStage):
    """torch's stage with the model's output turned into what a stage sends.

    torch 2.13 calls the module in two places: each microbatch's forward, and the
    metadata inference of the first step (``_compute_outputs``, its override point).

    On the last stage each forward's own output (a Hugging Face ``ModelOutput``, a
    tensor, whatever the model returns) is kept, keyed by what the stage sent, until the
    loss asks for it: torch hands the loss the sent tensors, and the loss is written for
    the model's output (:func:`model_output_loss`).
    """

    def __init__(self, *args: Any, boundary: StageBoundary | None = None, **kwargs: Any
                 ) -> None:
        self._model_outputs: dict[int, Any] = {}
        self.boundary = boundary
        super().__init__(*args, **kwargs)

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        out, carried, hidden = self._carrying(super().forward_maybe_with_nosync, args, kwargs)
        sent = _with_carried(stage_output(out) if hidden is None else _owned(hidden), carried)
        self._keep(sent, out)
        return sent

    def _compute_outputs(self, *args: Any, module: nn.Module, **kwargs: Any) -> Any:
        from composer_par.plugin.pipeline import aux_losses_paused

        # Shape inference on placeholder inputs: no microbatch, so no auxiliary loss.
        with aux_losses_paused():
            out, carried, hidden = self._carrying(
                lambda *a, **k: super(_Stage, self)._compute_outputs(*a, module=module, **k),
                args, kwargs)
        sent = _with_carried(stage_output(out) if hidden is None else _owned(hidden), carried)
        # The metadata inference calls the loss too, on a lone output taken out of its
        # tuple.
        self._keep(sent[0] if isinstance(sent, tuple) and len(sent) == 1 else sent, out)
        return sent

    def _carrying(self, forward: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> tuple[Any, torch.Tensor | None, Any]:
        """``forward(*args, **kwargs)``, what a carrying model leaves for the next stage
        (composer_par.aux_loss: pooled loss statistics, received as the last argument
        after the first stage), and the hidden state to send on in place of the model's
        output (:mod:`.boundary`; None: the output is what is sent)."""
        from composer_par.plugin.pipeline import carries, stage_carry

        if not carries(self.submod):
            out, hidden = self._bounded(forward, args, kwargs)
            return out, None, hidden
        incoming = None
        if not self.is_first:
            *rest, incoming = args
            args = tuple(rest)
        with stage_carry(incoming, self.is_last) as carry:
            out, hidden = self._bounded(forward, args, kwargs)
        return out, None if self.is_last else carry.outgoing, hidden

    def _bounded(self, forward: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[Any, Any]:
        from . import PipelineError
        from .boundary import BoundaryError, running, sent_hidden_state

        boundary = self.boundary
        try:
            with running(boundary, args):
                out = forward(*args, **kwargs)
                hidden = sent_hidden_state(boundary, out)
        except BoundaryError as exc:
            from composer_par.plugin import Finding

            raise PipelineError(Finding("CP612", str(exc), fix=exc.fix, plugin="pp")) from None
        if boundary is not None:
            boundary.say_once()
        return out, hidden

    def _keep(self, given: Any, out: Any) -> None:
        if self.is_last:
            # torch holds what it gives the loss until the step ends (its forward cache,
            # the metadata inference's outputs), so the id names this output until then.
            self._model_outputs[id(given)] = out

    def model_output(self, sent: Any) -> Any:
        """What the model's forward returned for the microbatch whose stage output is
        ``sent`` (once: the entry is dropped)."""
        return self._model_outputs.pop(id(sent), sent)

    def clear_runtime_states(self) -> None:
        # torch calls this at the start of every step: nothing kept outlives a step.
        super().clear_runtime_states()
        self._model_outputs.clear()


def model_output_loss(stage: _Stage, loss_fn: Callable[..., torch.Tensor]
                      ) -> Callable[..., torch.Tensor]:
    """``loss_fn`` as torch's schedule calls it on the last stage, given the model's own
    output for the microbatch instead of the tensors the stage sent."""

    def loss(output: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        return loss_fn(stage.model_output(output), target, **kwargs)

    return loss


def compiled_modules(parts: Sequence[nn.Module]) -> list[str]:
    """Modules compiled in place (``Module.compile()``) or wrapped by ``torch.compile``."""
    out = []
    for part in parts:
        for name, module in part.named_modules():
            if torch_private.is_compiled(module):
                out.append(name or "<root>")
    return out


def keep_unsharded_until_backward(part: nn.Module, modules: Sequence[nn.Module]) -> int:
    """``set_reshard_after_forward(False)`` on the FSDP modules inside ``part``.

    Measured on torch 2.13 (4 gloo ranks, pp 2 x dp_shard 2): with the split-backward
    schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV), FSDP2 modules that
    reshard after forward train on wrong weight gradients from the first step, silently;
    kept unsharded until their backward, they are at parity.
    """
    from torch.distributed.fsdp import FSDPModule

    inside = {id(m) for m in part.modules()}
    count = 0
    for module in modules:
        # Replicated modules (HSDP alone) never reshard: nothing to keep.
        if (isinstance(module, FSDPModule) and not torch_private.is_replicated(module)
                and id(module) in inside):
            module.set_reshard_after_forward(False, recurse=False)
            count += 1
    return count


def build_schedule(
    *, schedule: str, microbatches: int, num_stages: int, parts: Sequence[tuple[int, nn.Module]],
    device: torch.device, group: Any, loss_fn: Callable[..., torch.Tensor],
    boundaries: Mapping[int, StageBoundary] | None = None, overlap: bool = False,
) -> Any:
    """The torch schedule over this rank's parts (``(stage index, module)``, in order).

    ``loss_fn(outputs, targets)`` is given, for each microbatch, what the model's forward
    returned on the last stage: the same kind of object as the unsplit model returns.
    ``boundaries``: each stage's :class:`~.boundary.StageBoundary` (where its hidden state
    enters and leaves it). ``overlap``: each overlapped forward and backward of the
    schedule (DualPipeV's) runs its halves at once (:func:`overlapped`)."""
    boundaries = boundaries or {}
    stages = [_Stage(module, index, num_stages, device, group=group,
                     boundary=boundaries.get(index)) for index, module in parts]
    last = next((stage for stage in stages if stage.is_last), None)
    if last is not None:
        loss_fn = model_output_loss(last, loss_fn)
    cls = get_schedule_class(schedule)
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], microbatches, loss_fn=loss_fn)
    built = cls(stages, microbatches, loss_fn=loss_fn)
    return overlapped(built) if overlap else built


def overlapped(schedule: Any) -> Any:
    """``schedule`` running each overlapped forward and backward's halves at once, the
    backward on a second thread, taking turns at the collectives the blocks mark
    (:mod:`composer_par.plugin.overlap`); torch's own runtime runs them one after the
    other. Its steps make the marks, so that every forward leaves them for its
    backward, paired or not."""
    from composer_par.plugin import overlap

    torch_private.on_overlapped_actions(schedule, overlap.paired)
    step = schedule.step

    def marked_step(*args: Any, **kwargs: Any) -> Any:
        with overlap.marking():
            return step(*args, **kwargs)

    schedule.step = marked_step
    return schedule


__all__ = ["build_schedule", "compiled_modules", "keep_unsharded_until_backward",
           "model_output_loss", "overlapped", "stage_output"]
