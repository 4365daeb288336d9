"""Rank-side functions for tests/test_item_mean.py (importable by rank processes)."""

from __future__ import annotations

from typing import Any

SEED = 5
STEPS = 2
LR = 0.5

_SEED_PLUGIN = f'\n[[plugins]]\nname = "meta_init"\nseed = {SEED}\n'
# Every layout over the whole global batch of 8 sequences; each differs in where the
# items fall: across data shards, microbatches, tp copies, pipeline stages, cp parts.
PLANS = {
    "fsdp2": '[mesh]\ndp_shard = 2\n\n[[plugins]]\nname = "fsdp2"\n',
    "hsdp_tp": ('[mesh]\ndp_replicate = 2\ndp_shard = 1\ntp = 2\n\n[[plugins]]\nname = "tp"\n\n'
                '[[plugins]]\nname = "hsdp"\n\n[[plugins]]\nname = "fsdp2"\n'),
    "pp_fsdp2": ('[mesh]\npp = 2\ndp_shard = 2\n\n[[plugins]]\nname = "pp"\n'
                 'schedule = "1F1B"\nmicrobatches = 2\n\n[[plugins]]\nname = "fsdp2"\n'),
    "cp_fsdp2": ('[mesh]\ndp_shard = 2\ncp = 2\n\n[[plugins]]\nname = "fsdp2"\n\n'
                 '[[plugins]]\nname = "cp"\n'),
}
WORLD = {"fsdp2": 2, "hsdp_tp": 4, "pp_fsdp2": 4, "cp_fsdp2": 4}


def task() -> Any:
    from tests.pp_workers import llama4

    return llama4


def labels_of(tokens: Any, step: int) -> Any:
    """Next-token labels with a different number of leading labels ignored in each
    sequence (a masked prompt), by its place in the global batch and the step: data
    shards, microbatches and cp parts then hold unevenly many."""
    from composer_par.plugins.cp import next_token_labels

    from composer_par.item_mean import IGNORE_INDEX

    labels = next_token_labels(tokens)
    seq = tokens.shape[1]
    for row in range(tokens.shape[0]):
        labels[row, :(row * 5 + step * 3) % (seq - 1)] = IGNORE_INDEX
    return labels


def train(layout: str, accumulate: int) -> dict[str, Any]:
    """``STEPS`` SGD steps of ``layout`` with the item-mean loss: the step's losses and
    every parameter of the whole model, full, on this rank."""
    import torch

    from composer_par.item_mean import cross_entropy_sum, labelled_tokens
    from composer_par.testing.parity import build_plan
    from tests.pp_workers import gathered_parameters

    plan = build_plan(PLANS[layout] + _SEED_PLUGIN)
    with torch.device("meta"):
        model = task().build()
    model = plan.apply(model)
    step = plan.training_step(model, cross_entropy_sum, accumulate=accumulate,
                              items=labelled_tokens, check_replicas_every=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    cp = plan.notes.get("cp")
    index, count = plan.data_shard()
    losses = []
    for i in range(STEPS):
        tokens = task().batch(i)
        labels = labels_of(tokens, i).chunk(count)[index]
        tokens = tokens.chunk(count)[index]
        kwargs = {}
        if cp is not None:
            kwargs["positions"] = cp.positions(tokens.shape[1]).expand(tokens.shape[0], -1)
            tokens, labels = cp.shard(tokens), cp.shard(labels)
        losses.append(float(step.step(tokens, labels, **kwargs)))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "params": gathered_parameters(model)}


def reference(item_mean: bool = True) -> dict[str, Any]:
    """The same training on one process, the whole global batch in one step: the loss
    over every labelled token (``item_mean=False``: the mean of each half's mean, what
    two data-parallel ranks average without ``items``)."""
    import torch

    from composer_par import MeshSpec, MetaInit, ParallelPlan
    from composer_par.item_mean import cross_entropy_sum, labelled_tokens
    from composer_par.testing.parity import full_parameters

    with torch.device("meta"):
        model = task().build()
    model = ParallelPlan(MeshSpec()).use(MetaInit(seed=SEED, device="cpu")).apply(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for i in range(STEPS):
        tokens = task().batch(i)
        labels = labels_of(tokens, i)
        if item_mean:
            loss = cross_entropy_sum(model(tokens), labels) / labelled_tokens(labels)
        else:
            halves = zip(tokens.chunk(2), labels.chunk(2), strict=True)
            loss = torch.stack([cross_entropy_sum(model(t), y) / labelled_tokens(y)
                                for t, y in halves]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": full_parameters(model)}


def count_differently_on_tp_ranks() -> str:
    """A step whose two tp ranks are given different targets: what it raises."""
    import torch

    from composer_par.item_mean import IGNORE_INDEX, cross_entropy_sum, labelled_tokens
    from composer_par.testing.parity import build_plan

    plan = build_plan('[mesh]\ntp = 2\n\n[[plugins]]\nname = "tp"\n' + _SEED_PLUGIN)
    with torch.device("meta"):
        model = task().build()
    model = plan.apply(model)
    step = plan.training_step(model, cross_entropy_sum, items=labelled_tokens,
                              check_replicas_every=None)
    tokens = task().batch(0)
    labels = labels_of(tokens, 0)
    labels[0, : torch.distributed.get_rank() + 1] = IGNORE_INDEX
    try:
        step.step(tokens, labels)
    except ValueError as exc:
        return str(exc)
    return "no error"
