"""Golden collective counts: how many all-gathers, reduce-scatters and all-reduces one
training step issues on each mesh dim, per plan, derived from the model's structure.

An extra redistribute (a style that gathers twice, a data-parallel dim that all-reduces
what it should reduce-scatter, a checkpoint that recomputes a collective) changes a count
and fails here. Each plan trains two steps (forward, backward, AdamW step, zero_grad)
under :class:`composer_par.testing.comm_count.CommCounter`; every rank's every step must
give the golden counts (the layouts are symmetric, and step 2 must not differ from
step 1, whose FSDP lazy init must not communicate).

The model is the tasks' Llama: ``L = 2`` blocks (``layers.0``, ``layers.1``, each
RMSNorm, attention with wq/wk/wv/wo, RMSNorm, SwiGLU with w1/w3/w2) and the root's own
parameters (``tok_embeddings``, ``norm``, ``output``). FSDP2 makes ``L + 1`` groups: one
per block and the root's.

FSDP2 per step, over its shard dim, with its default ``reshard_after_forward`` (every
group reshards after forward but two: the root's, as torch's default, since its
parameters are needed first in backward; and the last block's, whose backward follows its
forward at once):

* forward: one all-gather per group: ``L + 1``;
* backward: one all-gather per resharded group: ``L - 1``;
* gradients: one reduce-scatter per group: ``L + 1``.

HSDP adds, over its replicate dim, one all-reduce per group of the reduce-scattered
gradients: ``L + 1`` (and HSDP alone all-reduces the whole gradients: ``L + 1``).

TP with the auto plan, no sequence parallel (colwise wq/wk/wv/w1/w3, rowwise wo/w2, the
token embedding rowwise, the output head colwise with gathered logits, the norms
replicated), over tp:

* forward: each rowwise layer all-reduces its partial output: 2 per block (wo, w2), and
  the embedding 1 (its vocabulary shards give partial rows): ``2L + 1`` all-reduces; the
  head gathers its vocabulary-sharded logits: 1 all-gather;
* backward: each colwise layer's input gradient is partial (a sum over its output
  shards). Attention and the feed-forward each turn their replicated input into one
  DTensor that their colwise layers share (``shared_input``): wq, wk and wv's partial
  gradients add up, and so do w1 and w3's, and each sum is all-reduced once: 2 per
  block, and the head 1: ``2L + 1`` all-reduces (one per colwise layer, as torch's
  ColwiseParallel alone does, would be ``5L + 1``). Rowwise layers and the embedding need
  nothing (a replicated gradient is sliced locally).

So TP: ``4L + 2`` all-reduces and 1 all-gather per step.

Activation checkpointing recomputes a block's forward in backward, through the block's
class forward, not its ``__call__``: FSDP's hooks on the block do not run again (no extra
all-gather), TP's hooks on the Linears inside do. One might expect the 2 rowwise
all-reduces of each block again (``+2L``), but torch's non-reentrant checkpoint stops
recomputing as soon as it has rebuilt every tensor backward needs ("early stop", on by
default). The last such tensor of a block is w2's input (SwiGLU's product): w2's matmul,
its all-reduce and the residual add after it save nothing for backward, so they are
never recomputed. wo's all-reduce is (its output feeds the residual stream, which
ffn_norm and the next residual add need): ``+L`` on tp, measured with full
checkpointing; with ``set_checkpoint_early_stop(False)`` it is ``+2L``. Selective
checkpointing saves collective outputs (and matmul outputs) by default, so its backward
issues no collective again: the counts without checkpointing.
"""

from __future__ import annotations

import pytest

from composer_par.testing.distributed import run_ranks

L = 2  # blocks of the tasks' Llama (LlamaTask.n_layers)
GROUPS = L + 1  # FSDP2 / replicate groups: each block, and the root

# -- the golden counts, derived (see the module docstring) -----------------------------------

FSDP2_DIM = {"all_gather": GROUPS + L - 1, "reduce_scatter": GROUPS}  # 3 + 1 = 4, 3
REPLICATE_DIM = {"all_reduce": GROUPS}  # 3
TP_DIM = {"all_reduce": (2 * L + 1) + (2 * L + 1), "all_gather": 1}  # 5 + 5 = 10, 1
# Checkpointing recomputes wo's all-reduce, once per block (early stop spares w2's).
TP_DIM_RECOMPUTED = {"all_reduce": TP_DIM["all_reduce"] + L, "all_gather": 1}  # 12, 1


def plan_toml(mesh: str, *plugins: str) -> str:
    tables = "\n".join(f"[[plugins]]\n{p.strip()}\n" for p in plugins)
    return f"[mesh]\n{mesh}\n\n{tables}\n[[plugins]]\nname = \"meta_init\"\nseed = 3\n"


FSDP2_ = 'name = "fsdp2"'
HSDP_ = 'name = "hsdp"'
TP_ = 'name = "tp"'
AC_FULL = 'name = "activation_checkpoint"\nmode = "full"'
AC_SELECTIVE = 'name = "activation_checkpoint"\nmode = "selective"'

# name -> (plan, golden {mesh dim label: {kind: calls}})
FOUR_RANKS: dict[str, tuple[str, dict[str, dict[str, int]]]] = {
    "fsdp2 4": (plan_toml("dp_shard = 4", FSDP2_), {"dp_shard": FSDP2_DIM}),
    # Checkpointing recomputes inside the block's forward, under FSDP's unshard from
    # the pre-backward hook: FSDP's counts do not change.
    "fsdp2 4, full checkpointing": (plan_toml("dp_shard = 4", FSDP2_, AC_FULL),
                                    {"dp_shard": FSDP2_DIM}),
    # An int keeps parameters gathered over runs of 2 ranks after forward: forward
    # gathers over dp_shard (L + 1), backward over the run of 2 (a subgroup of dp_shard),
    # and an explicit reshard_after_forward applies to the root too (only torch's
    # default exempts it): L + 1 there as well.
    "fsdp2 4, reshard_after_forward 2": (
        plan_toml("dp_shard = 4", 'name = "fsdp2"\nreshard_after_forward = 2'),
        {"dp_shard": {"all_gather": GROUPS, "reduce_scatter": GROUPS},
         "dp_shard (subgroup)": {"all_gather": GROUPS}}),
    "hsdp x fsdp2 2x2": (plan_toml("dp_replicate = 2\ndp_shard = 2", HSDP_, FSDP2_),
                         {"dp_shard": FSDP2_DIM, "dp_replicate": REPLICATE_DIM}),
    # Replicate-only: no all-gather, no reduce-scatter; one all-reduce per group.
    "hsdp 4": (plan_toml("dp_replicate = 4", HSDP_), {"dp_replicate": REPLICATE_DIM}),
    "fsdp2 x tp 2x2": (plan_toml("dp_shard = 2\ntp = 2", FSDP2_, TP_),
                       {"dp_shard": FSDP2_DIM, "tp": TP_DIM}),
    "fsdp2 x tp 2x2, full checkpointing": (
        plan_toml("dp_shard = 2\ntp = 2", FSDP2_, TP_, AC_FULL),
        {"dp_shard": FSDP2_DIM, "tp": TP_DIM_RECOMPUTED}),
    "fsdp2 x tp 2x2, selective checkpointing": (
        plan_toml("dp_shard = 2\ntp = 2", FSDP2_, TP_, AC_SELECTIVE),
        {"dp_shard": FSDP2_DIM, "tp": TP_DIM}),
}

# torchtitan's plan written out: an explicit plan gets what it says, one all-reduce per
# colwise layer's input gradient (5L + 1), unless it gives attention and the feed-forward
# shared_input itself (2L + 1, as the auto plan does).
EXPLICIT_TP = """name = "tp"
[plugins.plan]
"tok_embeddings" = "embedding_rowwise"
"layers.*.attention.wq" = "colwise"
"layers.*.attention.wk" = "colwise"
"layers.*.attention.wv" = "colwise"
"layers.*.attention.wo" = "rowwise"
"layers.*.feed_forward.w1" = "colwise"
"layers.*.feed_forward.w3" = "colwise"
"layers.*.feed_forward.w2" = "rowwise"
"output" = "colwise_gather"
"""
SHARED_INPUT_TP = EXPLICIT_TP + (
    '"layers.*.attention" = "shared_input"\n"layers.*.feed_forward" = "shared_input"\n')
TP_DIM_PER_LAYER = {"all_reduce": (2 * L + 1) + (5 * L + 1), "all_gather": 1}  # 16, 1

TWO_RANKS: dict[str, tuple[str, dict[str, dict[str, int]]]] = {
    "tp 2": (plan_toml("tp = 2", TP_), {"tp": TP_DIM}),
    "tp 2, explicit plan": (plan_toml("tp = 2", EXPLICIT_TP), {"tp": TP_DIM_PER_LAYER}),
    "tp 2, explicit plan with shared_input": (plan_toml("tp = 2", SHARED_INPUT_TP),
                                              {"tp": TP_DIM}),
    "tp 2, full checkpointing": (plan_toml("tp = 2", TP_, AC_FULL), {"tp": TP_DIM_RECOMPUTED}),
    "tp 2, selective checkpointing": (plan_toml("tp = 2", TP_, AC_SELECTIVE),
                                      {"tp": TP_DIM}),
}

MESH_3D = "dp_replicate = 2\ndp_shard = 2\ntp = 2"
EIGHT_RANKS: dict[str, tuple[str, dict[str, dict[str, int]]]] = {
    # Each mesh dim does its own part; nothing crosses into another dim's groups.
    "hsdp x fsdp2 x tp 2x2x2": (
        plan_toml(MESH_3D, HSDP_, FSDP2_, TP_),
        {"dp_replicate": REPLICATE_DIM, "dp_shard": FSDP2_DIM, "tp": TP_DIM}),
    "hsdp x fsdp2 x tp 2x2x2, full checkpointing": (
        plan_toml(MESH_3D, HSDP_, FSDP2_, TP_, AC_FULL),
        {"dp_replicate": REPLICATE_DIM, "dp_shard": FSDP2_DIM, "tp": TP_DIM_RECOMPUTED}),
}


def check_golden(plans: dict[str, tuple[str, dict[str, dict[str, int]]]], world: int,
                 timeout: float, early_stop: bool = True) -> None:
    measured = run_ranks("tests.collective_count_workers:count_steps", world,
                         args=({name: plan for name, (plan, _) in plans.items()},),
                         kwargs={"early_stop": early_stop}, timeout=timeout)
    mismatches = []
    for name, (_, golden) in plans.items():
        for rank, per_rank in enumerate(measured):
            for step, counts in enumerate(per_rank[name], start=1):
                if counts != golden:
                    mismatches.append(f"{name}, rank {rank}, step {step}: measured {counts}, "
                                      f"golden {golden}")
    assert not mismatches, "\n".join(mismatches)


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_golden_counts_on_4_ranks() -> None:
    check_golden(FOUR_RANKS, 4, timeout=450)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_golden_counts_on_2_ranks() -> None:
    check_golden(TWO_RANKS, 2, timeout=250)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_without_early_stop_checkpointing_recomputes_both_rowwise_all_reduces() -> None:
    """The reason the checkpointed counts are +L, not +2L: torch's early stop."""
    both = {"all_reduce": TP_DIM["all_reduce"] + 2 * L, "all_gather": 1}  # 14, 1
    # Selective checkpointing saves collective outputs: none again, early stop or not.
    plans = {name: (plan, {"tp": both if "full" in name else TP_DIM})
             for name, (plan, _) in TWO_RANKS.items() if "checkpointing" in name}
    assert len(plans) == 2
    check_golden(plans, 2, timeout=250, early_stop=False)


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_golden_counts_on_8_ranks() -> None:
    check_golden(EIGHT_RANKS, 8, timeout=450)


def test_the_golden_numbers_follow_the_derivation() -> None:
    # The arithmetic of the docstring for the tasks' 2-block Llama, spelled out.
    assert FSDP2_DIM == {"all_gather": 4, "reduce_scatter": 3}
    assert REPLICATE_DIM == {"all_reduce": 3}
    assert TP_DIM == {"all_reduce": 10, "all_gather": 1}
    assert TP_DIM_RECOMPUTED == {"all_reduce": 12, "all_gather": 1}
    assert TP_DIM_PER_LAYER == {"all_reduce": 16, "all_gather": 1}
    from composer_par.testing.tasks import llama

    assert llama.n_layers == L
