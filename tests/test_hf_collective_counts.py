"""Golden collective counts per training step for Hugging Face models under FSDP2 and
FSDP2 x TP (4 gloo ranks), each case also at parity with one process: every rank's
parameter parts and the losses against a single-process reference on the global batch
(tests/hf_workers.py, as the model matrix checks them).

The models are the test matrix's tiny Llama and Qwen3 (``L = 2`` blocks
``model.layers.0``, ``model.layers.1``; beside them ``model.embed_tokens``,
``model.norm`` and ``lm_head``; the rotary embedding holds buffers only). Their own FSDP
plan (transformers 5.x's ``_fsdp_plan``) asks for each block and the embedding resharded
after forward, the final norm and the head kept whole; FSDP2 follows it and shards the
norm (one weight of one tensor dim) in one unit with the head, as transformers' own
``apply_fully_sharded_data_parallelism`` does. The units: 2 blocks, ``model.embed_tokens``,
``model.norm + lm_head`` (kept), and the root, which holds no parameter and communicates
nothing: ``U = L + 2`` units with parameters, ``L`` of them resharded after forward: the
embedding and every block but the last, which FSDP2 keeps gathered for its backward (it
follows at once); transformers (like torchtitan's current code) reshards it.

FSDP2 per step over dp_shard: ``U`` all-gathers in forward, ``L`` in backward (none for
the kept units), ``U`` reduce-scatters: 4 + 2 = 6 and 4. With the norm a unit of its own
(the model's plan read entry by entry) it was 9 and 5; transformers' own FSDP2 makes 7
and 4 (measured side by side in tests/test_bench_vs_transformers.py).

TP (composer_par's auto plan: the embedding rowwise, q/k/v and gate/up colwise, o and
down rowwise, the head colwise with gathered logits), over tp per step:

* forward: the embedding's partial rows all-reduced (1), each block's two rowwise
  outputs (2L); the head's vocabulary-sharded logits gathered (1 all-gather);
* backward: the input gradients of attention's q/k/v and of the MLP's gate/up, each
  group's partial sums added up before one all-reduce (``shared_input``: 2 per block,
  2L), and of the head (1);
* Qwen3 only: its per-head q and k norms see this rank's heads only, so their weights'
  gradients are partial sums, all-reduced in backward (2L).

So ``4L + 2`` all-reduces (Qwen3: ``6L + 2``) and 1 all-gather over tp. transformers' own
TP all-reduces each colwise layer's input gradient on its own (5 per block): ``7L + 2``
(Qwen3: ``9L + 2``), measured side by side too.
"""

from __future__ import annotations

import pytest

from composer_par.testing.distributed import run_ranks
from tests import hf_workers

pytest.importorskip("transformers")

L = 2  # blocks of the matrix's models (hf_workers.COMMON)
UNITS = L + 2  # the blocks, the embedding, the final norm with the head (the root: empty)
RESHARDED = L  # the embedding, the blocks but the last (the norm and head kept whole)
FSDP2_DIM = {"all_gather": UNITS + RESHARDED, "reduce_scatter": UNITS}  # 4 + 2 = 6, 4


def tp_dim(family: str) -> dict[str, int]:
    norms = 2 * L if family == "qwen3" else 0  # per-head q/k norms' partial gradients
    return {"all_reduce": (1 + 2 * L) + (2 * L + 1) + norms, "all_gather": 1}


GOLDEN: dict[tuple[str, str], dict[str, dict[str, int]]] = {
    ("llama", "fsdp2"): {"dp_shard": FSDP2_DIM},
    ("qwen3", "fsdp2"): {"dp_shard": FSDP2_DIM},
    ("llama", "fsdp2_tp"): {"dp_shard": FSDP2_DIM, "tp": tp_dim("llama")},
    ("qwen3", "fsdp2_tp"): {"dp_shard": FSDP2_DIM, "tp": tp_dim("qwen3")},
}
CASES = list(GOLDEN)
STEPS = 3


def test_golden_counts_are_derived_as_documented() -> None:
    assert GOLDEN[("llama", "fsdp2")] == {"dp_shard": {"all_gather": 6, "reduce_scatter": 4}}
    assert GOLDEN[("llama", "fsdp2_tp")]["tp"] == {"all_reduce": 10, "all_gather": 1}
    assert GOLDEN[("qwen3", "fsdp2_tp")]["tp"] == {"all_reduce": 14, "all_gather": 1}


def test_the_units_are_the_ones_the_counts_derive_from() -> None:
    from composer_par import FSDP2
    from composer_par.blocks import find_blocks

    for family in ("llama", "qwen3"):
        model = hf_workers.build(family)
        units, found = FSDP2().unit_list(model, find_blocks(model))
        assert not found
        assert [(u.name, u.kind, u.style) for u in units] == [
            ("model.layers.0", "block", None), ("model.layers.1", "block", None),
            ("model.embed_tokens", "model plan", True),
            ("model.norm + lm_head", "model plan", False), ("root", "root", None)], family
        held = {id(p) for u in units[:-1] for m in u.modules for p in m.parameters()}
        assert held == {id(p) for p in model.parameters()}  # the root holds nothing


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_hf_models_give_the_golden_counts_at_parity_on_4_ranks() -> None:
    results = run_ranks("tests.hf_workers:train_cases", 4, args=(CASES, STEPS, True),
                        timeout=560)
    found = hf_workers.problems(results, CASES)
    assert not found, "\n".join(found)
    mismatches = []
    for rank, rows in enumerate(results):
        for row in rows:
            expected = GOLDEN[(row["family"], row["plan"])]
            assert len(row["counts"]) == STEPS
            for step, counts in enumerate(row["counts"], start=1):
                if counts != expected:
                    mismatches.append(f"{row['family']} x {row['plan']}, rank {rank}, step "
                                      f"{step}: measured {counts}, golden {expected}")
    assert not mismatches, "\n".join(mismatches)


# -- TP with sequence parallel (2 ranks) ---------------------------------------------------
#
# Megatron's count, per block and direction: attention's and the MLP's input gathered once
# each and their outputs reduce-scattered; +1 each way at the embedding (its output
# reduce-scattered onto the sequence) and the head (its input gathered); the logits
# gathered once. Each column-parallel layer takes its region's gathered input as it is, so
# their partial input gradients add up and the region's gather reduce-scatters the sum
# once (declared sequence-sharded, torch's style redistributed it anyway, and its backward
# all-reduced each layer's part: 5 all-reduces per Llama block). The norms' replicated
# weights (and LayerNorm biases) get partial gradients: one all-reduce each.
SP_FAMILIES = {"llama": 2 * L + 1, "stablelm": 2 * (2 * L + 1)}  # family -> norm tensors


def sp_tp_dim(norm_tensors: int) -> dict[str, int]:
    return {"all_gather": 2 * (2 * L + 1) + 1, "reduce_scatter": 2 * (2 * L + 1),
            "all_reduce": norm_tensors}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_sequence_parallel_gathers_and_scatters_once_per_region_as_estimated() -> None:
    """Llama under its own plan and StableLm under the auto plan from its names: the
    counts above on both ranks, each step, at parity, and the estimate's."""
    import torch

    from composer_par.estimate import ModelShape, Workload, estimate_plan

    cases = [(family, "tp_sp") for family in SP_FAMILIES]
    results = hf_workers.trained(cases, 2, timeout=240, steps=STEPS, count=True)
    for rows in results:
        for row in rows:
            expected = {"tp": sp_tp_dim(SP_FAMILIES[row["family"]])}
            assert row["counts"] == [expected] * STEPS, (row["family"], row["counts"])
    for family, norms in SP_FAMILIES.items():
        with torch.device("meta"):
            shape = ModelShape.from_module(hf_workers.build(family))
        est = estimate_plan(hf_workers.make_plan("tp_sp", 2), shape,
                            Workload(seq=hf_workers.SEQ, micro_batch=hf_workers.GLOBAL_BATCH))
        [tp] = [t for t in est.traffic if t.dim.name == "tp"]
        calls: dict[str, int] = {}
        for c in tp.collectives:
            calls[c.kind] = calls.get(c.kind, 0) + c.calls
        assert calls == sp_tp_dim(norms), family


# -- MoE blocks, per-head norms and whole layers under TP (2 ranks) ------------------------
#
# The auto plan splits a Hugging Face model's fused routed experts (each rank 1/tp of
# every expert: transformers' own plans up to 5.24), so each rank's experts give part of
# every output: the MoE block's output is all-reduced in forward (as a dense MLP's is),
# its input gradient in backward, and its router's gradient once more (``M`` MoE blocks).
# Qwen3's per-head q and k norms see this rank's heads: their gradients are all-reduced
# too (``H`` of them). Under sequence parallel a MoE block computes on plain tensors (TP's
# sequence_region_local): its output and its input gradient are all-reduced where a
# dense MLP's are reduce-scattered, and its router's gradient joins the norms'.
MOE_FAMILIES = {"mixtral": 0, "qwen3_moe": 2 * L, "qwen2_moe": 0, "granitemoe": 0}


def moe_tp_dim(plan: str, head_norms: int) -> dict[str, int]:
    moe = L  # every block of the matrix's MoE models is a MoE block
    if plan == "tp":
        return {"all_reduce": (1 + 2 * L) + (2 * L + 1) + moe + head_norms, "all_gather": 1}
    return {"all_gather": 2 * (2 * L + 1) + 1, "reduce_scatter": 2 * (2 * L + 1) - 2 * moe,
            "all_reduce": 2 * moe + (2 * L + 1) + moe + head_norms}


def test_moe_golden_counts_are_derived_as_documented() -> None:
    assert moe_tp_dim("tp", 0) == {"all_reduce": 12, "all_gather": 1}
    assert moe_tp_dim("tp_sp", 4) == {"all_gather": 11, "reduce_scatter": 6,
                                      "all_reduce": 15}


def _estimated_calls(family: str, plan: str) -> dict[str, int]:
    import torch

    from composer_par.estimate import ModelShape, Workload, estimate_plan

    with torch.device("meta"):
        shape = ModelShape.from_module(hf_workers.build(family))
    est = estimate_plan(hf_workers.make_plan(plan, 2), shape,
                        Workload(seq=hf_workers.SEQ, micro_batch=hf_workers.GLOBAL_BATCH))
    [tp] = [t for t in est.traffic if t.dim.name == "tp"]
    calls: dict[str, int] = {}
    for c in tp.collectives:
        calls[c.kind] = calls.get(c.kind, 0) + c.calls
    return calls


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_moe_blocks_and_per_head_norms_count_as_estimated() -> None:
    """The MoE families under TP with and without sequence parallel; Llama, Qwen3 and
    Gemma 3 (per-head norms) and Qwen2 (split biases) under TP, Qwen3 and Qwen2 with
    sequence parallel too: the counts above on both ranks, each step, at parity, and the
    estimate's."""
    golden = {(f, p): moe_tp_dim(p, norms) for f, norms in MOE_FAMILIES.items()
              for p in ("tp", "tp_sp")}
    golden.update({("qwen3", "tp"): tp_dim("qwen3"), ("gemma3", "tp"): tp_dim("qwen3"),
                   ("qwen2", "tp"): tp_dim("llama"), ("llama", "tp"): tp_dim("llama"),
                   ("qwen3", "tp_sp"): sp_tp_dim(2 * L + 1 + 2 * L),
                   ("qwen2", "tp_sp"): sp_tp_dim(2 * L + 1)})
    results = hf_workers.trained(list(golden), 2, timeout=240, steps=STEPS, count=True)
    found = hf_workers.problems(results, list(golden))
    assert not found, "\n".join(found)
    for rows in results:
        for row in rows:
            expected = {"tp": golden[(row["family"], row["plan"])]}
            assert row["counts"] == [expected] * STEPS, (row["family"], row["plan"],
                                                         row["counts"])
    for (family, plan), expected in golden.items():
        assert _estimated_calls(family, plan) == expected, (family, plan)


# -- What TP splits of the model: each rank's parameters, as estimated ----------------


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_estimate_holds_what_the_tp_plan_splits_and_leaves_whole() -> None:
    """Each rank's parameter elements under TP on 2 ranks equal the estimate's: split
    fused experts (Mixtral, Qwen3-MoE), a shared expert and a router its plan leaves
    whole (Qwen2-MoE), latent attention's unlisted projections (DeepSeek-V3), fused
    projections (Phi-3), split column-parallel biases (Qwen2)."""
    import torch

    from composer_par.estimate import ModelShape, Workload, estimate_plan

    families = ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "phi3", "qwen2"]
    results = run_ranks("tests.hf_workers:held_elements", 2, args=(families, "tp"),
                        timeout=240)
    for family in families:
        with torch.device("meta"):
            shape = ModelShape.from_module(hf_workers.build(family))
        est = estimate_plan(hf_workers.make_plan("tp", 2), shape,
                            Workload(seq=hf_workers.SEQ, micro_batch=hf_workers.GLOBAL_BATCH))
        assert [r[family] for r in results] == [est.memory.local_params] * 2, family
