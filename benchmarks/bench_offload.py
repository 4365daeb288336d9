"""Peak host memory and step time of FSDP2 training with and without NVMe offload.

The same Llama (AdamW, FSDP2 over ``dp_shard``) trains a few steps on gloo ranks twice,
each in fresh rank processes: once with the optimizer state in memory, once with the
``offload`` plugin keeping each FSDP unit's state in files under ``--path``. Each rank
reports its peak resident set (``VmHWM`` of /proc/self/status: the high-water mark of
the process, model, gradients and activations included, restarted once the plan is
applied, so that it is the training's peak and not that of initializing the weights), its
AdamW state size
(two fp32 tensors per parameter shard) and the mean time of its steps after the first.

    .venv/bin/python benchmarks/bench_offload.py [--ranks 2] [--layers 6] [--dim 1024]
        [--steps 4] [--path DIR]

Prints per rank the two peaks side by side, their difference against the AdamW state
size, the ratio of peaks, and the ratio of step times (offload / in memory; the slowest
rank's mean). The offload side writes and reads every unit's state each step: its time
depends on the device under ``--path`` (the page cache absorbs much of it here).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak_rss() -> bool:
    """Restart the peak at the current resident set (Linux 4.0+); whether it could."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _filesystem(path: str) -> str:
    """The type of the filesystem holding ``path`` (from /proc/mounts)."""
    real = os.path.realpath(path)
    best = ("", "?")
    for line in Path("/proc/mounts").read_text().splitlines():
        _, point, kind, *_ = line.split()
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(
                best[0]):
            best = (point, kind)
    return best[1]


def _fixed_mmap_threshold(nbytes: int) -> bool:
    """Have glibc's malloc serve blocks of ``nbytes`` or more by mmap, returned to the
    system when freed (its default threshold rises to the largest block freed, after
    which freed tensors stay in the heap); whether it could (glibc only)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    m_mmap_threshold = -3
    return bool(ctypes.CDLL(name).mallopt(m_mmap_threshold, nbytes))


def train(layers: int, dim: int, steps: int, path: str | None,
          mmap_threshold: int | None = None) -> dict[str, Any]:
    """One rank: build, apply FSDP2 (+ offload), train ``steps`` steps of AdamW."""
    if mmap_threshold:
        _fixed_mmap_threshold(mmap_threshold)
    import torch
    import torch.distributed as dist

    from composer_par import FSDP2, MeshSpec, MetaInit, Offload, ParallelPlan
    from composer_par.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=1024, dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4,
                      ffn_hidden=4 * dim, max_seq_len=32)
    plan = ParallelPlan(MeshSpec(dp_shard=dist.get_world_size())).use(FSDP2()).use(
        MetaInit(seed=0))
    if path is not None:
        plan.use(Offload(path=path))
    with torch.device("meta"):
        model = Llama(cfg)
    model = plan.apply(model)
    # Applying the plan (initializing the weights) has its own peak; the training's is
    # the one the optimizer state adds to.
    apply_peak = _peak_rss()
    reset = _reset_peak_rss()
    optimizer: Any = torch.optim.AdamW(model.parameters(), lr=1e-3)
    offload = plan.plugin("offload")
    if offload is not None:
        optimizer = offload.wrap(optimizer, model)
    local = sum(p.to_local().numel() for p in model.parameters())
    generator = torch.Generator().manual_seed(dist.get_rank())
    times = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=generator)
        start = time.perf_counter()
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return {"peak": _peak_rss(), "apply_peak": apply_peak, "reset": reset,
            "state": 2 * 4 * local, "params": 4 * local,
            "step": sum(times[1:]) / max(1, len(times) - 1),
            "units": len(optimizer.units) if offload is not None else 0}


def main() -> None:
    from composer_par.testing.distributed import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--mmap-threshold", type=int, default=0, metavar="BYTES",
                        help="fix glibc's mmap threshold in the ranks (both sides), e.g. "
                        "1048576 (default: malloc's own dynamic threshold)")
    parser.add_argument("--path", default=None,
                        help="offload directory (default: a temporary one under /tmp)")
    args = parser.parse_args()
    path = args.path or tempfile.mkdtemp(prefix="bench-offload-")
    common = (args.layers, args.dim, args.steps)
    plain = run_ranks(train, args.ranks, args=(*common, None, args.mmap_threshold),
                      timeout=1200)
    offloaded = run_ranks(train, args.ranks, args=(*common, path, args.mmap_threshold),
                          timeout=1200)
    if args.path is None:
        shutil.rmtree(path, ignore_errors=True)
    mb = 1 / 2**20
    print(f"Llama dim={args.dim} layers={args.layers}, FSDP2 over {args.ranks} gloo ranks, "
          f"AdamW, {args.steps} steps; offload path {path} ({_filesystem(path)}), "
          f"{offloaded[0]['units']} units"
          + (f"; glibc mmap threshold {args.mmap_threshold} bytes" if args.mmap_threshold
             else ""))
    if not all(r["reset"] for r in plain + offloaded):
        print("note: the peak could not be restarted after apply (no /proc/self/clear_refs): "
              "the peaks below include applying the plan")
    applying = ", ".join(f"{r['apply_peak'] * mb:.0f}" for r in plain)
    print(f"peak RSS while applying the plan (MiB, per rank): {applying}")
    print(f"{'rank':>4} {'params MiB':>11} {'AdamW state MiB':>16} {'train peak MiB':>15} "
          f"{'with offload':>13} {'saved':>8} {'saved/state':>12} {'peak ratio':>11}")
    for rank, (a, b) in enumerate(zip(plain, offloaded, strict=True)):
        saved = a["peak"] - b["peak"]
        print(f"{rank:>4} {a['params'] * mb:>11.1f} {a['state'] * mb:>16.1f} "
              f"{a['peak'] * mb:>15.1f} {b['peak'] * mb:>13.1f} {saved * mb:>8.1f} "
              f"{saved / a['state']:>12.2f} {b['peak'] / a['peak']:>11.2f}")
    slow_plain = max(r["step"] for r in plain)
    slow_off = max(r["step"] for r in offloaded)
    print(f"step time (slowest rank's mean after the first step): in memory "
          f"{slow_plain * 1e3:.0f} ms, offload {slow_off * 1e3:.0f} ms, ratio "
          f"{slow_off / slow_plain:.2f}")


if __name__ == "__main__":
    main()
