"""Activation memory as measured: the bytes autograd holds for backward at the end of a
forward, by torch's memory tracker (``torch.distributed._tools.mem_tracker.MemTracker``,
which works on CPU: it follows tensor storages through a dispatch mode, with no
allocator statistics needed). What :func:`composer_par.estimate.activation_bytes`
predicts is checked against this (tests/test_activation_memory.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["held_for_backward"]


def held_for_backward(model: Any, forward: Callable[[], Any], *,
                      optimizer: Any = None) -> dict[str, int]:
    """Run ``forward()`` (returning the loss) under the tracker and report, at its end,
    ``{"activations": bytes, "peak_activations": bytes}``: the activations alive then
    (tensors made during forward and kept: saved for backward, and the loss) and the
    forward's peak of them (temporaries included). Parameters, buffers, gradients and
    ``optimizer``'s states are tracked as such and not counted. Runs ``backward()`` on
    the loss afterwards, outside the tracker, so nothing is left holding the graph."""
    import warnings

    import torch

    from composer_par.plugin import torch_private

    MemTracker, activations = torch_private.mem_tracker()

    tracker = MemTracker()
    if optimizer is not None:
        tracker.track_external(model, optimizer)
    else:
        tracker.track_external(model)
    with tracker, warnings.catch_warnings():
        # Modules outside the model's tree have no path, only their class name: with the
        # ``kernels`` package, transformers turns functions (rotary embedding's) into
        # modules all named ``Func``, one called inside another, and the tracker warns
        # that its module hierarchy may be wrong. The totals read here do not use it.
        warnings.filterwarnings("ignore", "The module hierarchy tracking", UserWarning)
        loss = forward()
        now = tracker.get_tracker_snapshot("current")
        peak = tracker.get_tracker_snapshot("peak")
    loss.backward()
    device = next(iter(now)) if now else torch.device("cpu")
    return {"activations": int(now[device][activations]),
            "peak_activations": int(peak[device][activations])}
