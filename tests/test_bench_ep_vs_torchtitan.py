"""torchtitan's Qwen3-MoE under its own expert parallelism against transformers' Qwen3-MoE
with the same weights under composer_par's FSDP2 + EP, with the builders and the step
that benchmarks/bench_ep_vs_torchtitan.py times (4 gloo ranks, dp_shard x ep as torchtitan
lays them out, a few steps, no timing): the losses of every step and every parameter
after them agree within float32 rounding, and composer_par's collectives and bytes per
step are no more than torchtitan's.

Not bitwise: the two model codes round differently (torchtitan's grouped-mm over sorted
tokens and scatter-add against transformers' per-expert matmuls and index-add, summed
against averaged gradients), which AdamW's normalized first steps carry into the weights
at a small fraction of lr.
"""

from __future__ import annotations

import pytest

from composer_par.testing.distributed import run_ranks

pytest.importorskip("torchtitan")
pytest.importorskip("transformers")

WORKER = "tests.bench_ep_vs_torchtitan_workers:side_by_side"
STEPS = 3
# fp32 loss tolerance (rtol 1.3e-6, atol 1e-5); parameters: AdamW at lr 1e-3 moves each
# weight by up to about lr per step, a rounding difference in its gradient by far less.
LOSS_RTOL, LOSS_ATOL = 1.3e-6, 1e-5
PARAM_ATOL = 1e-5


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", ["ep2", "ep4"])
def test_ep_matches_torchtitan_with_no_more_bytes(layout: str) -> None:
    from tests.bench_ep_vs_torchtitan_workers import bench

    results = run_ranks(WORKER, 4, args=(layout, STEPS), timeout=160)
    for rank, r in enumerate(results):
        theirs = r[layout]["losses"]["torchtitan"]
        ours = r[layout]["losses"]["composer_par"]
        assert len(theirs) == len(ours) == STEPS
        assert ours == pytest.approx(theirs, rel=LOSS_RTOL, abs=LOSS_ATOL), (rank, theirs, ours)
        # The training moved the weights and the loss: comparing untouched models, or one
        # step's loss repeated, proves nothing.
        assert r[layout]["changed"] > 1e-4, (rank, r[layout]["changed"])
        assert len(set(theirs)) == STEPS, (rank, theirs)
        # Every rank's full parameters, under torchtitan's names, all of them compared.
        assert r[layout]["param_diff"] <= PARAM_ATOL, (rank, r[layout]["param_diff"])
    report = bench().summarize(results, 0)[layout]
    theirs, ours = report["sides"]["torchtitan"], report["sides"]["composer_par"]
    # Both sides moved tokens by all-to-all: torchtitan's path ran with expert parallelism.
    assert theirs["kinds"]["all_to_all"]["calls"] > 0
    assert ours["kinds"]["all_to_all"]["calls"] > 0
    assert ours["bytes"] <= theirs["bytes"], (ours["kinds"], theirs["kinds"])
    assert ours["calls"] <= theirs["calls"], (ours["kinds"], theirs["kinds"])
