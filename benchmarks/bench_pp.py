"""Pipeline schedules: the measured bubble against the theoretical one, and a plan's step
against the same schedule written by hand with torch calls.

The model is a stack of *sleeping* blocks: each forward sleeps ``--tick`` ms, each
backward ``--tick`` ms for the input gradient and ``--tick`` ms for the weight gradient
(separate autograd nodes, so a zero-bubble schedule's input and weight passes take one
tick each, and a full backward two). A sleeping rank uses no CPU, so 4 ranks on a small
machine overlap as they would on 4 devices, and the time a step takes is the schedule's
shape: its length in ticks plus what the pipeline machinery costs.

1. Bubble: on 4 ranks, each schedule (8 stages for the multi-stage ones) runs steps of
   ``--microbatches``. Measured bubble = 1 - (sleep each rank must do) / (step time);
   theoretical = (pp - 1) / (v m + pp - 1) for the full-backward schedules, the tick
   simulation of ``explain``'s timeline for the zero-bubble family (no closed form).
   Printed with their ratio (measured also pays sends and Python between actions).
2. Plan vs hand: the same schedule over the same stack, once through ``plan.apply`` and
   ``plan.training_step`` (PP + MetaInit), once with ``PipelineStage`` and the schedule
   class by hand; steps interleaved, alternating which goes first. Target: the ratio of
   minima plan / hand <= 1.02.

    .venv/bin/python benchmarks/bench_pp.py [--tick 15] [--microbatches 8] [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

TARGET = 1.02
RANKS = 4
WIDTH = 16
# schedule -> stages per rank
SCHEDULES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "LoopedBFS": 2,
             "InterleavedZeroBubble": 2, "ZBVZeroBubble": 2, "DualPipeV": 2}


def _sleeping_stack(blocks: int, tick: float) -> Any:
    import torch
    import torch.nn as nn

    class Sleep(torch.autograd.Function):
        """Sleeps ``forward_s`` in forward and ``backward_s`` in backward."""

        @staticmethod
        def forward(ctx: Any, x: Any, forward_s: float, backward_s: float) -> Any:
            ctx.backward_s = backward_s
            time.sleep(forward_s)
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            time.sleep(ctx.backward_s)
            return grad, None, None

    class SleepingBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(WIDTH))
            self.reset_parameters()

        def reset_parameters(self) -> None:
            nn.init.ones_(self.weight)

        def forward(self, x: Any) -> Any:
            # The input path and the weight path are separate nodes: a schedule that
            # splits the backward runs one tick in each pass.
            h = Sleep.apply(x, tick, tick)
            return h * Sleep.apply(self.weight, 0.0, tick)

    return nn.Sequential(*(SleepingBlock() for _ in range(blocks)))


def _loss(outputs: Any, targets: Any) -> Any:
    return ((outputs - targets) ** 2).mean()


def _plan_step(schedule: str, per_rank: int, microbatches: int, tick: float) -> Any:
    import torch

    from composer_par import PP, MeshSpec, MetaInit, ParallelPlan

    plan = ParallelPlan(MeshSpec(pp=RANKS)).use(
        PP(schedule=schedule, stages_per_rank=per_rank, microbatches=microbatches)).use(
        MetaInit(seed=0))
    with torch.device("meta"):
        model = _sleeping_stack(RANKS * per_rank, tick)
    model = plan.apply(model)
    step = plan.training_step(model, _loss)
    return lambda x: step.step(x, x)


def _hand_step(schedule: str, per_rank: int, microbatches: int, tick: float) -> Any:
    """The schedule written with torch calls: this rank's blocks as Sequentials, one
    PipelineStage each, the schedule class over them."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleSingle,
        get_schedule_class,
    )

    num_stages = RANKS * per_rank
    rank = dist.get_rank()
    v_shape = schedule in ("ZBVZeroBubble", "DualPipeV")
    mine = ([rank, 2 * RANKS - 1 - rank] if v_shape
            else list(range(rank, num_stages, RANKS)))
    stack = _sleeping_stack(num_stages, tick)
    stages = [PipelineStage(nn.Sequential(stack[s]), s, num_stages, torch.device("cpu"))
              for s in mine]
    cls = get_schedule_class(schedule)
    sched = (cls(stages[0], microbatches, loss_fn=_loss)
             if issubclass(cls, PipelineScheduleSingle)
             else cls(stages, microbatches, loss_fn=_loss))
    first, last = 0 in mine, num_stages - 1 in mine

    def step(x: Any) -> None:
        losses: list[Any] = []
        sched.step(*((x,) if first else ()), target=x if last else None,
                   losses=losses if last else None, return_outputs=False)

    return step


def _timed(fn: Any, x: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    fn(x)
    return time.perf_counter() - started


def _rank_main(microbatches: int, tick_ms: float, repeats: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    tick = tick_ms / 1000
    x = torch.randn(microbatches * 2, WIDTH)
    out: dict[str, Any] = {}
    for schedule, per_rank in SCHEDULES.items():
        plan_fn = _plan_step(schedule, per_rank, microbatches, tick)
        hand_fn = _hand_step(schedule, per_rank, microbatches, tick)
        for fn in (plan_fn, hand_fn):  # the first step also infers the stages' shapes
            _timed(fn, x)
        plan_times, hand_times = [], []
        for repeat in range(repeats):
            pair = [(plan_fn, plan_times), (hand_fn, hand_times)]
            for fn, times in (pair if repeat % 2 == 0 else pair[::-1]):
                times.append(_timed(fn, x))
        out[schedule] = (plan_times, hand_times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tick", type=float, default=15.0, help="ms per forward block")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    from composer_par.plugins.pp.timeline import theoretical_bubble, timeline

    from composer_par.testing.distributed import run_ranks

    load_before = os.getloadavg()
    # By name: rank processes import this file as a module (its folder is on sys.path).
    results = run_ranks("bench_pp:_rank_main", RANKS,
                        args=(args.microbatches, args.tick, args.repeats), timeout=1800)
    load_after = os.getloadavg()
    m, tick = args.microbatches, args.tick / 1000
    print(f"pipeline schedules on {RANKS} gloo ranks, {m} microbatches, sleeping blocks of "
          f"{args.tick:g} ms per tick ({os.cpu_count()} cores; load average "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after)")
    print(f"  {'schedule':22s} {'bubble':>8s} {'theory':>8s} {'ratio':>6s} "
          f"{'timeline':>9s}   {'plan min':>9s} {'hand min':>9s} {'ratio':>6s}   "
          f"{'plan med':>9s} {'hand med':>9s}")
    worst = 0.0
    for schedule, per_rank in SCHEDULES.items():
        # A step is as long as its slowest rank's.
        plan = [max(r[schedule][0][i] for r in results) for i in range(args.repeats)]
        hand = [max(r[schedule][1][i] for r in results) for i in range(args.repeats)]
        work = per_rank * m * 3 * tick  # each block: 1 tick forward, 2 backward
        measured = 1 - work / min(plan)
        theory = theoretical_bubble(schedule, RANKS, per_rank, m)
        simulated = timeline(schedule, RANKS, per_rank, m).bubble
        ratio = min(plan) / min(hand)
        worst = max(worst, ratio)
        print(f"  {schedule:22s} {measured:8.1%} {theory:8.1%} {measured / theory:6.2f} "
              f"{simulated:9.1%}   {min(plan) * 1e3:7.1f}ms {min(hand) * 1e3:7.1f}ms "
              f"{ratio:6.3f}   {statistics.median(plan) * 1e3:7.1f}ms "
              f"{statistics.median(hand) * 1e3:7.1f}ms")
    verdict = "meets" if worst <= TARGET else "MISSES"
    print(f"worst ratio plan/hand (minima): {worst:.3f} -> {verdict} the target <= {TARGET}")


if __name__ == "__main__":
    main()
