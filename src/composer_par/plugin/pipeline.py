"""What a pipeline-splitting plugin hands the plan: :class:`Pipeline`, of :class:`StagePart`.

The ``pipeline_split`` stage cuts the model into pipeline stages and keeps this rank's
ones. It records them in ``ctx.pipeline``; every later stage (tensor parallel,
activation checkpointing, compile, data parallel, materialize, finalize) then runs once
per local part, with ``ctx.model`` and ``ctx.blocks`` set to that part's. After apply the
plan exposes the same object as ``plan.pipeline``, and the training step
(:mod:`composer_par.training`) runs the pipeline schedule through it.

These are plain value types: no torch import, no knowledge of any plugin.
:func:`aux_losses_paused`, :func:`carries` and :func:`stage_carry` (from
:mod:`composer_par.aux_loss`) are for a splitter's stage runtime: a forward it runs that
is no microbatch of the step (torch's shape inference) must add no auxiliary loss to the
step, and a model that carries loss statistics between stages is given what the
previous stage sent and sends on what it leaves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.aux_loss import aux_losses_paused, carries, stage_carry

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.blocks import Block


@attrs.define(eq=False)
class StagePart:
    """One pipeline stage held by this rank: its index, its root module, its blocks.

    ``module`` runs the stage's forward: the model's own forward, with the modules of
    other stages removed. ``modules`` names what it owns (module paths of the model).
    """

    stage: int
    module: nn.Module
    blocks: list[Block]
    modules: tuple[str, ...]


@attrs.define(eq=False)
class Pipeline:
    """This rank's view of the pipeline: the split, the placement, its parts, the schedule.

    ``split[s]`` lists the module paths stage ``s`` owns; ``placement[r]`` the stages pp
    rank ``r`` holds, in execution order. ``build_schedule(loss_fn, count=microbatches)``
    returns the torch schedule over the local parts, running ``count`` microbatches a step
    (``loss_fn(outputs, targets)`` gives a microbatch's mean loss, ``outputs`` being what
    the model's forward returned on the last stage for the microbatch: the same kind of
    object as without a pipeline, not the tensors the stage sends); it raises when the
    schedule cannot run ``count``. ``check_batch(size)`` raises, naming both numbers,
    when a per-rank batch of ``size`` samples cannot be cut into ``microbatches``.
    """

    dim: str  # the mesh dim the stages lie along
    size: int  # ranks along it
    rank: int  # this rank's coordinate on it
    schedule: str  # torch's name of the schedule class
    microbatches: int
    split: tuple[tuple[str, ...], ...]
    placement: tuple[tuple[int, ...], ...]
    parts: list[StagePart]
    build_schedule: Callable[..., Any]
    check_batch: Callable[[int], None]
    stage_params: tuple[int, ...] = ()  # parameters of each stage (tied counted once)
    # Every state-dict key (clean names, in state-dict order) of the whole model before
    # the split, every stage's: weights checks count a key another stage holds as the
    # model's, not as unexpected, and an export writes the model's order. Empty when the
    # splitter does not say.
    model_keys: tuple[str, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.split)

    @property
    def local_stages(self) -> tuple[int, ...]:
        return tuple(part.stage for part in self.parts)

    @property
    def has_first(self) -> bool:
        """This rank runs stage 0: it is given the inputs."""
        return 0 in self.local_stages

    @property
    def has_last(self) -> bool:
        """This rank runs the last stage: it computes the loss from the targets."""
        return self.num_stages - 1 in self.local_stages


@attrs.frozen
class TimelineAction:
    """One action of a rank: from tick ``start`` to ``end``, the ``(kind, stage,
    microbatch)`` it runs (kind: "F" forward, "B" full backward, "I" input backward, "W"
    weight backward; two when a schedule overlaps a forward with a backward)."""

    start: int
    end: int
    runs: tuple[tuple[str, int, int], ...]

    @property
    def label(self) -> str:
        """torch's notation: stage, kind, microbatch (``2F3``); ``+`` joins an overlap."""
        return "+".join(f"{stage}{kind}{mb}" for kind, stage, mb in self.runs)


@attrs.frozen
class Timeline:
    """What each rank does at each tick of one step (a pipeline schedule), for
    ``explain``: rows of actions, the step's length in ticks, and its idle share."""

    title: str
    rows: tuple[str, ...]  # row labels, e.g. "pp 0"
    actions: tuple[tuple[TimelineAction, ...], ...]  # per row, in time order
    length: int
    bubble: float  # idle ticks / (rows x length)
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "length": self.length, "bubble": round(self.bubble, 4),
                "note": self.note,
                "rows": [{"label": label, "actions": [
                    {"start": a.start, "end": a.end, "label": a.label} for a in row]}
                    for label, row in zip(self.rows, self.actions, strict=True)]}


__all__ = ["Pipeline", "StagePart", "Timeline", "TimelineAction", "aux_losses_paused", "carries",
           "stage_carry"]
