"""plan.apply vs the same torch calls written by hand, on 4 gloo ranks.

A 48-block Llama built on meta is sharded with FSDP2 and initialized layout-invariantly
(MetaInit). The hand-written side makes the same torch calls directly: fully_shard on
each block and the root, to_empty, then the same per-module full-tensor init and local
slicing, through the same helper the plan uses to keep a rank's part (so the ratio is
only what the plan adds: validation, hooks, block finding, logging). Two more arms: the
hand arm again as an arm of its own (hand_again: identical work, so hand_again / hand
shows the measurement's noise floor), and a hand loop slicing each parameter with
torch's ``distribute_tensor``, as one would write it without that helper (hand_dt).

    .venv/bin/python benchmarks/bench_apply.py [--blocks 48] [--repeats 96]
    .venv/bin/python benchmarks/bench_apply.py --instructions     # needs valgrind

Prints per rank the minima of each arm's CPU time and the median of the paired ratios
(one repeat's plan against the same repeat's hand; target <= 1.05 on the worst rank),
the same for hand_again / hand, and all ranks' paired ratios pooled with a 95 % bootstrap
interval. The ranks take turns: one rank runs an arm while the others wait in a barrier
(apply makes no collective), so no rank is timed beside another's work. Before each
arm the garbage collector runs and the C heap gives its free memory back (an arm runs
slower after some arms than after others otherwise: 10 % after hand_dt, measured), and
the arms' order follows a Williams square, so each arm follows each other arm equally
often.

On a shared machine single runs of the same arm vary by a third, and hand_again / hand
shows how far two arms doing the same work stray apart.
``--instructions`` counts the instructions each arm executes instead, under valgrind's
cachegrind (deterministic: hash seed fixed, one thread, garbage collector off while the
arms run): one process as rank 0 of a fake process group of ``--ranks`` ranks, which
runs the code every rank runs (apply does no collective here, and no rank takes another
path). Three processes, run two at a time: imports and one warm-up of both arms, then
``--repeats`` applies by plan, or by hand, or neither (the model builds alone); the
counts' differences give each arm's instructions per apply, and the ratio plan / hand.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from statistics import median

TARGET = 1.05


class _Clock:
    """Wall time and this process's CPU time. With 4 ranks on a shared 2-core machine the
    wall time is mostly waiting (for peers, for other programs); the CPU time is the work
    each side does, which is what the plan could add."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def _build(blocks: int):
    import torch

    from composer_par.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(dim=64, n_layers=blocks, n_heads=4, n_kv_heads=2, ffn_hidden=128)
    with torch.device("meta"):
        return Llama(cfg)


def _by_plan(blocks: int) -> tuple[float, float]:
    import torch.distributed as dist

    from composer_par import FSDP2, MeshSpec, MetaInit, ParallelPlan

    model = _build(blocks)
    clock = _Clock()
    plan = ParallelPlan(MeshSpec(dp_shard=dist.get_world_size()))
    plan.use(FSDP2(blocks="layers")).use(MetaInit(seed=0)).apply(model)
    return clock.stop()


def _by_hand(blocks: int, fast_slicing: bool) -> tuple[float, float]:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    from composer_par.plugin.initialize import keep_local_part, module_seed, post_order

    model = _build(blocks)
    clock = _Clock()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    for path, module in post_order(model):
        if not hasattr(module, "reset_parameters"):
            continue
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(module_seed(0, path))
            saved = {n: p for n, p in module._parameters.items() if p is not None}
            for name, param in saved.items():
                module._parameters[name] = nn.Parameter(torch.empty(param.shape))
            with torch.no_grad():
                module.reset_parameters()
                for name, param in saved.items():
                    full = module._parameters[name]
                    module._parameters[name] = param
                    if isinstance(param, DTensor):
                        if fast_slicing:
                            keep_local_part(param, full)
                        else:
                            local = distribute_tensor(full, param.device_mesh,
                                                      param.placements,
                                                      src_data_rank=None).to_local()
                            param.to_local().copy_(local)
    return clock.stop()


Times = list[tuple[float, float]]
# hand_again: the hand arm a second time, as an arm of its own. hand_again / hand is what
# this measurement reports for two arms doing the same work: its noise floor.
# hand_dt: the hand loop slicing with distribute_tensor.
ARMS = ("plan", "hand", "hand_again", "hand_dt")
# The order of the arms in each repeat, cycling through a Williams square: over 4 repeats
# each arm runs right after each other arm once. An arm runs measurably slower after some
# arms than after others (after hand_dt, 10 % slower, measured), so a plain rotation,
# which has one arm follow the same arm in most repeats, would bias their ratio.
ORDERS = ((0, 1, 3, 2), (1, 2, 0, 3), (2, 3, 1, 0), (3, 0, 2, 1))


def _heap_reset() -> Callable[[], None]:
    """A call that gives the C heap's free memory back to the system (glibc's
    malloc_trim), so that every arm starts from the same heap: the memory the previous
    arm's model freed otherwise stays in the allocator's bins, in a state that depends on
    which arm ran, and the next arm's allocations pay for it (the carry-over measured
    above). A no-op where the C library has no malloc_trim."""
    import ctypes
    import ctypes.util

    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda: None

    def reset() -> None:
        trim(0)

    return reset


def _rank_main(blocks: int, repeats: int) -> dict[str, Times]:
    import structlog
    import torch.distributed as dist

    # Logging is part of what the plan does, but printing 4 ranks' lines to a terminal
    # would time the terminal: keep the events, drop the output.
    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    runs = {
        "plan": lambda: _by_plan(blocks),
        "hand": lambda: _by_hand(blocks, fast_slicing=True),
        "hand_again": lambda: _by_hand(blocks, fast_slicing=True),
        "hand_dt": lambda: _by_hand(blocks, fast_slicing=False),
    }
    for run in runs.values():  # warm-up: first-call imports and caches
        run()
    reset = _heap_reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    times: dict[str, Times] = {arm: [] for arm in ARMS}
    for repeat in range(repeats):
        # Interleaved, so machine noise hits every arm alike, in balanced orders (ORDERS).
        # The cyclic garbage collector is run before each arm and kept off while it runs
        # (as timeit does): the models of earlier arms hold reference cycles (FSDP's
        # states), and freeing them would otherwise land on whichever arm happened to
        # cross gc's threshold.
        for arm in (ARMS[i] for i in ORDERS[repeat % len(ORDERS)]):
            # The ranks take turns: one rank runs the arm while the others wait in the
            # barrier (gloo's wait sleeps: a waiting rank uses under 1 % of a core,
            # measured). apply makes no collective, so a rank can apply alone, and it is
            # then timed on a machine its peers leave quiet. Run together, 4 ranks on 2
            # cores time each other's cache and core sharing, which differs from arm to
            # arm as the ranks drift apart, and identical arms read up to 14 % apart on
            # the worst rank (measured).
            for turn in range(world):
                if turn == rank:
                    gc.collect()
                    reset()
                    gc.disable()
                    try:
                        times[arm].append(runs[arm]())
                    finally:
                        gc.enable()
                dist.barrier()
    return times


def _paired(results: list[dict[str, Times]], arm: str, base: str) -> list[list[float]]:
    """Per rank, each repeat's CPU-time ratio arm / base (the two ran back to back, so a
    repeat's ratio sees one machine state on both sides)."""
    return [[a[1] / b[1] for a, b in zip(times[arm], times[base], strict=True)]
            for times in results]


def _pooled(paired: list[list[float]], draws: int = 2000) -> tuple[float, float, float]:
    """The median of every rank's paired ratios together, and a 95 % bootstrap interval
    of it. Repeats are resampled whole (all ranks' ratios of a repeat together): the
    ranks of one repeat share the machine's state, so their ratios are not independent.
    Every rank runs the same code (FSDP2 over one mesh dim: no rank takes another path),
    so each rank's ratio estimates the same quantity."""
    import random

    rng = random.Random(0)
    repeats = len(paired[0])
    by_repeat = [[rank[r] for rank in paired] for r in range(repeats)]
    estimate = median([x for row in by_repeat for x in row])
    medians = sorted(
        median([x for _ in range(repeats) for x in by_repeat[rng.randrange(repeats)]])
        for _ in range(draws))
    return estimate, medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


COUNTED = ("plan", "hand", "none")


def _counted_arm(arm: str, blocks: int, repeats: int, ranks: int) -> None:
    """What one counted process runs (under cachegrind): see the module's docstring."""
    import structlog
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=ranks, store=FakeStore())
    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    _by_plan(blocks)
    _by_hand(blocks, fast_slicing=True)
    gc.collect()
    gc.disable()
    for _ in range(repeats):
        if arm == "plan":
            _by_plan(blocks)
        elif arm == "hand":
            _by_hand(blocks, fast_slicing=True)
        else:
            _build(blocks)


def _count_instructions(args: argparse.Namespace) -> int:
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    if shutil.which("valgrind") is None:
        print("--instructions needs valgrind (its cachegrind tool) on PATH", file=sys.stderr)
        return 2
    # One thread for torch's and any BLAS library's pools: a worker thread spinning while
    # it waits for work executes instructions too, a varying number from run to run
    # (tens of millions of them per apply, measured), which would swamp the difference
    # counted. The ranks of a job run with one thread each as well (run_ranks, torchrun).
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        def count(arm: str) -> int:
            out = Path(tmp) / f"{arm}.out"
            subprocess.run(
                ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--branch-sim=no",
                 f"--cachegrind-out-file={out}", sys.executable, __file__, "--counted-arm",
                 arm, "--blocks", str(args.blocks), "--repeats", str(args.repeats),
                 "--ranks", str(args.ranks)],
                env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            summary = next(line for line in out.read_text().splitlines()
                           if line.startswith("summary:"))
            return int(summary.split()[1])

        print(f"counting instructions under cachegrind: {args.blocks} blocks, rank 0 of "
              f"{args.ranks}, {args.repeats} applies per arm (a few minutes) ...",
              file=sys.stderr)
        with ThreadPoolExecutor(2) as pool:
            totals = dict(zip(COUNTED, pool.map(count, COUNTED), strict=True))
    plan = (totals["plan"] - totals["none"]) / args.repeats
    hand = (totals["hand"] - totals["none"]) / args.repeats
    print(f"plan.apply vs hand-written torch calls: instructions per apply, {args.blocks} "
          f"blocks, rank 0 of {args.ranks}")
    print(f"  plan {plan / 1e6:8.1f} M   hand {hand / 1e6:8.1f} M   plan adds "
          f"{(plan - hand) / 1e6:.1f} M")
    ratio = plan / hand
    print(f"ratio plan/hand, instructions: {ratio:.3f} -> "
          f"{'meets' if ratio <= TARGET else 'MISSES'} the target <= {TARGET}")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=None,
                        help="applies per arm (default 96 timed, about 7 minutes; 4 counted)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions under valgrind instead of timing 4 ranks")
    parser.add_argument("--counted-arm", choices=COUNTED, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 4 if args.instructions or args.counted_arm else 96
    if args.counted_arm:
        _counted_arm(args.counted_arm, args.blocks, args.repeats, args.ranks)
        return
    if args.instructions:
        raise SystemExit(_count_instructions(args))

    from composer_par.testing.distributed import run_ranks

    # By name: rank processes import this file as a module (its folder is on sys.path).
    results = run_ranks("bench_apply:_rank_main", args.ranks, args=(args.blocks, args.repeats),
                        timeout=1800)
    print(f"plan.apply vs hand-written torch calls: {args.blocks} blocks, {args.ranks} ranks, "
          f"{args.repeats} interleaved repeats; CPU time of each arm on each rank")
    print("  hand: the same slicing helper the plan uses; hand_again: the hand arm again, "
          "as its own arm (the noise floor: two arms doing the same work); hand_dt: "
          "slicing each parameter with torch's distribute_tensor")
    plan_pairs = _paired(results, "plan", "hand")
    again_pairs = _paired(results, "hand_again", "hand")
    dt_pairs = _paired(results, "plan", "hand_dt")
    for rank, times in enumerate(results):
        best = {arm: min(t[1] for t in times[arm]) for arm in ARMS}
        print(f"  rank {rank}:  minima: plan {best['plan'] * 1000:6.1f} ms  hand "
              f"{best['hand'] * 1000:6.1f} ms  hand_dt {best['hand_dt'] * 1000:6.1f} ms   "
              f"paired medians: plan/hand {median(plan_pairs[rank]):.3f}  "
              f"hand_again/hand {median(again_pairs[rank]):.3f}  "
              f"plan/hand_dt {median(dt_pairs[rank]):.3f}")
    worst = max(median(r) for r in plan_pairs)
    worst_again = max(median(r) for r in again_pairs)
    pooled, low, high = _pooled(plan_pairs)
    floor, floor_low, floor_high = _pooled(again_pairs)
    print(f"all ranks' paired ratios together (median, 95 % interval over repeats): "
          f"plan/hand {pooled:.3f} [{low:.3f}, {high:.3f}]; hand_again/hand {floor:.3f} "
          f"[{floor_low:.3f}, {floor_high:.3f}]")
    verdict = "meets" if worst <= TARGET else "MISSES"
    print(f"ratio plan/hand, worst rank's paired median: {worst:.3f} -> {verdict} the target "
          f"<= {TARGET}; the same figure for hand_again/hand (identical work): "
          f"{worst_again:.3f}")


if __name__ == "__main__":
    main()
