"""FSDP2 over the experts EP shards apart: with fewer experts on an ep rank than
data-parallel shard ranks, each expert is split on its rows (dim 1) rather than whole
experts on some ranks and nothing on the others; the plan's gradient divide factor
reaches them as it reaches every FSDP module."""

from __future__ import annotations

import pytest

from composer_par.testing.parity import ParityCase, check_parity
from tests.test_ep import FSDP2_EP

WORKERS = "tests.ep_placement_workers"


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_one_expert_per_ep_rank_is_split_on_its_rows_at_parity() -> None:
    from composer_par.testing import run_ranks

    views = run_ranks("tests.ep_workers:layouts", 4,
                      args=(FSDP2_EP, f"{WORKERS}:one_expert_per_rank"))
    for view in views:
        # w1 is [experts, hidden, dim]: 1 expert here, its 32 rows halved over dp_shard.
        assert view["expert"] == (("dp_shard", "ep"), ("S(1)", "S(0)"), (1, 16, 32)), view
    case = ParityCase(task=f"{WORKERS}:one_expert_per_rank", plan=FSDP2_EP, world_size=4,
                      steps=3, lr=0.5, reference="accumulate")
    result = check_parity(case)
    result.assert_close()
    assert result.losses[-1] < result.losses[0], result.losses


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_fsdp2_gradient_divide_factor_reaches_the_experts_too() -> None:
    """FSDP2(gradient_divide_factor=1.0) (sum, torchtitan's convention) with EP: the
    experts sharded apart take the plan's factor like every other FSDP module."""
    from composer_par.testing import run_ranks

    plan = FSDP2_EP.replace('name = "fsdp2"', 'name = "fsdp2"\ngradient_divide_factor = 1.0')
    for factors in run_ranks(f"{WORKERS}:divide_factors", 4, args=(plan,)):
        assert factors == [1.0], factors
