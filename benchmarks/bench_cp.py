"""Context parallelism: activation memory, bytes moved and step time against no CP.

The project's Llama (small widths, long sequences) on gloo ranks, one sequence per step:

* **memory**: the peak of activations a rank holds in forward (torch's MemTracker, as
  tests/test_activation_memory.py measures it) at sequence 4096 with CP 2 and CP 4 in
  each mode, against one process on the whole sequence (the same global tokens).
  Targets: CP 2 <= 0.60x, CP 4 <= 0.35x of no CP.
* **bytes**: the logical payload of the cp collectives of one step (forward and backward,
  counted by CommCounter) in ``allgather`` and ``alltoall``, beside what
  ``composer_par.plugins.cp.estimate`` predicts. The gradient all-reduce CP runs
  itself without a data-parallel plugin is shown apart.
* **time**: a step (forward and backward) with CP against one process at the same tokens
  per rank (sequence 4096 over cp ranks vs sequence 4096 / cp alone): the price of the
  cross-rank attention. On a machine with fewer cores than ranks the ranks share cores;
  read the ratio with the load average printed.

    .venv/bin/python benchmarks/bench_cp.py [--seq 4096] [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

TARGETS = {2: 0.60, 4: 0.35}
DIM, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 4, 2, 2, 256


def _plan(size: int, mode: str) -> Any:
    from composer_par import CP, MeshSpec, MetaInit, ParallelPlan

    if size == 1:
        return ParallelPlan(MeshSpec()).use(MetaInit(seed=0))
    return ParallelPlan(MeshSpec(cp=size)).use(CP(mode=mode)).use(MetaInit(seed=0))


def on_rank(size: int, mode: str, seq: int, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from composer_par.plugins.cp import context_of, next_token_labels

    from composer_par.models.llama import Llama, LlamaConfig
    from composer_par.testing.activation_memory import held_for_backward
    from composer_par.testing.comm_count import CommCounter

    cfg = LlamaConfig(vocab_size=VOCAB, dim=DIM, n_layers=LAYERS, n_heads=HEADS,
                      n_kv_heads=KV_HEADS, ffn_hidden=2 * DIM, max_seq_len=seq)
    plan = _plan(size, mode)
    with torch.device("meta"):
        built = Llama(cfg)
    model = plan.apply(built)
    tokens = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    labels = next_token_labels(tokens)
    cp = context_of(model)

    def forward() -> Any:
        if cp is None:
            logits = model(tokens)
            return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return cp.cross_entropy(model(cp.shard(tokens), cp.positions(seq)), cp.shard(labels))

    memory = held_for_backward(model, forward)
    model.zero_grad()
    counter = CommCounter()
    with counter:
        forward().backward()
    model.zero_grad()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        forward().backward()
        times.append(time.perf_counter() - start)
        model.zero_grad()
    summary = counter.summary(plan.mesh.resolve(dist.get_world_size()), dist.get_rank())
    return {"peak": memory["peak_activations"], "held": memory["activations"],
            "comm": summary.get("cp", {}), "time": min(times)}


def run(size: int, mode: str, seq: int, steps: int) -> list[dict[str, Any]]:
    from composer_par.testing.distributed import run_ranks

    return run_ranks(on_rank, size, args=(size, mode, seq, steps), timeout=1200)


def estimate(mode: str, size: int, seq: int) -> int:
    from composer_par.plugins.cp.estimate import attention_collectives

    # The project's Llama repeats K/V to the query heads before its attention math.
    return sum(c.payload for c in attention_collectives(
        "cp", mode, size=size, layers=LAYERS, batch=1, seq=seq, heads=HEADS,
        kv_heads=HEADS, head_dim=DIM // HEADS, dtype_bytes=4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    seq, steps = args.seq, args.steps
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    alone = run(1, "allgather", seq, steps)[0]
    print(f"\nno CP, sequence {seq}: peak activations {alone['peak'] / 2**20:.1f} MiB")
    print("\nmemory (peak activations of the fullest rank, same global tokens):")
    results = {}
    for size in (2, 4):
        for mode in ("allgather", "alltoall"):
            ranks = run(size, mode, seq, steps)
            results[size, mode] = ranks
            peak = max(r["peak"] for r in ranks)
            ratio = peak / alone["peak"]
            verdict = "ok" if ratio <= TARGETS[size] else "ABOVE TARGET"
            print(f"  cp {size} {mode:9s}: {peak / 2**20:7.1f} MiB = {ratio:.3f}x of no CP "
                  f"(target <= {TARGETS[size]}) {verdict}")
    print("\nbytes per step on rank 0 (logical payload, forward + backward):")
    for size in (2, 4):
        for mode in ("allgather", "alltoall"):
            comm = results[size, mode][0]["comm"]
            attention = sum(v["bytes"] for k, v in comm.items() if k != "all_reduce")
            reduce = comm.get("all_reduce", {}).get("bytes", 0)
            predicted = estimate(mode, size, seq)
            print(f"  cp {size} {mode:9s}: attention {attention / 2**20:7.2f} MiB "
                  f"(estimate {predicted / 2**20:7.2f} MiB, measured/estimate "
                  f"{attention / predicted:.3f}); gradient all-reduce {reduce / 2**20:.2f} MiB")
    print("\nstep time against one process at the same tokens per rank (min of "
          f"{steps} steps):")
    for size in (2, 4):
        same = run(1, "allgather", seq // size, steps)[0]["time"]
        for mode in ("allgather", "alltoall"):
            step = max(r["time"] for r in results[size, mode])
            print(f"  cp {size} {mode:9s}: {step:.3f} s vs {same:.3f} s at sequence "
                  f"{seq // size} alone: ratio {step / same:.2f}")
    print(f"\nload average after: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
