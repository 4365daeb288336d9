"""A pipeline schedule as a timeline: which rank runs which stage's forward or backward of
which microbatch, at each tick of one step.

The order of each rank's actions is torch's own: the multi-stage schedules execute their
``pipeline_order`` (read from the schedule class, built over stand-in stages, no process
group), and the single-stage ones follow their loops (GPipe: every forward, then every
backward; 1F1B: ``pp - rank`` forwards of warm-up, then one backward and one forward
in turn). Times come from running those orders against the data dependencies (a
microbatch's forward on stage ``s`` needs it on ``s - 1``; its backward needs the one
of ``s + 1``, or on the last stage its forward), with a forward taking one tick, a full
backward two, and an input or weight backward one each; sends take no time. The bubble
is the idle share of ``ranks x ticks``.

Imports torch (the schedule classes) when called: the plugin calls it for ``explain``
only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from composer_par.plugin import torch_private
from composer_par.plugin.pipeline import Timeline, TimelineAction

from .schedules import SCHEDULES, placement

COST = {"F": 1, "B": 2, "I": 1, "W": 1}

Step = tuple[tuple[str, int, int], ...]  # (kind, stage, microbatch) run as one action


def _single_stage_order(schedule: str, rank: int, pp: int, microbatches: int) -> list[Step]:
    forwards: list[Step] = [(("F", rank, m),) for m in range(microbatches)]
    backwards: list[Step] = [(("B", rank, m),) for m in range(microbatches)]
    if schedule == "GPipe":
        return forwards + backwards
    warmup = min(microbatches, pp - rank)
    order = forwards[:warmup]
    for index, backward in enumerate(backwards):
        order.append(backward)
        if warmup + index < microbatches:
            order.append(forwards[warmup + index])
    return order


class _Stand:
    """What a torch schedule constructor reads of a stage, without a process group."""

    def __init__(self, index: int, num_stages: int, pp: int) -> None:
        import torch.nn as nn

        self.stage_index, self.num_stages = index, num_stages
        self.group_size, self.group_rank = pp, 0
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod = nn.Identity()


def _multi_stage_orders(schedule: str, pp: int, per_rank: int, microbatches: int
                        ) -> list[list[Step]]:
    from torch.distributed.pipelining.schedules import get_schedule_class

    info = SCHEDULES[schedule]
    num_stages = pp * per_rank
    layout = placement(pp, num_stages, info.style)
    stand_ins: Any = [_Stand(s, num_stages, pp) for s in layout[0]]
    built = get_schedule_class(schedule)(stand_ins, microbatches)
    orders: list[list[Step]] = []
    for actions in torch_private.schedule_actions(built, lowered=False):
        steps: list[Step] = []
        for action in actions:
            step = tuple(s for s in (_kind(*part) for part in action) if s is not None)
            if step:
                steps.append(step)
        orders.append(steps)
    return orders


def _kind(name: str, stage: int, microbatch: int | None) -> tuple[str, int, int] | None:
    kind = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I",
            "BACKWARD_WEIGHT": "W"}.get(name)
    if kind is None or microbatch is None:
        return None  # communication, gradient reduction, resharding
    return kind, stage, microbatch


def rank_orders(schedule: str, pp: int, per_rank: int, microbatches: int
                ) -> list[list[Step]]:
    """Each pp rank's actions in the order torch runs them."""
    if SCHEDULES[schedule].multi:
        return _multi_stage_orders(schedule, pp, per_rank, microbatches)
    return [_single_stage_order(schedule, r, pp, microbatches) for r in range(pp)]


def simulate(orders: Sequence[Sequence[Step]], num_stages: int) -> list[list[TimelineAction]]:
    """Start and end ticks of every action, each rank running its order as soon as the
    data its next action needs is there."""
    done: dict[tuple[str, int, int], int] = {}
    free = [0] * len(orders)
    position = [0] * len(orders)
    out: list[list[TimelineAction]] = [[] for _ in orders]

    def ready(kind: str, stage: int, mb: int) -> int | None:
        if kind == "F":
            need = [("F", stage - 1, mb)] if stage > 0 else []
        elif kind in ("B", "I"):
            need = ([("F", stage, mb)] if stage == num_stages - 1
                    else [("I", stage + 1, mb)])
        else:
            need = [("I", stage, mb)]
        if any(n not in done for n in need):
            return None
        return max([0, *(done[n] for n in need)])

    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                step = order[position[rank]]
                # Within one step (an overlapped forward and backward) nothing waits on
                # the other half.
                starts = [ready(kind, stage, mb) for kind, stage, mb in step]
                known = [s for s in starts if s is not None]
                if len(known) < len(starts):
                    break
                start = max([free[rank], *known])
                end = start + sum(COST[kind] for kind, _, _ in step)
                for kind, stage, mb in step:
                    done[(kind, stage, mb)] = end
                    if kind == "B":  # a full backward is the input and the weight backward
                        done[("I", stage, mb)] = done[("W", stage, mb)] = end
                out[rank].append(TimelineAction(start, end, tuple(step)))
                free[rank] = end
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [order[position[r]] for r, order in enumerate(orders)
                     if position[r] < len(order)]
            raise RuntimeError(f"the schedule's order waits on itself at {stuck}")
    return out


def timeline(schedule: str, pp: int, per_rank: int, microbatches: int, dim: str = "pp"
             ) -> Timeline:
    """One step of ``schedule`` over ``pp`` ranks as a :class:`Timeline`."""
    orders = rank_orders(schedule, pp, per_rank, microbatches)
    actions = simulate(orders, pp * per_rank)
    length = max((a.end for row in actions for a in row), default=0)
    busy = sum(a.end - a.start for row in actions for a in row)
    bubble = 1.0 - busy / (pp * length) if length else 0.0
    return Timeline(
        title=f"{schedule}, {pp * per_rank} stages over {dim}({pp}), {microbatches} "
              "microbatches",
        rows=tuple(f"{dim} {r}" for r in range(pp)),
        actions=tuple(tuple(row) for row in actions),
        length=length, bubble=bubble,
        note="one tick: a forward; a full backward takes two, an input or weight "
             "backward one; sends take none")


def peak_in_flight(line: Timeline) -> tuple[int, ...]:
    """Per rank, the most (stage, microbatch) activations held at once: from the end of a
    forward to the end of its backward (the weight backward, when split). What the
    activation memory of a pipeline rank scales with, schedule by schedule."""
    peaks = []
    for row in line.actions:
        events: list[tuple[int, int]] = []
        for action in row:
            for kind, _, _ in action.runs:
                if kind == "F":
                    events.append((action.end, 1))
                elif kind in ("B", "W"):
                    events.append((action.end, -1))
        held = peak = 0
        for _, change in sorted(events, key=lambda e: (e[0], e[1])):
            held += change
            peak = max(peak, held)
        peaks.append(peak)
    return tuple(peaks)


def theoretical_bubble(schedule: str, pp: int, per_rank: int, microbatches: int) -> float:
    """The textbook idle fraction of a step: (pp - 1) / (v m + pp - 1) for GPipe and
    1F1B (v = 1) and the interleaved and looped schedules (v stages per rank), computed
    on the same ticks as :func:`timeline`; the zero-bubble family's is the measured
    timeline's (no closed form holds across pp, v and m)."""
    if SCHEDULES[schedule].split_backward:
        return timeline(schedule, pp, per_rank, microbatches).bubble
    v = per_rank if SCHEDULES[schedule].multi else 1
    return (pp - 1) / (v * microbatches + pp - 1)


__all__ = ["COST", "peak_in_flight", "rank_orders", "simulate", "theoretical_bubble",
           "timeline"]
