"""One training step through a trainer's adapter vs the plain plan loop, same plan.

One function per adapter: each trains the same plan on the same Llama (built on meta,
MetaInit, so every side starts from the same weights) on 4 gloo ranks, through the
trainer and through the plain loop (``plan.training_step`` and a torch AdamW), timing
the steps of both interleaved in one run, so that machine noise hits them alike. A step's
wall time is the slowest rank's (ranks start each step together, after a barrier); its
CPU time is what all ranks' processes spent.

* ``lightning``: Lightning Fabric (``FabricStrategy``: forward, ``fabric.backward``, step,
  zero_grad, and the loss averaged over the ranks as ``plan.training_step`` returns it)
  and the Lightning Trainer (``TrainerStrategy``: one ``training_step`` per batch, timed
  by a callback from batch start to batch end, its optimizer step and hooks included).
  The Trainer's fit is the outer loop: between two of its steps the callback runs one
  plain step and one Fabric step, alternating which goes first.
* ``accelerate``: ``prepare_accelerator`` and ``accelerator.prepare`` (forward,
  ``accelerator.backward``, the AcceleratedOptimizer's step and zero_grad, the loss
  averaged with ``accelerator.reduce``), interleaved step by step with the plain loop.
* ``hf_trainer``: ``PlanTrainer`` (one Trainer step: forward, backward, the grad norm it
  logs, the optimizer and scheduler steps, zero_grad; timed by a callback from
  on_step_begin to on_step_end), a plain step run by the callback after each.

    .venv/bin/python benchmarks/bench_integrations.py [--adapter lightning] [--repeats 30]

Prints per adapter the minima and medians of each side, their ratios adapter / plain,
and the paired ratio: the median over the steps of each adapter step's time over the
plain step that ran next to it. The target (<= 1.03) is read on the paired ratio: on a
shared machine a minimum is one lucky step (a plain step's minimum alone moved the
ratio of minima from 1.02 to 1.18 between two runs), while neighbouring steps see the
same machine, so their ratio moves least.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

TARGET = 1.03
RANKS = 4
MESH = {"dp_shard": 2, "tp": 2}


def _plan() -> Any:
    from composer_par import FSDP2, TP, MeshSpec, MetaInit, ParallelPlan

    return ParallelPlan(MeshSpec(**MESH)).use(FSDP2()).use(TP()).use(MetaInit(seed=0))


def _llama(layers: int, dim: int, seq: int) -> Any:
    from composer_par.models.llama import Llama, LlamaConfig

    return Llama(LlamaConfig(dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2,
                             ffn_hidden=2 * dim, max_seq_len=seq))


def _loss(outputs: Any, tokens: Any) -> Any:
    from composer_par.models.llama import next_token_loss

    return next_token_loss(outputs, tokens)


class _Clock:
    def __init__(self) -> None:
        import torch.distributed as dist

        dist.barrier()
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


# -- Lightning ------------------------------------------------------------------------------


class _PlainLoop:
    """The plain side of a rank: the project's Llama under the same plan, trained by
    ``plan.training_step`` and a torch AdamW on this rank's share of each global batch
    (``tokens`` holds one global batch per step)."""

    def __init__(self, layers: int, dim: int, seq: int, batch: int, steps: int) -> None:
        import torch

        gen = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, 256, (batch * steps, seq), generator=gen)
        self.batch = batch
        plan = _plan()
        with torch.device("meta"):
            model = _llama(layers, dim, seq)
        model = plan.apply(model)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.training_step = plan.training_step(model, _loss)
        self.index, self.count = plan.data_shard()

    def local(self, step: int) -> Any:
        """This rank's part of step ``step``'s global batch."""
        whole = self.tokens[step * self.batch:(step + 1) * self.batch]
        return whole.chunk(self.count)[self.index]

    def step(self, step: int) -> tuple[float, float]:
        x = self.local(step)
        clock = _Clock()
        self.training_step.step(x, x)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return clock.stop()


def lightning_rank(layers: int, dim: int, seq: int, batch: int, repeats: int,
                   warmup: int) -> dict[str, Any]:
    """Rank side: the Trainer's fit drives; plain and Fabric steps run between its steps."""
    import lightning as L
    import torch
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader, TensorDataset

    from composer_par.integrations.lightning import FabricStrategy, TrainerStrategy

    steps = warmup + repeats
    loop = _PlainLoop(layers, dim, seq, batch, steps)
    tokens, count = loop.tokens, loop.count
    per_rank = batch // count

    fabric = Fabric(strategy=FabricStrategy(_plan()), devices=RANKS, accelerator="cpu")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        fabric_model = _llama(layers, dim, seq)
    fabric_model = fabric.setup_module(fabric_model)
    fabric_opt = fabric.setup_optimizers(torch.optim.AdamW(fabric_model.parameters(), lr=1e-4))

    local, plain = loop.local, loop.step

    def through_fabric(step: int) -> tuple[float, float]:
        x = local(step)
        clock = _Clock()
        loss = _loss(fabric_model(x), x)
        fabric.backward(loss)
        fabric_opt.step()
        fabric_opt.zero_grad()
        fabric.all_reduce(loss.detach(), reduce_op="mean")
        return clock.stop()

    times: dict[str, list[tuple[float, float]]] = {"plain": [], "fabric": [], "trainer": []}

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = _llama(layers, dim, seq)

        def training_step(self, data: Any, batch_idx: int) -> Any:
            (x,) = data
            loss = _loss(self.model(x), x)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    class Interleave(L.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, data: Any, i: int) -> None:
            self.clock = _Clock()

        def on_train_batch_end(self, trainer: Any, module: Any, out: Any, data: Any,
                               i: int) -> None:
            spent = self.clock.stop()
            sides: list[tuple[str, Callable[[int], tuple[float, float]]]] = [
                ("plain", plain), ("fabric", through_fabric)]
            for name, run in sides if i % 2 == 0 else sides[::-1]:
                taken = run(i)
                if i >= warmup:
                    times[name].append(taken)
            if i >= warmup:
                times["trainer"].append(spent)

    # The Trainer's sampler (from plan.data_shard()) gives each rank what local() does:
    # without shuffling, rank r of n reads samples r, r + n, ...; the plain and Fabric
    # sides read contiguous chunks, which is the same amount of work.
    trainer = L.Trainer(strategy=TrainerStrategy(_plan()), devices=RANKS, accelerator="cpu",
                        max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[Interleave()])
    trainer.fit(Lit(), DataLoader(TensorDataset(tokens), batch_size=per_rank))
    return times


def bench_lightning(args: argparse.Namespace) -> dict[str, Any]:
    from composer_par.testing.distributed import run_ranks

    results = run_ranks("bench_integrations:lightning_rank", RANKS,
                        args=(args.layers, args.dim, args.seq, args.batch, args.repeats,
                              args.warmup), timeout=1800)
    return _summarize("lightning", results, ("fabric", "trainer"), args.repeats)


# -- accelerate -----------------------------------------------------------------------------


def accelerate_rank(layers: int, dim: int, seq: int, batch: int, repeats: int,
                    warmup: int) -> dict[str, Any]:
    """Rank side: plain steps and steps through the accelerate adapter, interleaved
    (alternating which goes first); each side has its own model from the same weights."""
    import torch

    from composer_par.integrations.accelerate import prepare_accelerator

    steps = warmup + repeats
    loop = _PlainLoop(layers, dim, seq, batch, steps)

    with torch.device("meta"):
        meta = _llama(layers, dim, seq)
    accelerator, model = prepare_accelerator(_plan(), meta)
    model, optimizer = accelerator.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    local, plain = loop.local, loop.step

    def through_accelerate(step: int) -> tuple[float, float]:
        x = local(step)
        clock = _Clock()
        loss = _loss(model(x), x)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.reduce(loss.detach(), reduction="mean")
        return clock.stop()

    times: dict[str, list[tuple[float, float]]] = {"plain": [], "accelerate": []}
    sides: list[tuple[str, Callable[[int], tuple[float, float]]]] = [
        ("plain", plain), ("accelerate", through_accelerate)]
    for i in range(steps):
        for name, run in sides if i % 2 == 0 else sides[::-1]:
            taken = run(i)
            if i >= warmup:
                times[name].append(taken)
    return times


def bench_accelerate(args: argparse.Namespace) -> dict[str, Any]:
    from composer_par.testing.distributed import run_ranks

    results = run_ranks("bench_integrations:accelerate_rank", RANKS,
                        args=(args.layers, args.dim, args.seq, args.batch, args.repeats,
                              args.warmup), timeout=1800)
    return _summarize("accelerate", results, ("accelerate",), args.repeats)


# -- the Hugging Face Trainer -------------------------------------------------------------


def hf_trainer_rank(layers: int, dim: int, seq: int, batch: int, repeats: int,
                    warmup: int) -> dict[str, Any]:
    """Rank side: the Trainer's train drives; a callback times each of its steps (from
    on_step_begin to on_step_end: forward, backward, the grad norm it logs, the optimizer
    and scheduler steps, zero_grad) and runs one plain step after it. Both sides train
    Hugging Face's LlamaForCausalLM of the same size as the other adapters' Llama (the
    Trainer writes to a model's config, which the project's Llama keeps frozen)."""
    import tempfile

    import torch
    import transformers

    from composer_par.integrations.hf_trainer import PlanTrainer

    transformers.logging.set_verbosity_error()
    gen = torch.Generator().manual_seed(0)
    steps = warmup + repeats
    tokens = torch.randint(0, 256, (batch * steps, seq), generator=gen)

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
        use_cache=False)

    def hf_llama() -> Any:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(config)

    plain_plan = _plan()
    plain_model = plain_plan.apply(hf_llama())
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-4)
    plain_step = plain_plan.training_step(plain_model, lambda out, _ids: out.loss)
    index, count = plain_plan.data_shard()

    def plain(step: int) -> tuple[float, float]:
        x = tokens[step * batch:(step + 1) * batch].chunk(count)[index]
        clock = _Clock()
        plain_step.step((), x, input_ids=x, labels=x)
        plain_opt.step()
        plain_opt.zero_grad()
        return clock.stop()

    class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return len(tokens)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": tokens[i], "labels": tokens[i]}

    times: dict[str, list[tuple[float, float]]] = {"plain": [], "trainer": []}

    class Interleave(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.clock = _Clock()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            spent = self.clock.stop()
            i = state.global_step - 1
            taken = plain(i)
            if i >= warmup:
                times["trainer"].append(spent)
                times["plain"].append(taken)

    model = hf_llama()
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="bench-trainer-"), use_cpu=True, max_steps=steps,
        per_device_train_batch_size=batch // count, learning_rate=1e-4, optim="adamw_torch",
        weight_decay=0.0, lr_scheduler_type="constant", max_grad_norm=0.0,
        train_sampling_strategy="sequential", logging_strategy="no", save_strategy="no",
        report_to="none", disable_tqdm=True, average_tokens_across_devices=False)
    trainer = PlanTrainer(_plan(), model=model, args=args, train_dataset=Tokens(),
                          callbacks=[Interleave()])
    trainer.train()
    return times


def bench_hf_trainer(args: argparse.Namespace) -> dict[str, Any]:
    from composer_par.testing.distributed import run_ranks

    results = run_ranks("bench_integrations:hf_trainer_rank", RANKS,
                        args=(args.layers, args.dim, args.seq, args.batch, args.repeats,
                              args.warmup), timeout=1800)
    return _summarize("hf_trainer", results, ("trainer",), args.repeats)


def _summarize(adapter: str, results: list[dict[str, Any]], sides: tuple[str, ...],
               repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {"adapter": adapter, "sides": {}}
    for metric, index, combine in (("wall", 0, max), ("cpu", 1, sum)):
        plain = [combine(r["plain"][i][index] for r in results) for i in range(repeats)]
        for side in sides:
            theirs = [combine(r[side][i][index] for r in results) for i in range(repeats)]
            out["sides"].setdefault(side, {})[metric] = {
                "min_ms": min(theirs) * 1e3, "plain_min_ms": min(plain) * 1e3,
                "median_ms": statistics.median(theirs) * 1e3,
                "plain_median_ms": statistics.median(plain) * 1e3,
                "ratio_min": min(theirs) / min(plain),
                "ratio_median": statistics.median(theirs) / statistics.median(plain),
                "ratio_paired": statistics.median(t / p for t, p in zip(theirs, plain,
                                                                        strict=True))}
    return out


ADAPTERS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "accelerate": bench_accelerate,
    "hf_trainer": bench_hf_trainer,
    "lightning": bench_lightning,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--adapter", choices=sorted(ADAPTERS), action="append",
                        help="the adapters to measure (default: all)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()

    load_before = os.getloadavg()
    reports = [ADAPTERS[name](args) for name in (args.adapter or sorted(ADAPTERS))]
    load_after = os.getloadavg()
    if args.json:
        print(json.dumps({"target": TARGET, "mesh": MESH, "reports": reports,
                          "load_average": [load_before[0], load_after[0]]}, indent=2))
        return
    print(f"one training step through a trainer's adapter vs the plain plan loop: plan "
          f"FSDP2 x TP {MESH}, Llama {args.layers} blocks, dim {args.dim}, seq {args.seq}, "
          f"global batch {args.batch}, {RANKS} gloo ranks, {args.repeats} interleaved "
          f"repeats ({os.cpu_count()} cores; load average {load_before[0]:.1f} before, "
          f"{load_after[0]:.1f} after)")
    for report in reports:
        for side, metrics in report["sides"].items():
            print(f"  {report['adapter']}: {side}")
            for metric, m in metrics.items():
                label = "wall (slowest rank)" if metric == "wall" else "cpu (all ranks)"
                verdict = "meets" if m["ratio_paired"] <= TARGET else "MISSES"
                print(f"    {label:20s} paired ratio {m['ratio_paired']:.3f} ({verdict} <= "
                      f"{TARGET})   min {m['min_ms']:7.1f} ms, plain {m['plain_min_ms']:7.1f} "
                      f"ms: ratio {m['ratio_min']:.3f}   median {m['median_ms']:7.1f} ms, "
                      f"plain {m['plain_median_ms']:7.1f} ms: ratio {m['ratio_median']:.3f}")


if __name__ == "__main__":
    main()
