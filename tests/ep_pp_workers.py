"""Rank-side functions of tests/test_ep_pp.py: expert parallelism under a pipeline,
trained with the plan's training step and compared with one process.

The MoE Llama's load-balancing loss is made in every block; under a pipeline only the
last stage calls the loss function, so each block adds its part as a side gradient
(:mod:`composer_par.aux_loss`) and the step reports ``next-token + aux``. A Hugging Face
model's router loss pools all layers: its statistics travel from stage to stage. A
load-balancing loss of a batch is not the mean of its halves', so the reference is one
process accumulating gradients over the same microbatches the ranks run: the global
batch cut into the data shards, each shard into the pipeline's microbatches, in order,
each microbatch's loss with its aux loss (``moe_loss``, transformers' own) backpropagated
and the gradients averaged.
"""

from __future__ import annotations

from typing import Any

import attrs

from tests.ep_workers import HFMoETask, MoELlamaTask

# Four blocks (two per stage, four stages under Interleaved1F1B), a shared expert, and
# a batch that gives each of 2 data shards 4 microbatches of 2 sequences.
moe_llama = MoELlamaTask(n_layers=4, num_experts=4, shared_expert=True, global_batch=16)


def next_token_from_logits(outputs: Any, tokens: Any) -> Any:
    """Next-token cross-entropy of a Hugging Face causal LM's ``outputs.logits``."""
    import torch.nn.functional as F

    logits = outputs.logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def step_loss(task: Any) -> Any:
    """What the training step is given: the main loss alone (the step adds the aux)."""
    if isinstance(task, MoELlamaTask):
        from composer_par.models.llama import next_token_loss

        return next_token_loss
    return next_token_from_logits


@attrs.frozen
class HFRouterLossTask(HFMoETask):
    """A Hugging Face MoE family whose router loss the training step adds
    (composer_par.models.hf_router_loss: pooled over every layer, carried from stage to
    stage). The reference is transformers' own loss with ``output_router_logits=True``
    (HFMoETask.loss); outside a step the hooks change nothing."""

    def build(self) -> Any:
        from composer_par.models.hf_router_loss import add_router_loss

        model = super().build()
        assert add_router_loss(model) > 0
        return model


mixtral = HFRouterLossTask("mixtral", global_batch=8)
qwen3_moe = HFRouterLossTask("qwen3_moe", global_batch=8)


@attrs.frozen
class Case:
    task: str  # an attribute of this module
    plan: str  # plan-file TOML
    world_size: int
    microbatches: int  # per data shard per step: the pipeline's, or accumulate's
    accumulate: int = 1
    steps: int = 3
    lr: float = 0.5


def train(case: Case) -> tuple[list[float], dict[str, Any]]:
    """One rank: apply the plan to the task's model built on meta, train ``case.steps``
    SGD steps with ``plan.training_step``; the losses it returned (checked equal on every
    rank) and this rank's full parameters (its stage's, experts gathered over ep)."""
    import torch
    import torch.distributed as dist

    from composer_par.testing.parity import apply_to_built, build_plan, full_parameters

    task = globals()[case.task]
    plan = build_plan(case.plan)
    model, index, count = apply_to_built(task, plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=case.lr)
    step = plan.training_step(model, step_loss(task), accumulate=case.accumulate)
    losses = []
    for n in range(case.steps):
        tokens = task.batch(n).chunk(count)[index]
        loss = step.step(tokens, tokens)
        seen = [torch.empty(()) for _ in range(dist.get_world_size())]
        dist.all_gather(seen, loss)
        assert all(bool(s == seen[0]) for s in seen), f"ranks' losses differ: {seen}"
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, full_parameters(model)


def train_all(cases: list[Case]) -> list[tuple[list[float], dict[str, Any]]]:
    """Several cases in one launch of the ranks (starting processes costs more)."""
    return [train(case) for case in cases]


def reference(case: Case, shards: int, with_aux: bool = True
              ) -> tuple[list[float], dict[str, Any]]:
    """One process, the same MetaInit weights and batches: each step accumulates the
    gradients of ``shards x case.microbatches`` microbatches (``with_aux=False``: the
    next-token loss alone, to show the aux loss matters)."""
    import torch

    from composer_par import MeshSpec, ParallelPlan
    from composer_par.models.llama import next_token_loss
    from composer_par.testing.parity import build_plan, full_parameters

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        task = globals()[case.task]
        meta_init = build_plan(case.plan).plugin("meta_init")
        with torch.device("meta"):
            model = task.build()
        model = ParallelPlan(MeshSpec()).use(
            attrs.evolve(meta_init, device="cpu")).apply(model)  # type: ignore[misc, arg-type]
        optimizer = torch.optim.SGD(model.parameters(), lr=case.lr)
        pieces = shards * case.microbatches
        losses = []
        for n in range(case.steps):
            total = 0.0
            for tokens in task.batch(n).chunk(pieces):
                if with_aux:
                    loss = task.loss(model, tokens)
                elif isinstance(task, MoELlamaTask):
                    loss = next_token_loss(model(tokens), tokens)
                else:
                    loss = next_token_from_logits(model(input_ids=tokens), tokens)
                loss.backward()
                total += float(loss.detach())
            for param in model.parameters():
                param.grad.div_(pieces)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(total / pieces)
        return losses, full_parameters(model)
    finally:
        torch.set_num_threads(threads)
