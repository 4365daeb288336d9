"""torch's pipeline schedules by name, and what each needs (no torch import).

Names are torch's (``torch.distributed.pipelining.schedules.get_schedule_class``),
matched case-insensitively. The constraints below are the ones torch 2.13's schedule
constructors enforce, checked here before any process starts.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class ScheduleInfo:
    name: str  # torch's name
    multi: bool  # takes a list of stages per rank (else exactly one)
    style: str  # stage placement: "loop" (rank r: r, r + pp, ...) or "v"
    # Backward split into input and weight gradients (zero-bubble family): torch refuses
    # compiled stage modules for these.
    split_backward: bool = False
    # The number of stages per rank the schedule takes, when it takes exactly one value.
    stages_per_rank: int | None = None
    # Needs at least as many microbatches as pipeline stages.
    microbatches_at_least_stages: bool = False
    # Cuts microbatches into rounds of pp size: needs microbatches % rounds == 0.
    rounds: bool = False
    # Has actions that pair one microbatch's forward with another's backward.
    overlaps: bool = False
    summary: str = ""


SCHEDULES: dict[str, ScheduleInfo] = {
    s.name: s
    for s in [
        ScheduleInfo("GPipe", multi=False, style="loop", stages_per_rank=1,
                     summary="all forwards, then all backwards (fill-drain)"),
        ScheduleInfo("1F1B", multi=False, style="loop", stages_per_rank=1,
                     microbatches_at_least_stages=True,
                     summary="one forward, one backward in the steady state"),
        ScheduleInfo("Interleaved1F1B", multi=True, style="loop", rounds=True,
                     summary="1F1B over several looped stages per rank"),
        ScheduleInfo("LoopedBFS", multi=True, style="loop",
                     summary="breadth-first over looped stages: earlier stages first"),
        ScheduleInfo("InterleavedZeroBubble", multi=True, style="loop", split_backward=True,
                     rounds=True,
                     summary="interleaved 1F1B with input and weight backward split"),
        ScheduleInfo("ZBVZeroBubble", multi=True, style="v", split_backward=True,
                     stages_per_rank=2,
                     summary="zero bubble on a V-shaped placement of two stages per rank"),
        ScheduleInfo("DualPipeV", multi=True, style="v", split_backward=True,
                     stages_per_rank=2, microbatches_at_least_stages=True, overlaps=True,
                     summary="DualPipe on a V-shaped placement of two stages per rank"),
    ]
}
_BY_LOWER = {name.lower(): name for name in SCHEDULES}


def canonical(name: str) -> str | None:
    """torch's spelling of a schedule name given in any case, or None if unknown."""
    return _BY_LOWER.get(name.lower()) if isinstance(name, str) else None


def placement(pp: int, num_stages: int, style: str) -> tuple[tuple[int, ...], ...]:
    """The stages each pp rank holds, in order, as torch places them.

    ``loop``: stage ``s`` on rank ``s % pp``. ``v``: down the ranks and back up, so rank
    0 holds the first and the last stage (torch's ``generate_stage_to_rank_mapping``).
    """
    ranks: list[list[int]] = [[] for _ in range(pp)]
    for stage in range(num_stages):
        if style == "v":
            lap, offset = divmod(stage, pp)
            rank = offset if lap % 2 == 0 else pp - 1 - offset
        else:
            rank = stage % pp
        ranks[rank].append(stage)
    return tuple(tuple(r) for r in ranks)


def microbatch_problem(info: ScheduleInfo, microbatches: int, pp: int,
                       stages_per_rank: int) -> str | None:
    """Why ``info`` cannot run ``microbatches`` over ``pp`` ranks, or None."""
    stages = pp * stages_per_rank
    if info.microbatches_at_least_stages and microbatches < stages:
        return (f"{info.name} needs at least as many microbatches as pipeline stages: "
                f"microbatches = {microbatches} < {stages} stages")
    if info.rounds:
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            return (f"{info.name} runs microbatches in rounds of pp size: microbatches = "
                    f"{microbatches} over pp({pp}) makes {rounds} round(s), which do not "
                    f"divide {microbatches}")
    return None


def fitting_microbatches(info: ScheduleInfo, pp: int, stages_per_rank: int,
                         at_least: int) -> int:
    """The smallest microbatch count >= ``at_least`` that ``info`` accepts."""
    count = max(1, at_least)
    while microbatch_problem(info, count, pp, stages_per_rank) is not None:
        count += 1
    return count


__all__ = ["SCHEDULES", "ScheduleInfo", "canonical", "fitting_microbatches",
           "microbatch_problem", "placement"]
