"""``composer-par demo``: validate, explain and apply a plan, then train a small Llama on
local processes started by torch's elastic launcher (CPU/gloo; CUDA/NCCL with GPUs).

The default plan shards with FSDP2 over all processes and initializes with MetaInit.
Tokens are bytes of the package's own source text, so the run needs no download.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_PLAN = """\
[mesh]
dp_shard = -1          # all processes

[[plugins]]
name = "fsdp2"
reshard_after_forward = true

[[plugins]]
name = "meta_init"
seed = 0
"""


def corpus_bytes() -> bytes:
    root = Path(__file__).parent
    return b"\n".join(p.read_bytes() for p in sorted(root.rglob("*.py")))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", type=Path, help="a plan file (default: FSDP2 + MetaInit)")
    parser.add_argument("--nproc", type=int, default=4, help="local processes (default 4)")
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="process-group timeout in seconds: a dead rank stops the rest")


# The CPU build of torch warns at import when NumPy is absent; nothing here uses NumPy.
_QUIET_NUMPY = "ignore:Failed to initialize NumPy"


def run(args: argparse.Namespace, out: Any = None) -> int:
    """Validate and explain the plan, then train. ``out`` is the CLI's Output (progress
    goes to stderr, so with --json stdout holds only the result)."""
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    os.environ["PYTHONWARNINGS"] = ",".join(
        w for w in (os.environ.get("PYTHONWARNINGS"), _QUIET_NUMPY) if w
    )
    from composer_par.plan import ParallelPlan
    from composer_par.planfile import PlanFileError
    from composer_par.topology import Topology

    say = out.note if out is not None else (lambda text: print(text, file=sys.stderr))
    text = args.plan.read_text() if args.plan else DEFAULT_PLAN
    try:
        plan = ParallelPlan.from_toml(text)
    except PlanFileError as exc:
        say(str(exc))
        return 2
    plan.topology = Topology.single_node(args.nproc)
    report = plan.validate(world_size=args.nproc)
    say(report.format())
    if not report.ok:
        return 1
    say(plan.explain(world_size=args.nproc).format())

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=args.nproc, run_id=f"demo-{os.getpid()}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.5,
    )
    started = time.perf_counter()
    try:
        losses = elastic_launch(config, _train)(text, args.steps, args.seq_len, args.batch,
                                                args.timeout)[0]
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        say(f"rank {rank} failed (exit code {failure.exitcode}): {failure.message}")
        return 1
    seconds = time.perf_counter() - started
    summary = (f"trained {args.steps} steps on {args.nproc} processes in {seconds:.1f}s: "
               f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    data = {"ok": True, "steps": args.steps, "nproc": args.nproc, "seconds": round(seconds, 2),
            "losses": losses, "plan": plan.to_toml()}
    if out is not None:
        out.result(data, summary)
    else:
        print(summary)
    return 0


def _train(plan_text: str, steps: int, seq_len: int, batch: int, timeout: float) -> list[float]:
    """One rank: build on meta, apply the plan, train; returns rank 0's losses."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from composer_par.logging import configure_logging
    from composer_par.models.llama import Llama, LlamaConfig, next_token_loss
    from composer_par.plan import ParallelPlan

    torch.set_num_threads(1)
    configure_logging(level="WARNING")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    try:
        plan = ParallelPlan.from_toml(plan_text)
        cfg = LlamaConfig(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=256,
                          max_seq_len=seq_len)
        with torch.device("meta"):
            built = Llama(cfg)
        model = plan.apply(built)
        index, count = plan.data_shard()
        data = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(0)
        losses: list[float] = []
        for step in range(steps):
            starts = torch.randint(0, len(data) - seq_len, (batch,), generator=gen)
            tokens = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
            local = tokens.chunk(count)[index].to(plan.device or "cpu")
            started = time.perf_counter()
            loss = next_token_loss(model(local), local)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total) / dist.get_world_size())
            if dist.get_rank() == 0:
                rate = batch * seq_len / (time.perf_counter() - started)
                print(f"step {step + 1:3d}/{steps}  loss {losses[-1]:.4f}  {rate:8.0f} tokens/s",
                      file=sys.stderr, flush=True)
        return losses
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="composer-par demo", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))

