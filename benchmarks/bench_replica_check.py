"""The replica check's cost against a training step's, side by side in one run.

On 4 gloo ranks, a small Llama built by a plan, in two layouts: FSDP2 x TP (dp_shard 2 x
tp 2: the norms are replicated over tp) and HSDP alone (dp_replicate 4: every parameter
is replicated, so the check reads all of them: its worst case). Interleaved repeats time
one training step (forward, loss, backward, AdamW step, zero_grad) and one
``check_replicas(model)`` on the parameters that step left. Each is timed from a
barrier, and its time is the slowest rank's.

Target: at the default interval (``composer_par.replicas.EVERY``: the check runs before
every EVERY-th step, on by default in ``plan.training_step`` and every trainer adapter)
the check costs at most 0.1 % of a step, amortized: check / step / EVERY <= 0.001, in
both layouts.

    .venv/bin/python benchmarks/bench_replica_check.py [--repeats 30] [--layers 4] [--dim 256]

Prints, per layout, the minima and medians of both, the ratio of one check to one step,
and that ratio amortized over EVERY steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

TARGET = 0.001
RANKS = 4
LAYOUTS = ("fsdp2_tp", "hsdp")


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _rank_main(layout: str, layers: int, dim: int, seq: int, batch: int, repeats: int,
               warmup: int) -> dict[str, Any]:
    import structlog
    import torch

    from composer_par import (
        FSDP2,
        HSDP,
        TP,
        MeshSpec,
        MetaInit,
        ParallelPlan,
        check_replicas,
    )
    from composer_par.models.llama import Llama, LlamaConfig, next_token_loss

    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    cfg = LlamaConfig(vocab_size=1024, dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4,
                      ffn_hidden=2 * dim, max_seq_len=seq)
    if layout == "hsdp":
        plan = ParallelPlan(MeshSpec(dp_replicate=RANKS)).use(HSDP()).use(MetaInit(seed=0))
    else:
        plan = (ParallelPlan(MeshSpec(dp_shard=2, tp=2)).use(TP()).use(FSDP2())
                .use(MetaInit(seed=0)))
    with torch.device("meta"):
        meta = Llama(cfg)
    model = plan.apply(meta)
    # Timed apart below: the step alone.
    step = plan.training_step(model, next_token_loss, check_replicas_every=None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    index, count = plan.data_shard()
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq),
                           generator=torch.Generator().manual_seed(0)).chunk(count)[index]

    def train() -> None:
        step.step(tokens, tokens)
        optimizer.step()
        optimizer.zero_grad()

    def check() -> None:
        check_replicas(model)

    for _ in range(warmup):
        train()
        check()
    times: dict[str, list[float]] = {"step": [], "check": []}
    for _ in range(repeats):
        times["step"].append(_timed(train))
        times["check"].append(_timed(check))
    replicated = sum(1 for p in model.parameters()
                     if any(pl.is_replicate() for pl in getattr(p, "placements", ())))
    return {"times": times, "replicated": replicated,
            "parameters": sum(1 for _ in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    args = parser.parse_args()

    from composer_par.replicas import EVERY
    from composer_par.testing.distributed import run_ranks

    for layout in LAYOUTS:
        load_before = os.getloadavg()
        # By name: rank processes import this file as a module (its folder is on sys.path).
        results = run_ranks("bench_replica_check:_rank_main", RANKS,
                            args=(layout, args.layers, args.dim, args.seq, args.batch,
                                  args.repeats, args.warmup), timeout=1800)
        load_after = os.getloadavg()
        title = ("FSDP2 x TP (dp_shard 2 x tp 2)" if layout == "fsdp2_tp"
                 else f"HSDP alone (dp_replicate {RANKS}: every parameter replicated)")
        print(f"replica check vs training step, {title}: Llama {args.layers} blocks, dim "
              f"{args.dim}, seq {args.seq}, global batch {args.batch}, {RANKS} gloo ranks, "
              f"{args.repeats} interleaved repeats ({os.cpu_count()} cores; load average "
              f"{load_before[0]:.1f} before, {load_after[0]:.1f} after); "
              f"{results[0]['replicated']} of {results[0]['parameters']} parameters "
              "replicated on some mesh dim")
        # A step or a check takes as long as its slowest rank.
        slowest = {kind: [max(r["times"][kind][i] for r in results)
                          for i in range(args.repeats)] for kind in ("step", "check")}
        for kind, values in slowest.items():
            print(f"  {kind:6s} min {min(values) * 1e3:8.2f} ms   median "
                  f"{statistics.median(values) * 1e3:8.2f} ms")
        per_check_min = min(slowest["check"]) / min(slowest["step"])
        per_check_median = (statistics.median(slowest["check"])
                            / statistics.median(slowest["step"]))
        amortized = per_check_median / EVERY
        print(f"  one check / one step: {per_check_min:.2%} (minima), {per_check_median:.2%} "
              f"(medians)")
        verdict = "meets" if amortized <= TARGET else "MISSES"
        print(f"  amortized at the default interval (every {EVERY} steps): "
              f"{per_check_min / EVERY:.4%} (minima), {amortized:.4%} (medians) -> "
              f"{verdict} the target <= {TARGET:.1%}")


if __name__ == "__main__":
    main()
