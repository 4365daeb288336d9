"""FSDP2 over the experts EP shards apart: with fewer experts on an ep rank than
data-parallel shard ranks, each expert is split on its rows (dim 1) rather than whole
experts on some ranks and nothing on the others; the plan's gradient divide factor
reaches them as it reaches every FSDP module. Without EP, FSDP2 does the same with any
parameter of fewer rows than shard ranks (fused experts above all), rather than pad
them to the shard count."""

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


FSDP2_ALONE = """
[mesh]
dp_shard = 4

[[plugins]]
name = "fsdp2"

[[plugins]]
name = "meta_init"
seed = 7
"""


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp2_alone_splits_fewer_experts_than_ranks_on_their_rows_at_parity() -> None:
    """Two fused experts over dp_shard 4: on dim 0 FSDP2 would pad them to four rows,
    doubling their bytes on every rank; split on dim 1 each rank holds a quarter."""
    from composer_par.testing import run_ranks

    views = run_ranks("tests.ep_workers:layouts", 4,
                      args=(FSDP2_ALONE, f"{WORKERS}:one_expert_per_rank"))
    for view in views:
        assert view["expert"] == (("dp_shard",), ("S(1)",), (2, 8, 32)), view
        assert view["dense"] == (("dp_shard",), ("S(0)",), (8, 32)), view
    case = ParityCase(task=f"{WORKERS}:one_expert_per_rank", plan=FSDP2_ALONE,
                      world_size=4, steps=3, lr=0.5, reference="accumulate")
    result = check_parity(case)
    result.assert_close()
    assert result.losses[-1] < result.losses[0], result.losses


def test_a_dim_that_does_not_split_evenly_keeps_fsdp2s_own_placement() -> None:
    """FSDP2 refuses an uneven split of any tensor dim but the first (NotImplementedError
    at fully_shard), so such a tensor stays on dim 0, padded."""
    import torch
    from composer_par.plugins.fsdp2 import _shard_placement
    from torch.distributed.tensor import Shard

    assert _shard_placement(4, torch.empty(2, 32, 3)) == Shard(1)
    assert _shard_placement(4, torch.empty(2, 30)) is None  # 30 columns over 4 ranks
    assert _shard_placement(4, torch.empty(8, 30)) is None  # enough rows: torch's default
    assert _shard_placement(4, torch.empty(2)) is None  # one tensor dim: nothing else
