"""HSDP with FSDP2 beside expert parallelism, dp_replicate(2) x dp_shard(2) x ep(2) on 8
ranks, trains the MoE Llama as one process does.

The dense parameters are sharded over dp_shard x ep and replicated over dp_replicate; the
experts (shard apart) are Shard(0) over ep, then sharded over dp_shard and replicated
over dp_replicate; every gradient is divided by the 8 data shards. Every rank's view of
every parameter is compared with the reference, so a copy over dp_replicate that drifted
shows in its rank's view.
"""

from __future__ import annotations

import pytest

from composer_par.testing import run_ranks
from composer_par.testing.parity import ParityCase, check_parity

WORKERS = "tests.ep_workers"

HSDP_FSDP2_EP = """
[mesh]
dp_replicate = 2
dp_shard = 2
ep = 2

[[plugins]]
name = "hsdp"

[[plugins]]
name = "fsdp2"

[[plugins]]
name = "ep"

[[plugins]]
name = "meta_init"
seed = 7
"""


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_hsdp_x_fsdp2_x_ep_matches_single_process() -> None:
    case = ParityCase(task=f"{WORKERS}:moe_llama_shared", plan=HSDP_FSDP2_EP, world_size=8,
                      steps=3, lr=0.5, reference="accumulate")
    result = check_parity(case, timeout=300)
    result.assert_close()
    assert result.losses[-1] < result.losses[0], result.losses


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_hsdp_x_fsdp2_x_ep_lays_out_experts_and_dense_weights() -> None:
    """An expert weight: replicated over dp_replicate, sharded over dp_shard after its
    Shard(0) over ep (2 of 4 experts, 1 per rank); a dense weight: replicated over
    dp_replicate, sharded over dp_shard x ep flattened."""
    views = run_ranks(f"{WORKERS}:layouts", 8, args=(HSDP_FSDP2_EP,), timeout=200)
    for view in views:
        assert view["expert"] == (("dp_replicate", "dp_shard", "ep"),
                                  ("R", "_S(0, 2)", "S(0)"), (1, 32, 32))
        assert view["dense"] == (("dp_replicate", "dp_shard_ep"),
                                 ("R", "S(0)"), (8, 32))
