"""CommCounter counts every collective a step issues, the ones DTensor issues inside its
own dispatch included, and agrees with torch's ``CommDebugMode`` call for call."""

from __future__ import annotations

import pytest

from composer_par import Registry
from composer_par.testing.distributed import run_ranks

BASE = '[[plugins]]\nname = "meta_init"\nseed = 3\n'
TP_LOSS_PARALLEL = '[mesh]\ntp = 2\n[[plugins]]\nname = "tp"\nloss_parallel = true\n' + BASE
TP_GATHERED = '[mesh]\ntp = 2\n[[plugins]]\nname = "tp"\n' + BASE

pytestmark = pytest.mark.skipif("tp" not in set(Registry().names()),
                                reason="the tp plugin is not installed")


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("plan", [
    TP_LOSS_PARALLEL,
    '[mesh]\ndp_shard = 2\ntp = 2\n[[plugins]]\nname = "tp"\nsequence_parallel = true\n'
    'loss_parallel = true\n[[plugins]]\nname = "fsdp2"\n' + BASE,
    '[mesh]\ndp_replicate = 2\ndp_shard = 2\n[[plugins]]\nname = "hsdp"\n'
    '[[plugins]]\nname = "fsdp2"\n' + BASE,
], ids=["tp loss parallel", "fsdp2 x tp sp+lp", "hsdp x fsdp2"])
def test_the_counter_agrees_with_comm_debug_mode_on_every_rank(plan: str) -> None:
    world = 2 if "dp_shard" not in plan else 4
    results = run_ranks("tests.comm_counter_workers:both_counts", world, args=(plan,),
                        timeout=240)
    for rank, result in enumerate(results):
        assert result["ours"] == result["theirs"], (rank, result)
        assert sum(result["ours"].values()) > 0, rank


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_loss_parallel_reductions_inside_dtensor_dispatch_are_counted() -> None:
    # The same TP plan with and without loss parallel. Without it the head's logits are
    # gathered (one all-gather, issued by the TP hooks, outside DTensor's dispatch). With
    # it, cross-entropy runs on vocabulary-sharded logits and DTensor's loss-parallel ops
    # all-reduce one fp32 value per token three times (max, sum of exponentials, target
    # logit): calls a counter that lets DTensor run under it never sees.
    sharded = run_ranks("tests.comm_counter_workers:loss_calls", 2,
                        args=(TP_LOSS_PARALLEL,), timeout=240)
    gathered = run_ranks("tests.comm_counter_workers:loss_calls", 2,
                         args=(TP_GATHERED,), timeout=240)
    from composer_par.testing.tasks import llama

    tokens = llama.global_batch * (llama.seq_len - 1)  # the next-token loss's targets
    for rank in range(2):
        kinds_sharded = [c["kind"] for c in sharded[rank]]
        kinds_gathered = [c["kind"] for c in gathered[rank]]
        assert kinds_gathered.count("all_gather") == 1
        assert "all_gather" not in kinds_sharded
        extra = kinds_sharded.count("all_reduce") - kinds_gathered.count("all_reduce")
        assert extra == 3, (rank, kinds_sharded, kinds_gathered)
        per_token = [c for c in sharded[rank] if c["bytes"] == tokens * 4]
        assert len(per_token) == 3 and all(c["dtypes"] == ["float32"] for c in per_token)
