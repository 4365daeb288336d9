"""plan.apply vs the same torch calls written by hand, on 4 gloo ranks.

A 48-block Llama built on meta is sharded with FSDP2 and initialized layout-invariantly
(MetaInit). The hand-written side makes the same torch calls directly: fully_shard on
each block and the root, to_empty, then the same per-module full-tensor init and local
slicing, through the same helper the plan uses to keep a rank's part (so the ratio is
only what the plan adds: validation, hooks, block finding, logging); a third arm slices
each parameter with torch's ``distribute_tensor`` instead, as a hand-written loop would
without that helper.

    .venv/bin/python benchmarks/bench_apply.py [--blocks 48] [--repeats 11]
    .venv/bin/python benchmarks/bench_apply.py --instructions     # needs valgrind

Prints per-rank minima of wall and CPU time, the ratios plan / hand of the minima, and
the median of each rank's paired ratios (one repeat's plan against the same repeat's
hand; target <= 1.05 on the worst rank). Every rank starts each arm together.

On a shared machine (4 ranks on 2 cores here) single runs of the same arm vary by a third,
so CPU-time ratios of a few percent cannot be told from noise. ``--instructions`` counts
the instructions each arm executes instead, under valgrind's cachegrind (deterministic:
hash seed fixed, one thread, garbage collector off while the arms run): one process as rank 0 of a
fake process group of ``--ranks`` ranks, which runs the code every rank runs (apply does
no collective here, and no rank takes another path). Three processes, run two at a time:
imports and one warm-up of both arms, then ``--repeats`` applies by plan, or by hand, or
neither (the model builds alone); the counts' differences give each arm's instructions
per apply, and the ratio plan / hand.
"""

from __future__ import annotations

import argparse
import gc
import time

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
ARMS = ("plan", "hand", "hand_dt")  # hand_dt: the hand loop slicing with distribute_tensor


def _rank_main(blocks: int, repeats: int) -> dict[str, Times]:
    import structlog
    import torch.distributed as dist

    # Logging is part of what the plan does, but printing 4 ranks' lines to a terminal
    # would time the terminal: keep the events, drop the output.
    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    runs = {
        "plan": lambda: _by_plan(blocks),
        "hand": lambda: _by_hand(blocks, fast_slicing=True),
        "hand_dt": lambda: _by_hand(blocks, fast_slicing=False),
    }
    for run in runs.values():  # warm-up: first-call imports and caches
        run()
    times: dict[str, Times] = {arm: [] for arm in ARMS}
    for repeat in range(repeats):
        # Interleaved, so machine noise hits every arm alike, and in a rotating order, so
        # no arm always follows the same one. The cyclic garbage collector is run before
        # each arm and kept off while it runs (as timeit does): the models of earlier
        # arms hold reference cycles (FSDP's states), and freeing them would otherwise
        # land on whichever arm happened to cross gc's threshold.
        for arm in ARMS[repeat % len(ARMS):] + ARMS[:repeat % len(ARMS)]:
            gc.collect()
            # Every rank starts each arm together: apply makes no collective, so without
            # this the ranks drift apart and one arm would be timed beside another rank's
            # other arm (4 ranks share 2 cores), a contention the other arm does not meet.
            dist.barrier()
            gc.disable()
            try:
                times[arm].append(runs[arm]())
            finally:
                gc.enable()
    return times


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
                        help="applies per arm (default 11 timed, 4 counted)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions under valgrind instead of timing 4 ranks")
    parser.add_argument("--counted-arm", choices=COUNTED, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 4 if args.instructions or args.counted_arm else 11
    if args.counted_arm:
        _counted_arm(args.counted_arm, args.blocks, args.repeats, args.ranks)
        return
    if args.instructions:
        raise SystemExit(_count_instructions(args))

    from composer_par.testing.distributed import run_ranks

    # By name: rank processes import this file as a module (its folder is on sys.path).
    results = run_ranks("bench_apply:_rank_main", args.ranks, args=(args.blocks, args.repeats),
                        timeout=900)
    print(f"plan.apply vs hand-written torch calls: {args.blocks} blocks, {args.ranks} ranks, "
          f"{args.repeats} interleaved repeats; ratios of minima (noise only adds time)")
    print("  hand: the same slicing helper the plan uses; hand_dt: slicing each parameter "
          "with torch's distribute_tensor")
    worst = {"wall": 0.0, "cpu": 0.0, "cpu_dt": 0.0}
    for rank, times in enumerate(results):
        best = {arm: (min(t[0] for t in times[arm]), min(t[1] for t in times[arm]))
                for arm in ARMS}
        cells = []
        for i, kind in enumerate(("wall", "cpu")):
            p, h = best["plan"][i], best["hand"][i]
            worst[kind] = max(worst[kind], p / h)
            cells.append(f"{kind}: plan {p * 1000:6.1f} ms hand {h * 1000:6.1f} ms "
                         f"ratio {p / h:.3f}")
        # Each repeat runs the arms back to back, so a repeat's plan/hand ratio sees the
        # same machine state on both sides; the median of those paired ratios is the
        # steadier figure where other programs share the cores (minima of CPU time still
        # move with cache and frequency contention).
        paired = sorted(p[1] / h[1] for p, h in zip(times["plan"], times["hand"], strict=True))
        median = paired[len(paired) // 2] if len(paired) % 2 else (
            paired[len(paired) // 2 - 1] + paired[len(paired) // 2]) / 2
        worst["cpu_paired"] = max(worst.get("cpu_paired", 0.0), median)
        cells.append(f"paired cpu median {median:.3f}")
        dt = best["plan"][1] / best["hand_dt"][1]
        worst["cpu_dt"] = max(worst["cpu_dt"], dt)
        cells.append(f"cpu vs hand_dt {best['hand_dt'][1] * 1000:6.1f} ms ratio {dt:.3f}")
        print(f"  rank {rank}:  " + "   ".join(cells))
    verdict = "meets" if worst["cpu"] <= TARGET else "MISSES"
    paired_verdict = "meets" if worst["cpu_paired"] <= TARGET else "MISSES"
    print(f"ratio plan/hand, worst rank: cpu time {worst['cpu']:.3f} (ratio of minima) -> "
          f"{verdict} the target <= {TARGET}; median of paired cpu ratios "
          f"{worst['cpu_paired']:.3f} -> {paired_verdict}; wall time {worst['wall']:.3f} "
          f"(wall includes waiting on a shared machine); cpu vs hand_dt {worst['cpu_dt']:.3f}")


if __name__ == "__main__":
    main()
