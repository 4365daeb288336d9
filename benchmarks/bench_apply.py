"""plan.apply against the same torch calls written by hand: a regression alarm.

A Llama of ``--blocks`` blocks built on meta is sharded with FSDP2 and initialized with
MetaInit by ``plan.apply``. The hand-written side is plain torch: ``init_device_mesh``,
``fully_shard`` on each block and the root, ``to_empty``, then each module's
``reset_parameters`` on full-size tensors under a seed of the module's own, keeping the
rank's part with ``distribute_tensor``. Both run as rank 0 of a fake process group of
``--ranks`` ranks: apply makes no collective here, and every rank runs the same code.

    .venv/bin/python benchmarks/bench_apply.py                 # CPU time, for information
    .venv/bin/python benchmarks/bench_apply.py --instructions  # the alarm (needs valgrind)

``plan.apply`` runs once per job, so its speed is not tuned; this benchmark is here to
notice when what the plan adds (validation, hooks, block finding, logging) grows by
accident, e.g. a walk over the model repeated per module. CPU time on a shared machine
varies too much to fail on, so it is printed only. ``--instructions`` counts the
instructions each side executes under valgrind's cachegrind, which gives the same count
from run to run, and exits with status 1 when plan / hand exceeds 1.15.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from statistics import median

ALARM = 1.15


def build(blocks: int):
    import torch

    from composer_par.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(dim=64, n_layers=blocks, n_heads=4, n_kv_heads=2, ffn_hidden=128)
    with torch.device("meta"):
        return Llama(cfg)


def by_plan(blocks: int) -> None:
    import torch.distributed as dist

    from composer_par import FSDP2, MeshSpec, MetaInit, ParallelPlan

    model = build(blocks)
    plan = ParallelPlan(MeshSpec(dp_shard=dist.get_world_size()))
    plan.use(FSDP2(blocks="layers")).use(MetaInit(seed=0)).apply(model)


def by_hand(blocks: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = build(blocks)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    rank, ranks = mesh.get_local_rank(), mesh.size()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    for path, module in model.named_modules():
        if not hasattr(module, "reset_parameters"):
            continue
        sharded = dict(module.named_parameters(recurse=False))
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            # The CPU generator alone: the one fork_rng(devices=[]) restores.
            torch.default_generator.manual_seed(zlib.crc32(path.encode()))
            for name, param in sharded.items():
                setattr(module, name, nn.Parameter(torch.empty(param.shape)))
            module.reset_parameters()
            for name, param in sharded.items():
                full = getattr(module, name)
                setattr(module, name, param)
                if isinstance(param, DTensor):  # FSDP2's Shard(0): torch.chunk's parts
                    param.to_local().copy_(full.chunk(ranks)[rank])


ARMS = {"plan": by_plan, "hand": by_hand}
COUNTED = {**ARMS, "none": build}


def start_fake_world(ranks: int) -> None:
    import torch.distributed as dist

    from composer_par.plugin import torch_private

    dist.init_process_group("fake", rank=0, world_size=ranks, store=torch_private.fake_store()())


def cpu_times(args: argparse.Namespace) -> None:
    start_fake_world(args.ranks)
    for run in ARMS.values():  # first-call imports and caches
        run(args.blocks)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for repeat in range(args.repeats):
        # Alternating which side goes first, so neither always runs after the other.
        order = list(ARMS) if repeat % 2 == 0 else list(reversed(ARMS))
        for arm in order:
            gc.collect()
            start = time.process_time()
            ARMS[arm](args.blocks)
            times[arm].append(time.process_time() - start)
    ratios = [p / h for p, h in zip(times["plan"], times["hand"], strict=True)]
    print(f"plan.apply vs hand-written torch calls: CPU time, {args.blocks} blocks, rank 0 "
          f"of {args.ranks}, {args.repeats} repeats")
    print(f"  plan {median(times['plan']) * 1000:.1f} ms   hand "
          f"{median(times['hand']) * 1000:.1f} ms (medians)")
    print(f"ratio plan/hand, CPU time (median of the repeats): {median(ratios):.3f} "
          "(for information; --instructions is the alarm)")


def counted_arm(args: argparse.Namespace) -> None:
    """What one process under cachegrind runs: start-up and one warm-up of both sides,
    then ``--repeats`` applies of one side (``none``: the model is only built)."""
    start_fake_world(args.ranks)
    for run in ARMS.values():
        run(args.blocks)
    gc.collect()
    gc.disable()  # so no collection lands inside one side's count and not the other's
    run = COUNTED[args.counted_arm]
    for _ in range(args.repeats):
        run(args.blocks)


def count_instructions(args: argparse.Namespace) -> int:
    if shutil.which("valgrind") is None:
        print("--instructions needs valgrind (its cachegrind tool) on PATH", file=sys.stderr)
        return 2
    # A fixed hash seed, and one thread: a worker thread of torch's or BLAS's pools spins
    # while it waits, a different number of instructions in every run.
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    print(f"counting instructions under cachegrind: {args.blocks} blocks, rank 0 of "
          f"{args.ranks}, {args.repeats} applies per side (minutes) ...", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        running = {}
        for arm in COUNTED:
            out = Path(tmp) / f"{arm}.out"
            command = ["valgrind", "--tool=cachegrind", "--cache-sim=no",
                       f"--cachegrind-out-file={out}", sys.executable, __file__,
                       "--counted-arm", arm, "--blocks", str(args.blocks),
                       "--repeats", str(args.repeats), "--ranks", str(args.ranks)]
            running[arm] = (out, subprocess.Popen(command, env=env,
                                                  stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.DEVNULL))
        totals = {}
        for arm, (out, process) in running.items():
            if process.wait() != 0:
                print(f"the counted {arm} process failed (exit status {process.returncode})",
                      file=sys.stderr)
                return 2
            summary = next(line for line in out.read_text().splitlines()
                           if line.startswith("summary:"))
            totals[arm] = int(summary.split()[1])
    plan = (totals["plan"] - totals["none"]) / args.repeats
    hand = (totals["hand"] - totals["none"]) / args.repeats
    ratio = plan / hand
    print(f"plan.apply vs hand-written torch calls: instructions per apply, {args.blocks} "
          f"blocks, rank 0 of {args.ranks}")
    print(f"  plan {plan / 1e6:.1f} M   hand {hand / 1e6:.1f} M")
    print(f"ratio plan/hand, instructions: {ratio:.3f} "
          f"({'within' if ratio <= ALARM else 'ABOVE'} the alarm at {ALARM})")
    return 0 if ratio <= ALARM else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=None,
                        help="applies per side (default 20 timed, 4 counted)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions under valgrind; exit 1 above the alarm")
    parser.add_argument("--counted-arm", choices=COUNTED, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 4 if args.instructions or args.counted_arm else 20
    if args.counted_arm:
        counted_arm(args)
    elif args.instructions:
        raise SystemExit(count_instructions(args))
    else:
        cpu_times(args)


if __name__ == "__main__":
    main()
