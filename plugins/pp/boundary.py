"""Where the hidden state enters and leaves a stage: the ops a model's forward applies
around its embedding and its head run on the stage that holds them, once.

A stage runs the model's whole ``forward`` with the other stages' modules replaced by
stand-ins that hand back their first argument (:mod:`.parts`). What the forward does
*outside* those modules then runs on every stage: Granite's base model multiplies the
embedding's output by ``embedding_multiplier``, its causal LM divides the head's output
by ``logits_scaling``; Gemma 2 softcaps the logits; GPT-2 adds a position embedding.
On a stage without the embedding, the multiplication would land on the hidden state it
received; on a stage without the head, the division on the hidden state it sends on.

So the boundary of a stage is fixed where the model's own blocks are, with no list of
model families:

* a stage after the first hands its first block exactly the hidden state it received
  (a forward pre-hook on that block swaps the argument back when the forward changed
  it on the way);
* a stage before the last sends on the hidden state its forward handed to the first
  module after the blocks that another stage owns (the final norm, the head): what the
  next stage's first block would have been given in the unsplit model.

What was left out is found by walking the autograd graph from the argument the block
was given back to the tensor received (and from the model's output back to the hidden
state sent): those op names are logged once per stage. Where the argument cannot stand
for the hidden state (another shape, not a tensor), the plan cannot tell what the
forward meant and refuses, naming the model and the ops (CP612).

Torch is imported inside functions only.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.nn as nn


class BoundaryError(ValueError):
    """A stage cannot tell which tensor is its hidden state (CP612's message and fix)."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


class StageBoundary:
    """One stage's boundary: its first block (None on the first stage, which takes the
    model's inputs), the paths of the modules after the blocks that another stage owns
    (empty on the last stage), and, while one of its forwards runs, the tensor it
    received and the hidden state its forward handed to those modules."""

    def __init__(self, stage: int, model_name: str, first_block: nn.Module | None,
                 first_block_path: str, after_blocks: frozenset[str]) -> None:
        self.stage = stage
        self.model_name = model_name
        self.first_block = first_block
        self.first_block_path = first_block_path
        self.after_blocks = after_blocks
        self.received: torch.Tensor | None = None
        self.handed: torch.Tensor | None = None
        # The op names left out, once found (logged once).
        self.left_out_before: tuple[str, ...] | None = None
        self.left_out_after: tuple[str, ...] | None = None
        self._said = False

    def sends_hidden_state(self) -> bool:
        return bool(self.after_blocks)

    def say_once(self) -> None:
        """Log what this stage leaves to the stages that hold it (after its first
        forward found it)."""
        if self._said:
            return
        before, after = self.left_out_before or (), self.left_out_after or ()
        if not before and not after:
            return
        self._said = True
        from composer_par.plugin import get_logger

        get_logger(__name__).info(
            "pipeline stage runs the ops around the embedding and the head only where "
            "those modules are", stage=self.stage, model=self.model_name,
            left_out_before_first_block=list(before), left_out_after_last_block=list(after))


_current: StageBoundary | None = None


@contextlib.contextmanager
def running(boundary: StageBoundary | None, inputs: tuple[Any, ...]) -> Iterator[None]:
    """The scope of one forward of ``boundary``'s stage, given ``inputs`` (what torch's
    stage passes the module: the tensor received first, on a stage after the first)."""
    global _current
    before = _current
    if boundary is not None:
        boundary.handed = None
        first = inputs[0] if inputs else None
        boundary.received = first if boundary.first_block is not None and _is_tensor(
            first) else None
    _current = boundary
    try:
        yield
    finally:
        _current = before
        if boundary is not None:
            boundary.received = None


def note_handed(path: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A stand-in for ``path`` was called: the first time in a forward, on a stage that
    sends on its hidden state, the first argument is that hidden state."""
    boundary = _current
    if boundary is None or boundary.handed is not None or path not in boundary.after_blocks:
        return
    value = args[0] if args else next(iter(kwargs.values()), None)
    if not _is_tensor(value):
        raise BoundaryError(
            f"{boundary.model_name}'s forward hands {path} (on a later pipeline stage) a "
            f"{type(value).__name__}, not the hidden state: stage {boundary.stage} cannot "
            "tell what to send on",
            f"call {path} with the hidden state as its first argument, or give the stages "
            "explicit module lists (split) that keep it with the blocks before it")
    boundary.handed = value


def sent_hidden_state(boundary: StageBoundary | None, output: Any) -> Any:
    """What the stage sends on: the hidden state handed to the first module after the
    blocks (and the op names applied to it on the way to ``output``, noted once), or
    None when the forward called none of them (the output is the last block's)."""
    if boundary is None or boundary.handed is None:
        return None
    handed = boundary.handed
    boundary.handed = None
    if boundary.left_out_after is None:
        tensor = _first_tensor(output)
        boundary.left_out_after = tuple(ops_between(tensor, handed) or ()) \
            if tensor is not None else ()
    return handed


def first_block_pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                         ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Before a stage's first block: hand it the hidden state the stage received."""
    boundary = _current
    if boundary is None or boundary.first_block is not module or boundary.received is None:
        return None
    received = boundary.received
    boundary.received = None  # once per forward: a block called again is given its input
    if args:
        given, where = args[0], "args"
    elif "hidden_states" in kwargs:
        given, where = kwargs["hidden_states"], "hidden_states"
    else:
        given, where = None, ""
    if given is received:
        if boundary.left_out_before is None:
            boundary.left_out_before = ()
        return None
    ops = ops_between(given, received) if _is_tensor(given) else None
    if not _is_tensor(given) or tuple(given.shape) != tuple(received.shape):
        shown = f" ({', '.join(ops)})" if ops else ""
        what = (f"a tensor of shape {tuple(given.shape)}" if _is_tensor(given)
                else type(given).__name__)
        raise BoundaryError(
            f"{boundary.model_name}'s forward changes the hidden state stage "
            f"{boundary.stage} received (shape {tuple(received.shape)}) before its first "
            f"block {boundary.first_block_path}{shown}, which is given {what}: the stage "
            "cannot tell which part of that work belongs to the first stage",
            "keep what the forward does between the embedding and the first block inside "
            "a module (the embedding's own forward), or give the stages explicit module "
            "lists (split)")
    if boundary.left_out_before is None:
        boundary.left_out_before = tuple(ops or ())
    if given.dtype != received.dtype:
        # A data-parallel wrapper cast the block's inputs (mixed precision): cast alike.
        received = received.to(given.dtype)
    if where == "args":
        return (received, *args[1:]), kwargs
    return args, {**kwargs, where: received}


def install(first_block: nn.Module) -> Any:
    """The pre-hook on a stage's first block (before every later transform registers
    its own: it runs first)."""
    return first_block.register_forward_pre_hook(first_block_pre_hook, with_kwargs=True,
                                                 prepend=True)


_BACKWARD_SUFFIX = re.compile(r"Backward\d*$")


def ops_between(output: Any, source: Any, limit: int = 10_000) -> list[str] | None:
    """The ops the autograd graph records from ``source`` to ``output`` (op names, in
    forward order), or None when ``output`` does not derive from ``source`` (or grad is
    off)."""
    if not _is_tensor(output) or not _is_tensor(source):
        return None
    if output is source:
        return []
    start = output.grad_fn
    if start is None:
        return None
    target = source.grad_fn
    parents: dict[Any, Any] = {start: None}
    queue = [start]
    found = None
    while queue and len(parents) < limit:
        node = queue.pop(0)
        if (target is not None and node is target) or (
                target is None and getattr(node, "variable", None) is source):
            found = node
            break
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in parents:
                parents[nxt] = node
                queue.append(nxt)
    if found is None:
        return None
    names = []
    node = parents[found]
    while node is not None:
        names.append(_op_name(node))
        node = parents[node]
    return [n for n in names if n]


# Ops that move or view values without changing them (a slice of every position, a cast
# by a data-parallel wrapper): not named as work left out.
_LAYOUT_OPS = frozenset({"AccumulateGrad", "Alias", "AsStrided", "Clone", "Expand", "Permute",
                         "Reshape", "ReshapeAlias", "Select", "Slice", "Squeeze", "ToCopy",
                         "Transpose", "UnsafeView", "Unsqueeze", "View"})


def _op_name(node: Any) -> str:
    name = _BACKWARD_SUFFIX.sub("", type(node).__name__)
    return "" if name in _LAYOUT_OPS else name.lower()


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _first_tensor(output: Any) -> Any:
    from collections.abc import Mapping

    import torch

    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return next((v for v in output if isinstance(v, torch.Tensor)), None)
    return None


__all__ = ["BoundaryError", "StageBoundary", "first_block_pre_hook", "install", "note_handed",
           "ops_between", "running", "sent_hidden_state"]
