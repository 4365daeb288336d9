"""One training step of a mixture-of-experts model under expert parallelism against the
same model under FSDP2 alone and under FSDP2 x TP, on the same 4 gloo ranks.

The MoE Llama of ``composer_par.models.moe_llama`` (top-2 of 8 experts per block) is
trained by each plan from the same weights:

* ``fsdp2 x ep (2 x 2)``: experts whole on their ep rank (4 per rank, then sharded over
  dp_shard), tokens moved by all-to-all; dense layers over dp_shard x ep;
* ``fsdp2 (4)``: every parameter sharded over 4, experts all-gathered in every block;
* ``fsdp2 x tp (2 x 2)``: attention split over tp, experts whole on each tp rank and
  sharded over dp_shard (TP has no plan for this model's experts).

Per plan it prints, for one step (forward and backward), each rank's collective payload
bytes by kind (all-to-all, all-gather, reduce-scatter, all-reduce; counted by
``composer_par.testing.comm_count``), the parameter bytes each rank holds (a stand-in for
peak memory: on CPU torch has no allocator peak to read), and the step time (median of
the slowest rank over interleaved repeats), then the ratios to FSDP2 alone.

    .venv/bin/python benchmarks/bench_ep.py [--repeats 10] [--dim 128] [--layers 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

RANKS = 4
PLANS: dict[str, dict[str, int]] = {
    "fsdp2 x ep (2 x 2)": {"dp_shard": 2, "ep": 2},
    "fsdp2 (4)": {"dp_shard": 4},
    "fsdp2 x tp (2 x 2)": {"dp_shard": 2, "tp": 2},
}
KINDS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")


def _config(layers: int, dim: int, seq: int) -> Any:
    from composer_par.models.moe_llama import MoELlamaConfig

    return MoELlamaConfig(vocab_size=1024, dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4,
                          ffn_hidden=2 * dim, max_seq_len=seq, num_experts=8, top_k=2,
                          expert_hidden=2 * dim)


def _plan(mesh: dict[str, int]) -> Any:
    from composer_par import EP, FSDP2, TP, MeshSpec, MetaInit, ParallelPlan

    plan = ParallelPlan(MeshSpec(**mesh)).use(FSDP2())
    if "ep" in mesh:
        plan.use(EP())
    if "tp" in mesh:
        plan.use(TP(replicate_rest=False))
    return plan.use(MetaInit(seed=3))


def _rank_main(layers: int, dim: int, seq: int, batch: int, repeats: int) -> dict[str, Any]:
    import structlog
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from composer_par.models.moe_llama import MoELlama, moe_loss
    from composer_par.testing.comm_count import CommCounter

    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    cfg = _config(layers, dim, seq)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq),
                           generator=torch.Generator().manual_seed(0))
    runs = {}
    for name, mesh in PLANS.items():
        plan = _plan(mesh)
        with torch.device("meta"):
            model = MoELlama(cfg)
        model = plan.apply(model)
        index, count = plan.data_shard()
        local = tokens.chunk(count)[index]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        held = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                   * p.element_size() for p in model.parameters())
        runs[name] = (plan, model, optimizer, local, held)

    def step(model: Any, optimizer: Any, local: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        moe_loss(model, local).backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    out: dict[str, Any] = {}
    for name, (plan, model, optimizer, local, held) in runs.items():
        step(model, optimizer, local)  # warm-up
        counter = CommCounter()
        with counter:
            moe_loss(model, local).backward()
        optimizer.zero_grad()
        summary = counter.summary(plan.mesh.resolve(RANKS), dist.get_rank())
        by_kind = {k: sum(d.get(k, {}).get("bytes", 0) for d in summary.values())
                   for k in KINDS}
        out[name] = {"bytes": by_kind, "held": held, "times": []}
    for _ in range(repeats):
        for name, (_, model, optimizer, local, _) in runs.items():
            out[name]["times"].append(step(model, optimizer, local))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    args = parser.parse_args()

    from composer_par.testing.distributed import run_ranks

    load = os.getloadavg()[0]
    results = run_ranks("bench_ep:_rank_main", RANKS,
                        args=(args.layers, args.dim, args.seq, args.batch, args.repeats),
                        timeout=1800)
    print(f"one training step, MoE Llama {args.layers} blocks, dim {args.dim}, 8 experts "
          f"top-2, seq {args.seq}, global batch {args.batch}, {RANKS} gloo ranks, "
          f"{args.repeats} interleaved repeats ({os.cpu_count()} cores, load {load:.1f})")
    base = "fsdp2 (4)"
    summary: dict[str, dict[str, float]] = {}
    for name in PLANS:
        moved = {k: max(r[name]["bytes"][k] for r in results) for k in KINDS}
        held = max(r[name]["held"] for r in results)
        times = [max(r[name]["times"][i] for r in results) for i in range(args.repeats)]
        summary[name] = {"total": sum(moved.values()), "held": held,
                         "time": statistics.median(times)}
        print(f"  {name}: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in moved.items())
              + f"; parameters held {held / 2**20:.2f} MiB/rank; "
              f"step {summary[name]['time'] * 1e3:.1f} ms (median, slowest rank)")
    for name in PLANS:
        if name == base:
            continue
        s, b = summary[name], summary[base]
        print(f"  {name} / {base}: collective bytes {s['total'] / b['total']:.2f}, "
              f"parameters held {s['held'] / b['held']:.2f}, step time "
              f"{s['time'] / b['time']:.2f}")


if __name__ == "__main__":
    main()
