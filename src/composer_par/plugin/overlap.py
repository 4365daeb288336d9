"""One microbatch's forward and another's backward at once, taking turns at communicating.

DualPipe's trick (DeepSeek-V3's report, section 3.2.1): while one microbatch waits on
its all-to-alls, another computes. A pipeline schedule that pairs a forward with a
backward runs them with :func:`paired`: the forward on the calling thread, the backward
on a second one. A plugin whose blocks call collectives marks where each run of them
begins and ends (:func:`comm_begins`, :func:`comm_ends`: identities on the tensor they
are given). In backward the gradient meets the end mark first, so there it begins.

Under :func:`paired` a thread at a begin mark waits for its turn, and its end mark hands
the turn to the other thread. Turns alternate strictly, the backward's first (the
forward opens with compute, the backward of a block's last op with its collectives), and
a thread that has finished leaves the other to go on alone. So on every rank the two
threads' collectives are issued in one order, the same everywhere, which each process
group needs; and at any time one thread communicates while the other computes.

What this cannot see is a collective nobody marked: one issued by both threads on one
process group (tensor or context parallelism inside the blocks) could be issued in
different orders on different ranks. A schedule offering the pairing refuses plans whose
in-block collectives are not all marked (the ``overlap_marks`` capability).

Marks are made only while :func:`marking` is on (a step of such a schedule), so that
every forward of the step, paired or not, leaves them for its backward. Outside a pair
they do nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any

#: The capability a plugin provides when every collective its blocks call is marked.
OVERLAP_MARKS = "overlap_marks"

_FORWARD, _BACKWARD = "forward", "backward"


class _Turns:
    """Whose turn it is to communicate, between a forward and a backward thread."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._turn = _BACKWARD
        self._finished: set[str] = set()
        self._depth = {_FORWARD: 0, _BACKWARD: 0}
        self.sides: dict[int, str] = {}

    def begin(self, side: str) -> None:
        self._depth[side] += 1
        if self._depth[side] > 1:  # inside its own turn already (a nested mark)
            return
        other = _other(side)
        with self._changed:
            self._changed.wait_for(lambda: self._turn == side or other in self._finished)

    def end(self, side: str) -> None:
        self._depth[side] -= 1
        if self._depth[side] == 0:
            self._hand_over(side)

    def finish(self, side: str) -> None:
        with self._changed:
            self._finished.add(side)
            self._turn = _other(side)
            self._changed.notify_all()

    def _hand_over(self, side: str) -> None:
        with self._changed:
            self._turn = _other(side)
            self._changed.notify_all()


def _other(side: str) -> str:
    return _BACKWARD if side == _FORWARD else _FORWARD


# Process-wide, not per thread: both threads of a pair read them.
_pair: _Turns | None = None
_marking = 0


@contextlib.contextmanager
def marking() -> Iterator[None]:
    """Marks made while this is on (the steps of a schedule that pairs microbatches)."""
    global _marking
    _marking += 1
    try:
        yield
    finally:
        _marking -= 1


def _act(begins: bool) -> None:
    turns = _pair
    side = turns.sides.get(threading.get_ident()) if turns is not None else None
    if turns is None or side is None:
        return
    if begins:
        turns.begin(side)
    else:
        turns.end(side)


def _mark(tensor: Any, begins: bool) -> Any:
    if not _marking or not getattr(tensor, "requires_grad", False):
        return tensor
    return _Mark.apply(tensor, begins)


def comm_begins(tensor: Any) -> Any:
    """``tensor``, marked as where a run of collectives begins (ends, in backward)."""
    return _mark(tensor, True)


def comm_ends(tensor: Any) -> Any:
    """``tensor``, marked as where a run of collectives ends (begins, in backward)."""
    return _mark(tensor, False)


def _mark_function() -> Any:
    import torch

    class Mark(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, tensor: torch.Tensor, begins: bool) -> torch.Tensor:
            # Run again in backward by activation checkpointing, on the backward thread,
            # it marks that thread's recomputed collectives the same way.
            ctx.begins = begins
            _act(begins)
            return tensor.view_as(tensor)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            _act(not ctx.begins)
            return grad, None

    return Mark


class _LazyMark:
    # torch is imported on first use: this module is importable without it.
    function: Any = None

    def apply(self, tensor: Any, begins: bool) -> Any:
        if self.function is None:
            self.function = _mark_function()
        return self.function.apply(tensor, begins)


_Mark = _LazyMark()


def paired(forward: Callable[[], None], backward: Callable[[], None]) -> None:
    """``forward()`` on this thread and ``backward()`` on a second one, at once, taking
    turns at their marked collectives (see the module docstring). The backward thread
    runs in a copy of this thread's context and on its current accelerator stream; an
    exception on either thread is raised here once both have stopped."""
    global _pair
    if _pair is not None:
        raise RuntimeError("a paired forward and backward is already running")
    turns = _Turns()
    turns.sides[threading.get_ident()] = _FORWARD
    failed: list[BaseException] = []
    stream = _current_stream()

    def run_backward() -> None:
        turns.sides[threading.get_ident()] = _BACKWARD
        try:
            _use_stream(stream)
            backward()
        except BaseException as exc:  # raised on the calling thread after the join
            failed.append(exc)
        finally:
            turns.finish(_BACKWARD)

    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(run_backward,),
                              name="composer_par paired backward", daemon=True)
    _pair = turns
    try:
        thread.start()
        try:
            forward()
        finally:
            turns.finish(_FORWARD)
            thread.join()
    finally:
        _pair = None
    if failed:
        raise failed[0]


def _current_stream() -> Any:
    import torch

    return torch.accelerator.current_stream() if torch.accelerator.is_available() else None


def _use_stream(stream: Any) -> None:
    # Both threads' kernels go to one stream, as when the two halves ran one after the
    # other; the collectives run on their own streams beside it.
    if stream is not None:
        import torch

        torch.accelerator.set_stream(stream)


__all__ = ["OVERLAP_MARKS", "comm_begins", "comm_ends", "marking", "paired"]
