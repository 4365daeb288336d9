"""A trainer driven by a plan file, for torchrun:

    torchrun --nproc-per-node 4 examples/train.py examples/plans/fsdp_tp.toml --steps 50

The plan says how the model is parallelized; this file only builds the model on meta,
applies the plan, reads its data shard, trains, and checkpoints. Resume by rerunning
with --resume.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from composer_par import ParallelPlan, checkpoint, configure_logging, get_logger
from composer_par.models.llama import Llama, LlamaConfig, next_token_loss
from composer_par.tools.demo import corpus_bytes

log = get_logger("train")


class ByteWindows(Dataset):
    """Every window of ``seq_len`` bytes of the corpus, stepping by half a window."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (len(self.data) - self.seq_len) // (self.seq_len // 2)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * (self.seq_len // 2)
        return self.data[start : start + self.seq_len]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per data shard")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("train-checkpoints"))
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    configure_logging()  # rank 0 only; JSON lines when not on a terminal

    plan = ParallelPlan.from_toml(args.plan)  # topology comes from torchrun's environment
    with torch.device("meta"):
        model = Llama(LlamaConfig(dim=128, n_layers=4, n_heads=8, n_kv_heads=4,
                                  ffn_hidden=256, max_seq_len=args.seq_len))
    model = plan.apply(model)  # validated first: a PlanError lists every problem
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    step = 0
    if args.resume:
        step = checkpoint.load(args.checkpoint_dir, model, optimizer).step
        log.info("resumed", step=step)

    # Ranks that differ only in TP read the same samples; data-parallel ranks differ.
    shard, shards = plan.data_shard()
    data = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()
    dataset = ByteWindows(data, args.seq_len)
    sampler = DistributedSampler(dataset, num_replicas=shards, rank=shard, seed=0)
    device = torch.device("cuda") if cuda else torch.device("cpu")

    while step < args.steps:
        sampler.set_epoch(step)  # a new order per pass, the same on every replica
        for tokens in DataLoader(dataset, batch_size=args.micro_batch, sampler=sampler,
                                 drop_last=True):
            tokens = tokens.to(device)
            loss = next_token_loss(model(tokens), tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 10 == 0 or step == args.steps:
                log.info("step", step=step, loss=round(loss.item(), 4))
            if step == args.steps:
                break

    checkpoint.save(args.checkpoint_dir, model, optimizer, step=step, plan=plan, keep_last=2)
    log.info("saved", path=str(checkpoint.latest(args.checkpoint_dir)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
