"""transformers' own FSDP and expert parallelism (``DistributedConfig(fsdp_size, ep_size)``)
against composer_par's FSDP2 + EP on the same Qwen3-MoE and weights, with the builders
and the step that benchmarks/bench_ep_vs_transformers.py times (4 gloo ranks, fsdp 4 x
ep 2, a few steps, no timing): the losses of every step and every parameter after them
agree within float32 rounding (both dispatch by all-to-all and run the model's own
experts forward, with other orders of sums), and composer_par's collectives and bytes
per step are no more than transformers'.
"""

from __future__ import annotations

import pytest

from composer_par.testing.distributed import run_ranks

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.distributed")

WORKER = "tests.bench_ep_vs_transformers_workers:side_by_side"
STEPS = 3
LOSS_RTOL, LOSS_ATOL = 1.3e-6, 1e-5
PARAM_ATOL = 1e-5


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_ep_matches_transformers_with_no_more_bytes() -> None:
    from tests.bench_ep_vs_transformers_workers import bench

    results = run_ranks(WORKER, 4, args=("ep2", STEPS), timeout=160)
    for rank, r in enumerate(results):
        theirs = r["ep2"]["losses"]["transformers"]
        ours = r["ep2"]["losses"]["composer_par"]
        assert len(theirs) == len(ours) == STEPS
        assert ours == pytest.approx(theirs, rel=LOSS_RTOL, abs=LOSS_ATOL), (rank, theirs, ours)
        assert r["ep2"]["changed"] > 1e-4, (rank, r["ep2"]["changed"])
        assert len(set(theirs)) == STEPS, (rank, theirs)
        assert r["ep2"]["param_diff"] <= PARAM_ATOL, (rank, r["ep2"]["param_diff"])
    report = bench()._shared().summarize(results, 0, bench().SIDES)["ep2"]
    theirs, ours = report["sides"]["transformers"], report["sides"]["composer_par"]
    # transformers' side moved tokens by all-to-all: its expert parallelism ran.
    assert theirs["kinds"]["all_to_all"]["calls"] > 0
    assert ours["kinds"]["all_to_all"]["calls"] > 0
    assert ours["bytes"] <= theirs["bytes"], (ours["kinds"], theirs["kinds"])
    assert ours["calls"] <= theirs["calls"], (ours["kinds"], theirs["kinds"])
