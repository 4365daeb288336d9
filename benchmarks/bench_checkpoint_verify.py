"""What digests cost: checkpoint.save and checkpoint.load of a ~1.1 GB model on 4 FSDP2
ranks, with the digests (the default) and without, side by side in one run.

    python benchmarks/bench_checkpoint_verify.py      # or: ./dev bench

The model is the Llama of benchmarks/bench_load.py (about 1.1 GB of fp32 weights; no
optimizer), sharded by FSDP2 over 4 gloo ranks in one process group
($COMPOSER_PAR_BENCH_WORLD sets another number: with fewer ranks than cores, the checking
thread of a load has a core of its own). Each round saves it
into a fresh root and loads it back, once each way, the way that goes first alternating
from round to round (ROUNDS rounds, $COMPOSER_PAR_BENCH_ROUNDS, default 7, after one
untimed round of each way that pays for first-touch allocations and imports); the page
cache holds the files in both ways, since each load reads what its save just wrote:

  with digests     what composer_par does: every rank digests each stored chunk of the
                   files it wrote (CRC-32, mostly the values torch.save put in its zips)
                   before the commit; load
                   checks every chunk a rank reads before DCP reads it, and .metadata and
                   composer_par.json before they are used;
  without digests  the same save and load with the shard digests left out of the commit
                   and no digest checked on load (sizes only): what a save and a load cost
                   before digests existed.

Wall time is between two barriers on rank 0; saves include DCP's fsync of every file and
the commit. CPU time is the sum over the ranks of each rank's CPU time (every thread),
which a machine shared with other work disturbs less than the wall time. Printed: the
ratio with / without of each way's fastest round (minima), of their medians, and the
median of the per-round ratios (both ways of one round ran next to each other). Target:
the ratio of the minima of wall time <= 1.10 for both save and load. The CRC-32 in use is
printed: zlib-ng's, or the standard library's zlib where zlib-ng is not installed (same
values, about a quarter of the speed). Files go to
$COMPOSER_PAR_BENCH_DIR (default /tmp/composer_par_bench), removed after each round.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

WORLD = int(os.environ.get("COMPOSER_PAR_BENCH_WORLD", "4"))
ROUNDS = int(os.environ.get("COMPOSER_PAR_BENCH_ROUNDS", "7"))
BENCH_DIR = Path(os.environ.get("COMPOSER_PAR_BENCH_DIR", "/tmp/composer_par_bench"))
WAYS = ("without", "with")


@contextlib.contextmanager
def without_digests() -> Iterator[None]:
    """Save shards without digesting them, load without checking any digest."""
    from torch.distributed.checkpoint import FileSystemWriter

    from composer_par.checkpoint import dcp, steps

    def plain_writer(path: Path, **kwargs: Any) -> Any:
        writer = FileSystemWriter(path, **kwargs)
        writer.records = {}  # type: ignore[attr-defined]
        return writer

    saved = dcp.digesting_writer, steps.read_manifest
    dcp.digesting_writer = plain_writer  # type: ignore[assignment]
    steps.read_manifest = lambda directory: None  # type: ignore[assignment]
    try:
        yield
    finally:
        dcp.digesting_writer, steps.read_manifest = saved


def rank_run(root: str, rounds: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from composer_par import FSDP2, MeshSpec, MetaInit, ParallelPlan
    from composer_par.checkpoint import load, save

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_load import build_model

    torch.set_num_threads(1)
    model = ParallelPlan(MeshSpec(dp_shard=WORLD)).use(FSDP2()).use(MetaInit(seed=0)).apply(
        build_model())
    probe = model.layers[0].attention.wq.weight.to_local()
    expected = probe.clone()
    times: dict[str, dict[str, list[float]]] = {
        w: {"save": [], "load": [], "save_cpu": [], "load_cpu": []} for w in WAYS}

    def timed(way: str, op: str, run: Any, record: bool) -> None:
        dist.barrier()
        started, cpu = time.perf_counter(), time.process_time()
        run()
        cpu = time.process_time() - cpu  # this rank's CPU, every thread, before the wait
        dist.barrier()
        wall = time.perf_counter() - started
        total = torch.tensor([cpu], dtype=torch.float64)
        dist.all_reduce(total)
        if record:
            times[way][op].append(wall)
            times[way][f"{op}_cpu"].append(float(total))

    # Round -1 is the warm-up: both ways, untimed.
    for round_ in range(-1, rounds):
        for way in WAYS if round_ % 2 == 0 else reversed(WAYS):
            target = Path(root) / f"{way}-{round_}"
            with without_digests() if way == "without" else contextlib.nullcontext():
                timed(way, "save", lambda: save(target, model, step=1),  # noqa: B023
                      round_ >= 0)
                with torch.no_grad():
                    probe.zero_()
                timed(way, "load", lambda: load(target, model), round_ >= 0)  # noqa: B023
            if not torch.equal(probe, expected):
                raise AssertionError(f"{way}: the load did not bring the weights back")
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(target)
            dist.barrier()
    return times


def main() -> int:
    from composer_par.testing.distributed import run_ranks

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_load import build_model

    size = sum(v.numel() * v.element_size() for v in build_model().state_dict().values())
    root = BENCH_DIR / "verify"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    from composer_par.checkpoint import integrity

    crc = f"{integrity.crc32.__module__}.{integrity.crc32.__name__}"
    print(f"model: {size / 1e9:.2f} GB of fp32 weights on {WORLD} FSDP2 ranks "
          f"({size / WORLD / 2**20:.0f} MiB each); CRC-32 by {crc}; a warm-up round, "
          f"then {ROUNDS} round(s), interleaved ...", file=sys.stderr)
    try:
        times = run_ranks(rank_run, WORLD, args=(str(root), ROUNDS), timeout=1800)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nCRC-32 by {crc}; {ROUNDS} rounds after a warm-up\n")
    print(f"{'':<11} {'without (s)':>11} {'with (s)':>9} {'ratio':>6}   {'without (s)':>11} "
          f"{'with (s)':>9} {'ratio':>6}   {'per-round ratio':>15}")
    print(f"{'':<11} {'minima':^28}   {'medians':^28}   {'median':>15}")
    ratios = {}
    for op in ("save", "load"):
        for kind in ("wall", "CPU"):
            key = op if kind == "wall" else f"{op}_cpu"
            runs = {w: times[w][key] for w in WAYS}
            low = {w: min(runs[w]) for w in WAYS}
            mid = {w: statistics.median(runs[w]) for w in WAYS}
            paired = statistics.median(
                a / b for a, b in zip(runs["with"], runs["without"], strict=True))
            if kind == "wall":
                ratios[op] = low["with"] / low["without"]
            print(f"{op + ' ' + kind:<11} {low['without']:11.2f} {low['with']:9.2f} "
                  f"{low['with'] / low['without']:6.2f}   {mid['without']:11.2f} "
                  f"{mid['with']:9.2f} {mid['with'] / mid['without']:6.2f}   {paired:15.2f}")
    for op in ("save", "load"):
        print(f"  {op} wall per round: without " + ", ".join(
            f"{t:.2f}" for t in times["without"][op]) + "; with " + ", ".join(
            f"{t:.2f}" for t in times["with"][op]))
    print("  (CPU: the sum over the ranks of each rank's CPU time, every thread)")
    met = all(r <= 1.10 for r in ratios.values())
    print(f"\ntarget: wall with/without (minima) <= 1.10 for save and load: "
          f"{'met' if met else 'MISSED'} (save {ratios['save']:.2f}, load {ratios['load']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
