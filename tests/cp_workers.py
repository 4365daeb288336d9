"""Tasks and rank-side functions for tests/test_cp.py (importable by rank processes)."""

from __future__ import annotations

from typing import Any

from composer_par.testing.tasks import LlamaTask


class ContextLlama(LlamaTask):
    """The Llama task, each cp rank taking its part of every sequence: tokens, labels and
    positions cut by the plan's :class:`ContextShard`; without CP (the reference) the
    whole sequence. The loss is the mean over every labelled token either way."""

    def loss(self, model: Any, batch: Any) -> Any:
        import torch.nn.functional as F
        from composer_par.plugins.cp import context_of, next_token_labels

        labels = next_token_labels(batch)
        cp = context_of(model)
        if cp is None:
            logits = model(batch)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        positions = cp.positions(batch.shape[1])
        return cp.cross_entropy(model(cp.shard(batch), positions), cp.shard(labels))


llama = ContextLlama()
# Four KV heads: alltoall over 4 ranks, and TP, need head counts they divide.
llama_kv4 = ContextLlama(n_kv_heads=4)


class ContextHF:
    """A Hugging Face decoder from tests/hf_workers.py's tiny config (SDPA attention),
    trained on next-token prediction; each cp rank takes its part of the tokens, labels
    and ``position_ids``."""

    def __init__(self, family: str, **overrides: Any) -> None:
        self.family, self.overrides = family, overrides

    def build(self) -> Any:
        import torch
        import transformers

        from tests import hf_workers

        config = hf_workers.config(self.family, **self.overrides)
        config._attn_implementation = "sdpa"
        cls = getattr(transformers, hf_workers.FAMILIES[self.family][1])
        with torch.device("meta"):
            return cls(config)

    def batch(self, step: int) -> Any:
        from tests import hf_workers

        return hf_workers.batch(self.family, step)["input_ids"]

    def loss(self, model: Any, batch: Any) -> Any:
        import torch
        import torch.nn.functional as F
        from composer_par.plugins.cp import context_of, next_token_labels

        labels = next_token_labels(batch)
        cp = context_of(model)
        if cp is None:
            positions = torch.arange(batch.shape[1])[None].expand_as(batch)
            logits = model(input_ids=batch, position_ids=positions).logits
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                   labels.reshape(-1))
        positions = cp.positions(batch.shape[1])[None].expand(batch.shape[0], -1)
        logits = model(input_ids=cp.shard(batch), position_ids=positions).logits
        return cp.cross_entropy(logits, cp.shard(labels))


hf_llama = ContextHF("llama")
hf_qwen3 = ContextHF("qwen3")
# Sliding-window layers narrower than the sequence, so the window masks something.
hf_mistral = ContextHF("mistral", sliding_window=6)
hf_gemma3 = ContextHF("gemma3", sliding_window=6)


def train_with_training_step(case: Any) -> tuple[list[float], dict[str, Any]]:
    """The rank side of a parity case through ``plan.training_step``, as
    examples/train.py runs it: the step takes this rank's tokens and positions and its
    labels, and returns the global batch's mean loss."""
    from composer_par.plugins.cp import context_of, next_token_labels

    from composer_par.testing.parity import full_parameters, start_rank

    task, plan, model, index, count, optimizer = start_rank(case)
    cp = context_of(model)
    assert cp is not None or plan.pipeline is not None
    cp = plan.notes["cp"]
    trainer = plan.training_step(model, cp.cross_entropy)
    losses = []
    for step in range(case.steps):
        tokens = task.batch(step).chunk(count)[index]
        # Positions per sample, so that a pipeline cuts them into microbatches as it
        # cuts the tokens (every stage is given them).
        positions = cp.positions(tokens.shape[1]).expand(tokens.shape[0], -1)
        loss = trainer.step(cp.shard(tokens), cp.shard(next_token_labels(tokens)),
                            positions=positions)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    if plan.pipeline is not None:
        from tests.pp_workers import gathered_parameters

        # Each stage's ranks hold its parameters only: every rank gets all of them,
        # the copies of every rank holding one found equal.
        return losses, gathered_parameters(model)
    return losses, full_parameters(model)


def train_many_with_training_step(cases: list[Any]) -> list[tuple[list[float], dict[str, Any]]]:
    """:func:`train_with_training_step` for several cases in one run of the ranks."""
    return [train_with_training_step(case) for case in cases]


class ContextMoELlama:
    """The MoE Llama task of tests/ep_workers.py with the cp cut of
    :class:`ContextLlama`, plus the routers' load-balancing loss: without CP (the
    reference) of whole sequences, under CP totalled over the cp ranks' parts."""

    def __init__(self, **options: Any) -> None:
        from tests.ep_workers import MoELlamaTask

        self.inner = MoELlamaTask(**options)

    def build(self) -> Any:
        return self.inner.build()

    def batch(self, step: int) -> Any:
        return self.inner.batch(step)

    def loss(self, model: Any, batch: Any) -> Any:
        from composer_par.plugins.cp import context_of, next_token_labels

        from composer_par.models.moe_llama import moe_loss

        cp = context_of(model)
        if cp is None:
            return moe_loss(model, batch)
        logits = model(cp.shard(batch), cp.positions(batch.shape[1]))
        loss = cp.cross_entropy(logits, cp.shard(next_token_labels(batch)))
        return loss + model.config.aux_loss_coef * model.aux_loss()


# Sequences of 16: each of 2 cp ranks holds two chunks of 4.
moe_llama = ContextMoELlama(seq_len=16)


def _router_loss_task(family: str) -> Any:
    from tests.ep_pp_workers import HFRouterLossTask

    return HFRouterLossTask(family, global_batch=4, seq_len=16)


# Hugging Face MoE families whose router loss plan.training_step adds (add_router_loss);
# the reference is transformers' own loss of whole sequences.
hf_mixtral_router = _router_loss_task("mixtral")
hf_qwen3_moe_router = _router_loss_task("qwen3_moe")


def train_router_loss_with_training_step(case: Any) -> tuple[list[float], dict[str, Any]]:
    """The rank side of a parity case on a Hugging Face MoE model through
    ``plan.training_step``: this rank's tokens, labels and ``position_ids``, the
    next-token loss given, the router loss added by the step."""
    from composer_par.plugins.cp import next_token_labels

    from composer_par.testing.parity import full_parameters, start_rank

    task, plan, model, index, count, optimizer = start_rank(case)
    cp = plan.notes["cp"]
    trainer = plan.training_step(model, lambda out, labels: cp.cross_entropy(out.logits,
                                                                            labels))
    losses = []
    for step in range(case.steps):
        tokens = task.batch(step).chunk(count)[index]
        positions = cp.positions(tokens.shape[1])[None].expand(tokens.shape[0], -1)
        loss = trainer.step(cp.shard(tokens), cp.shard(next_token_labels(tokens)),
                            position_ids=positions)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, full_parameters(model)


def forward_without_positions(task_name: str) -> dict[str, str]:
    """CP 2 over ``task_name``'s model (a task of this module): what a forward on this
    rank's tokens raises without positions, and what it does with them (keyword and, for
    the project's Llama, positional)."""
    import torch

    from composer_par import CP, MeshSpec, MetaInit, ParallelPlan

    task = globals()[task_name]
    plan = ParallelPlan(MeshSpec(cp=2)).use(CP()).use(MetaInit())
    model = plan.apply(task.build() if isinstance(task, ContextHF)
                       else _on_meta(task.build))
    cp = plan.notes["cp"]
    whole = task.batch(0)
    tokens = cp.shard(whole)
    local = tokens.shape[1]
    positions = cp.positions(local * 2)[None].expand(tokens.shape[0], -1)
    hf = isinstance(task, ContextHF)
    keyword = "position_ids" if hf else "positions"

    def numbered(start: int, length: int) -> Any:
        return torch.arange(start, start + length)[None].expand(tokens.shape[0], -1)

    out: dict[str, str] = {}
    # The layout mistakes first: a forward the check refuses leaves it armed.
    contiguous = whole[:, cp.rank * local:(cp.rank + 1) * local]
    calls = {"without": lambda: model(tokens),
             "unsharded": lambda: model(whole, **{keyword: numbered(0, whole.shape[1])}),
             "numbered_here": lambda: model(tokens, **{keyword: numbered(0, local)}),
             "contiguous": lambda: model(contiguous,
                                         **{keyword: numbered(cp.rank * local, local)}),
             "keyword": lambda: model(tokens, **{keyword: positions})}
    if hf:
        from composer_par.plugins.cp import next_token_labels

        labels = cp.shard(next_token_labels(whole))
        calls["labels"] = lambda: model(tokens, position_ids=positions, labels=tokens)
        calls["shift_labels"] = lambda: model(tokens, position_ids=positions, labels=labels,
                                              shift_labels=labels)
    if not hf:
        calls["positional"] = lambda: model(tokens, positions)
    for label, call in calls.items():
        try:
            with torch.no_grad():
                call()
        except ValueError as exc:
            out[label] = str(exc)
        else:
            out[label] = "ran"
    return out


def positions_judged(seed: int) -> dict[str, str | None]:
    """What :func:`misplaced` says, on this rank of a cp group of the whole world, of
    the positions the layout gives, of packed documents' positions cut by ``cp.shard``
    (equal halves, documents starting at chunk boundaries, random lengths), and of the
    mistakes: every rank numbered from 0, a contiguous split."""
    import torch
    import torch.distributed as dist
    from composer_par.plugins.cp import ContextShard
    from composer_par.plugins.cp.positions import misplaced

    size, rank = dist.get_world_size(), dist.get_rank()
    shard = ContextShard(dist.group.WORLD, size, rank, "allgather")
    seq = 8 * size
    local = seq // size

    def packed(lengths: list[int]) -> Any:
        return torch.cat([torch.arange(n) for n in lengths])[None]

    generator = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(seq - 1, generator=generator)[:size].add(1).tolist())
    random_docs = [b - a for a, b in zip([0, *cuts], [*cuts, seq], strict=True)]
    given = {
        "layout": shard.positions(seq),
        "layout_batch": shard.positions(seq)[None].expand(3, -1),
        "two_halves": shard.shard(packed([seq // 2, seq // 2])),
        "chunk_docs": shard.shard(packed([4] * (2 * size))),
        "random_docs": shard.shard(packed(random_docs)),
        "numbered_here": torch.arange(local),
        "contiguous": torch.arange(rank * local, (rank + 1) * local),
    }
    return {label: misplaced(positions, shard) for label, positions in given.items()}


def _on_meta(build: Any) -> Any:
    import torch

    with torch.device("meta"):
        return build()
