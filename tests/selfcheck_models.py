"""Models, plans and samplers for tests/test_selfcheck.py: a correct plan on the project's
Llama and on a Hugging Face Llama, and one planted defect each for the ladder to catch.
Rank processes import them by name (``--model tests.selfcheck_models:llama``)."""

from __future__ import annotations

import os
from typing import Any, ClassVar

import attrs

from composer_par.plugin import Plugin, hookimpl

# FSDP2 x TP with activation checkpointing and MetaInit: the demo's default plan.
PLAN = """\
[mesh]
dp_shard = 2
tp = 2

[[plugins]]
name = "tp"

[[plugins]]
name = "activation_checkpoint"
mode = "full"

[[plugins]]
name = "fsdp2"

[[plugins]]
name = "meta_init"
seed = 0
"""
# tp outermost: the rung of 2 ranks keeps tp and folds dp_shard.
TP_FIRST_PLAN = PLAN.replace("dp_shard = 2\ntp = 2", "tp = 2\ndp_shard = 2")


def llama() -> Any:
    from composer_par.testing.tasks import LlamaTask

    return LlamaTask(n_layers=2, dim=32, n_heads=4, n_kv_heads=2).build()


def hf_llama() -> Any:
    from tests import hf_workers

    return hf_workers.build("llama", use_cache=False)




def nondeterministic_llama() -> Any:
    """The Llama with a scatter (``put_``) in its forward: an op torch has no
    deterministic implementation of, so deterministic mode refuses it."""
    import torch

    model = llama()
    inner = model.forward

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(tokens.numel(), device=tokens.device)
        mask.put_(torch.tensor([0], device=tokens.device),
                  torch.tensor([1.0], device=tokens.device))
        return inner(tokens) * mask.view(*tokens.shape, 1)[..., :1]

    model.forward = forward
    return model


def duplicate_sampler(dataset: Any, *, num_replicas: int, rank: int, seed: int) -> Any:
    """Every data-parallel rank gets shard 0's samples: the classic bug of a sampler
    built without the rank."""
    from torch.utils.data import DistributedSampler

    return DistributedSampler(dataset, num_replicas=num_replicas, rank=0, shuffle=True,
                              seed=seed, drop_last=True)


@attrs.frozen
class NudgeOnTPRank(Plugin):
    """After apply, moves one replicated parameter (the final norm's weight, Replicate
    over tp) by ``amount`` on tp coordinate 1 only."""

    name: ClassVar[str] = "nudge_on_tp_rank"
    amount: float = 1e-3

    @hookimpl
    def composer_par_finalize(self, ctx: Any) -> str:
        import torch

        if ctx.mesh.coordinate(ctx.rank).get("tp", 0) == 1:
            weight = ctx.model.norm.weight
            with torch.no_grad():
                weight.to_local().add_(self.amount)
        return f"nudged norm.weight by {self.amount} on tp coordinate 1"


def nudged_plan() -> Any:
    from composer_par import ParallelPlan

    return ParallelPlan.from_toml(TP_FIRST_PLAN).use(NudgeOnTPRank())


def seed_per_rank_plan() -> Any:
    """MetaInit seeded with the rank: every rank initializes another model."""
    from composer_par import MetaInit, ParallelPlan

    plan = ParallelPlan.from_toml(PLAN.replace("seed = 0\n", ""))
    plan.plugins = [p for p in plan.plugins if p.name != "meta_init"]
    return plan.use(MetaInit(seed=int(os.environ.get("RANK", "0"))))


# -- like with like: a bf16 plan, an MoE plan, defects under bf16 ---------------------------

# What GPU users run: FSDP2 in bf16 mixed precision (fp32 reductions), MetaInit.
BF16_PLAN = """\
[mesh]
dp_shard = 2

[[plugins]]
name = "fsdp2"
mixed_precision = "bf16"

[[plugins]]
name = "meta_init"
seed = 0
"""
# tp outermost, FSDP2 in bf16: the rung of 2 ranks keeps tp.
TP_FIRST_BF16_PLAN = TP_FIRST_PLAN.replace('name = "fsdp2"\n',
                                           'name = "fsdp2"\nmixed_precision = "bf16"\n')


def nudged_bf16_plan() -> Any:
    from composer_par import ParallelPlan

    return ParallelPlan.from_toml(TP_FIRST_BF16_PLAN).use(NudgeOnTPRank())


# Qwen3's attention split over tp, its per-head norms declared replicated: their gradients
# are each rank's part (the reduction check names them).
NORMS_REPLICATED_PLAN = """\
[mesh]
tp = 2

[[plugins]]
name = "tp"
[plugins.plan]
"model.embed_tokens" = "embedding_rowwise"
"model.layers.*.self_attn.q_proj" = "colwise"
"model.layers.*.self_attn.k_proj" = "colwise"
"model.layers.*.self_attn.v_proj" = "colwise"
"model.layers.*.self_attn.o_proj" = "rowwise"
"model.layers.*.self_attn.q_norm" = "replicate"
"model.layers.*.self_attn.k_norm" = "replicate"
"lm_head" = "colwise_gather"

[[plugins]]
name = "meta_init"
seed = 0
"""


def qwen3() -> Any:
    from tests import hf_workers

    return hf_workers.build("qwen3", use_cache=False)


def fails_on_rank_1() -> Any:
    """The Llama, except on rank 1, whose factory raises (its weights are missing)."""
    if os.environ.get("RANK") == "1":
        raise RuntimeError("no weights for rank 1")
    return llama()
