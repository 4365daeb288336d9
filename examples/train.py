"""A trainer driven by a plan file, for torchrun:

    torchrun --nproc-per-node 4 examples/train.py examples/plans/fsdp_tp.toml --steps 50
    torchrun --nproc-per-node 4 examples/train.py examples/plans/fsdp_ep.toml --model moe-llama

The plan says how the model is parallelized; this file only builds the model on meta,
applies the plan, reads its data shard, trains, and checkpoints. The batch of a step
depends only on the step, so a run resumed with --resume from its last committed
checkpoint (by hand, or by torchrun's --max-restarts after a lost node) ends with the
parameters an uninterrupted run would have had, bit for bit. With ``--model moe-llama``
(a mixture-of-experts Llama) and an expert-parallel plan, each step logs its routing:
tokens per expert and per ep rank (min/mean/max) and the tokens dropped.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from composer_par.plugins.cp import context_of, next_token_labels
from composer_par.plugins.ep.stats import RoutingSummary, routing_summary
from torch.utils.data import Dataset, DistributedSampler

from composer_par import ParallelPlan, checkpoint, configure_logging, get_logger
from composer_par.hangs import name_stuck_ranks
from composer_par.models.llama import next_token_loss
from composer_par.teardown import run_rank
from composer_par.tools.demo import MODELS, build_model, corpus_tokens

log = get_logger("train")

# A testing aid: "RANK:STEP" makes that rank stop at that step, alive but joining no
# collective, to show that the others give up at the plan's timeout and name it.
FREEZE_ENV = "COMPOSER_PAR_TRAIN_FREEZE"
# A testing aid: set, each rank prints the threads still running as it exits.
THREADS_ENV = "COMPOSER_PAR_TRAIN_SHOW_THREADS"


class ByteWindows(Dataset[torch.Tensor]):
    """Every window of ``seq_len`` bytes of the corpus, stepping by half a window."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (len(self.data) - self.seq_len) // (self.seq_len // 2)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * (self.seq_len // 2)
        return self.data[start : start + self.seq_len]


class StepBatches:
    """This data shard's micro-batch of each step, a function of the step alone: step
    ``s`` reads position ``s`` of the shuffled order of its epoch, so a run resumed at any
    step reads what an uninterrupted one would have read."""

    def __init__(self, dataset: ByteWindows, shards: int, shard: int, micro_batch: int) -> None:
        self.dataset, self.micro_batch = dataset, micro_batch
        # The same order on every replica of the shard: the seed and epoch decide it.
        self.sampler: DistributedSampler[int] = DistributedSampler(
            dataset, num_replicas=shards, rank=shard, seed=0, drop_last=True)
        self.per_epoch = len(self.sampler) // micro_batch
        if self.per_epoch < 1:
            raise ValueError(f"--micro-batch {micro_batch} is more than the {len(self.sampler)} "
                             "sequences of a data shard")
        self._epoch, self._order = -1, list[int]()

    def __call__(self, step: int) -> torch.Tensor:
        epoch, index = divmod(step - 1, self.per_epoch)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._epoch, self._order = epoch, list(self.sampler)
        rows = self._order[index * self.micro_batch : (index + 1) * self.micro_batch]
        return torch.stack([self.dataset[i] for i in rows])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--model", choices=MODELS, default="llama",
                        help="the small Llama, or a mixture-of-experts Llama (8 experts, "
                        "top-2; give it an expert-parallel plan such as plans/fsdp_ep.toml)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per data shard")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-grad-norm", type=float, default=None, metavar="NORM",
                        help="clip the whole model's gradient norm to NORM (any plan, "
                        "across meshes and pipeline stages)")
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("train-checkpoints"))
    parser.add_argument("--save-every", type=int, default=0, metavar="N",
                        help="commit a checkpoint every N steps (default: only at the end)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run from its newest committed checkpoint, if it "
                        "has one (a root holding several runs needs --run-id)")
    parser.add_argument("--run-id", metavar="ID",
                        help="the run this job saves as and resumes (default: "
                        "COMPOSER_PAR_RUN_ID, else on --resume the run of the checkpoint "
                        "resumed, else torchrun's --rdzv-id; see docs/checkpoints.md)")
    parser.add_argument("--keep-last", type=int, default=2, metavar="N",
                        help="keep this run's N newest committed steps (default 2); steps of "
                        "other runs are never deleted")
    parser.add_argument("--final-weights", type=Path, metavar="DIR",
                        help="at the end, export the trained parameters as safetensors to DIR")
    args = parser.parse_args()
    for name in ("steps", "micro_batch", "seq_len"):
        if getattr(args, name) < (2 if name == "seq_len" else 1):
            parser.error(f"--{name.replace('_', '-')} must be positive; got {getattr(args, name)}")
    if args.save_every < 0:
        parser.error(f"--save-every must be >= 0; got {args.save_every}")
    if args.keep_last < 1:
        parser.error(f"--keep-last must be at least 1; got {args.keep_last}")
    return args


def main() -> None:
    args = parse_args()
    # Read before any process group: its timeout is the plan's, so that no wait of this
    # job (the plan's groups, the default group's checkpoint collectives) is unbounded.
    plan = ParallelPlan.from_toml(args.plan)  # topology comes from torchrun's environment
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=plan.timeout)
    configure_logging()  # rank 0's events and any rank's errors; JSON lines off a terminal
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0"):
        # torch 2.13's torchrun keeps the store it shares with the workers across
        # restarts: a restarted group reads the dead workers' addresses and cannot connect.
        log.warning("torchrun restarts will fail to reconnect: export "
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun (docs/multi-node.md)")
    try:
        # A collective that times out names the ranks that never joined it.
        with name_stuck_ranks(plan.timeout):
            train(args, plan, torch.device("cuda") if cuda else torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def _show_threads() -> None:
    import threading

    from composer_par.teardown import native_threads

    print(f"rank {os.environ.get('RANK', '0')}: threads at exit: python "
          f"{[t.name for t in threading.enumerate()]}, native {native_threads()}",
          file=sys.stderr, flush=True)


def train(args: argparse.Namespace, plan: ParallelPlan, device: torch.device) -> None:
    with torch.device("meta"):
        built = build_model(args.model, args.seq_len)
    model = plan.apply(built)  # validated first: a PlanError lists every problem
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # One loop for every plan: with a pipeline (a [[plugins]] name = "pp") the step runs
    # its schedule; the optimizer stays ours, over this rank's parameters.
    # With context parallelism (a [[plugins]] name = "cp") each cp rank takes its part of
    # every sequence: tokens, labels (shifted on the whole sequence first) and positions,
    # and its loss averages, over the cp ranks, to the mean over every token.
    cp = context_of(model)
    # The MoE Llama's router loss: the step adds it (composer_par.aux_loss).
    loss_fn = next_token_loss if cp is None else cp.cross_entropy
    trainer = plan.training_step(model, loss_fn)

    step = 0
    if args.resume and _has_steps(args.checkpoint_dir, args.run_id):
        # A pipeline rank holds its stages' keys only; the checkpoint's others are its
        # peers' (a strict load would call them unexpected).
        step = checkpoint.load(args.checkpoint_dir, model, optimizer,
                               strict=plan.pipeline is None, run=args.run_id).step
        log.info("resumed", step=step, restart=os.environ.get("TORCHELASTIC_RESTART_COUNT"))

    # Ranks that differ only in TP or CP read the same samples; data-parallel ranks differ.
    shard, shards = plan.data_shard()
    data = corpus_tokens(4 * args.seq_len)  # at least a few windows
    batches = StepBatches(ByteWindows(data, args.seq_len), shards, shard, args.micro_batch)
    freeze = os.environ.get(FREEZE_ENV, "")
    if step >= args.steps:
        log.info("nothing to train", step=step, steps=args.steps)

    while step < args.steps:
        step += 1
        if freeze == f"{dist.get_rank()}:{step}":
            _freeze(step)
        tokens = batches(step).to(device)
        if cp is None:
            loss = trainer.step(tokens, tokens)  # the global batch's mean loss, on every rank
        else:
            positions = cp.positions(tokens.shape[1], device)
            loss = trainer.step((cp.shard(tokens), positions),
                                cp.shard(next_token_labels(tokens)))
        if args.max_grad_norm:
            trainer.clip_grad_norm_(args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        # The routing of the step's forward under EP (a collective over the ep ranks).
        routing = routing_summary(model, step)
        if routing is not None:
            _log_routing(routing, every_module=step % 10 == 0 or step == args.steps)
        if step % 10 == 0 or step == args.steps:
            log.info("step", step=step, loss=round(float(loss), 4))
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            path = checkpoint.save(args.checkpoint_dir, model, optimizer, step=step, plan=plan,
                                   keep_last=args.keep_last, run=args.run_id)
            log.info("saved", step=step, path=str(path))

    if args.final_weights is not None:
        checkpoint.export_safetensors(model, args.final_weights)
        log.info("exported", path=str(args.final_weights))


def _log_routing(routing: RoutingSummary, every_module: bool) -> None:
    """The step's routing over all experts modules; with ``every_module`` each module's
    tokens per expert too."""
    fields = routing.as_dict()
    modules = fields.pop("modules")
    log.info("ep routing", **fields)
    for module in modules if every_module else ():
        log.info("ep routing", step=routing.step, **module)


def _has_steps(root: Path, run: str | None) -> bool:
    """Whether --resume has a step to continue from: any committed one (the load then
    picks the run's), or with --run-id one of that run (a new run starts from scratch)."""
    if run is None:
        return checkpoint.latest(root) is not None
    from composer_par.checkpoint.runs import committed_by_run

    return run in committed_by_run(root)


def _freeze(step: int) -> None:
    print(f"rank {dist.get_rank()}: frozen at step {step} ({FREEZE_ENV}): alive, joining no "
          "collective", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    # Every process group destroyed and its threads joined before the interpreter's
    # teardown, on success and on error (composer_par.teardown).
    status = run_rank(main)
    if os.environ.get(THREADS_ENV):
        _show_threads()
    sys.exit(status)
